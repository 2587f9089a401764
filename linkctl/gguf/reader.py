"""The bounded GGUF header reader: magic, version, metadata and tensor infos.

A minimal GGUF v2/v3 header parser: magic, version, tensor count, metadata
key/value pairs (typed values, arrays included) and tensor infos (name,
dims, type, offset). It reads only the header bytes, never tensor data, so a
100+ GB model or a header-only file (tensor data absent) reads in
milliseconds. (The ``gguf`` package's GGUFReader memory-maps the whole file
and builds numpy views of every tensor, which fails on header-only files.)
Every count and length a header claims is checked against the limits below and
the bytes left in the file before anything is allocated or read.

Bytes per tensor come from ggml's (block size, type size) table,
``GGML_QUANT_SIZES`` in the ``gguf`` package: ``nelements / block * type_size``.
"""

from __future__ import annotations

import importlib.util
import os
import re
import struct
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

from linkctl.core.errors import InputError

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
_CHUNK = 1 << 20
# Numeric arrays longer than this are skipped, not kept (per-layer arrays are ~100 long;
# tokenizer scores and merges are 100k+ and not needed here).
_KEEP_ARRAY_MAX = 4096

# GGUFValueType: 0 u8, 1 i8, 2 u16, 3 i16, 4 u32, 5 i32, 6 f32, 7 bool, 8 string,
# 9 array, 10 u64, 11 i64, 12 f64
_SCALAR = {
    0: "<B",
    1: "<b",
    2: "<H",
    3: "<h",
    4: "<I",
    5: "<i",
    6: "<f",
    7: "<?",
    10: "<Q",
    11: "<q",
    12: "<d",
}
_STRING, _ARRAY = 8, 9

_U64 = struct.Struct("<Q")
_BLK_RE = re.compile(r"^blk\.(\d+)\.")


@cache
def _constants() -> Any:
    """gguf's constants module. gguf/constants.py imports only the standard library,
    so it is loaded on its own: importing the gguf package pulls in numpy (~0.4 s)."""
    spec = importlib.util.find_spec("gguf")
    if spec and spec.submodule_search_locations:
        path = os.path.join(next(iter(spec.submodule_search_locations)), "constants.py")
        if os.path.isfile(path):
            s = importlib.util.spec_from_file_location("_linkctl_gguf_constants", path)
            if s and s.loader:
                mod = importlib.util.module_from_spec(s)
                s.loader.exec_module(mod)
                return mod
    import gguf.constants  # pragma: no cover - unusual installs

    return gguf.constants  # pragma: no cover


@cache
def quant_sizes() -> dict[int, tuple[int, int]]:
    """{ggml type id: (block size, bytes per block)} from gguf's GGML_QUANT_SIZES."""
    return {int(k): (int(v[0]), int(v[1])) for k, v in _constants().GGML_QUANT_SIZES.items()}


@cache
def type_name(type_id: int) -> str:
    """The ggml type's name as llama.cpp prints it (Q4_K, Q8_0, F16, MXFP4, ...)."""
    try:
        return str(_constants().GGMLQuantizationType(type_id).name)
    except ValueError:
        return f"type{type_id}"


@cache
def known_architectures() -> frozenset[str]:
    return frozenset(_constants().MODEL_ARCH_NAMES.values())


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # ggml order: ne[0] (row length) first
    type_id: int
    offset: int
    nbytes: int

    @property
    def nelements(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def layer(self) -> int | None:
        m = _BLK_RE.match(self.name)
        return int(m.group(1)) if m else None

    @property
    def is_expert(self) -> bool:
        """A routed-expert tensor (stacked experts: ffn_{gate,up,down}[_up]_exps)."""
        return "_exps" in self.name and "_shexp" not in self.name


def tensor_nbytes(shape: tuple[int, ...], type_id: int, name: str = "?") -> int:
    sizes = quant_sizes()
    if type_id not in sizes:
        raise InputError(
            f"tensor {name!r} has unknown ggml type {type_id}",
            "update the gguf package (pip install -U gguf) or re-quantize the model",
        )
    block, tsize = sizes[type_id]
    n = 1
    for d in shape:
        n *= d
    if shape and shape[0] % block:
        raise InputError(
            f"tensor {name!r}: row length {shape[0]} is not a multiple of the block size "
            f"{block} of its type",
            "the header is corrupt; re-download the model",
        )
    return n // block * tsize


# Bounds on what a header may claim, checked before anything is allocated or read.
# ggml's own reader (ggml/src/gguf.cpp, ggml/include/ggml.h) refuses tensor names of
# GGML_MAX_NAME (64) bytes or more, more than GGML_MAX_DIMS (4) dims, element counts
# past INT64_MAX, non-power-of-2 alignments, duplicate keys and tensor names. The
# counts below are far above any published model (~1.1k tensors, ~50 keys, ~200
# blocks) and keep a hostile header's memory and time small.
MAX_TENSORS = 1 << 18
MAX_KV = 1 << 16
MAX_KEY_LEN = 1 << 16
MAX_STRING_LEN = 1 << 24  # one string value (chat templates are ~10-100 KB)
MAX_NAME_LEN = 63  # GGML_MAX_NAME - 1
MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_ARRAY_DEPTH = 2  # an array of arrays; ggml's reader takes no nesting at all
MAX_BLOCKS = 1024
MAX_HPARAM = 1 << 32  # llama.cpp holds these hyperparameters as uint32
KEEP_BUDGET = 1 << 24  # metadata bytes kept in memory (strings, short arrays) per file
_INT64_MAX = (1 << 63) - 1
# Smallest encodings: a key/value (8-byte key length, 1-byte key, 4-byte type, 1-byte
# value) and a tensor info (8-byte name length, 1-byte name, dims, type, offset).
_MIN_KV_BYTES = 14
_MIN_TENSOR_BYTES = 25


def corrupt(path: str, what: str) -> InputError:
    return InputError(f"{path}: corrupt GGUF header: {what}", "the file is damaged; fetch it again")


class _Cursor:
    """Sequential reads from the start of a file, pulling in 1 MiB chunks as needed;
    every length is checked against the bytes left in the file before it is read."""

    def __init__(self, f, path: str, size: int):
        self.f, self.path, self.size = f, path, size
        self.buf = b""
        self.pos = 0
        self.kept = 0  # metadata bytes kept, against KEEP_BUDGET

    def tell(self) -> int:
        return self.f.tell() - (len(self.buf) - self.pos)

    def remaining(self) -> int:
        return self.size - self.tell()

    def _truncated(self, n: int, what: str) -> InputError:
        return InputError(
            f"{self.path}: truncated GGUF header: {what} needs {n} bytes at byte "
            f"{self.tell()}, the file ends at byte {self.size}",
            "the download is incomplete or the file is damaged; fetch the file again",
        )

    def _need(self, n: int, what: str) -> None:
        if len(self.buf) - self.pos >= n:
            return
        if n > self.remaining():
            raise self._truncated(n, what)
        while len(self.buf) - self.pos < n:
            chunk = self.f.read(max(_CHUNK, n - (len(self.buf) - self.pos)))
            if not chunk:  # the file shrank while being read
                raise self._truncated(n, what)
            self.buf = self.buf[self.pos :] + chunk
            self.pos = 0

    def unpack(self, fmt: str, what: str) -> Any:
        n = struct.calcsize(fmt)
        self._need(n, what)
        v = struct.unpack_from(fmt, self.buf, self.pos)[0]
        self.pos += n
        return v

    def length(self, what: str, limit: int) -> int:
        n = self.unpack("<Q", f"length of {what}")
        if n > limit:
            raise corrupt(self.path, f"{what} claims {n} bytes (limit {limit})")
        if n > self.remaining():
            raise self._truncated(n, what)
        return n

    def string(self, what: str, max_len: int = MAX_STRING_LEN) -> str:
        n = self.length(what, max_len)
        self._need(n, what)
        s = self.buf[self.pos : self.pos + n]
        self.pos += n
        return s.decode("utf-8", errors="replace")

    def count(self, what: str, n: int, min_bytes: int, limit: int | None = None) -> int:
        """``n`` items of at least ``min_bytes`` each must fit in what is left."""
        if limit is not None and n > limit:
            raise corrupt(self.path, f"{what}: {n} claimed (limit {limit})")
        if n * min_bytes > self.remaining():
            raise InputError(
                f"{self.path}: truncated GGUF header: {what} {n} needs at least "
                f"{n * min_bytes} bytes, {self.remaining()} are left in the file",
                "the download is incomplete or the file is damaged; fetch the file again",
            )
        return n

    def skip_strings(self, count: int, what: str) -> None:
        # Hot loop (a 150k-token vocabulary): work on locals, refill only at buffer ends.
        unpack = _U64.unpack_from
        i = 0
        while i < count:
            buf, pos, end = self.buf, self.pos, len(self.buf)
            while i < count and pos + 8 <= end:
                n = unpack(buf, pos)[0]
                if pos + 8 + n > end:
                    break
                pos += 8 + n
                i += 1
            self.pos = pos
            if i < count:
                self.skip(self.length(what, MAX_STRING_LEN), what)
                i += 1

    def skip(self, n: int, what: str) -> None:
        if len(self.buf) - self.pos >= n:
            self.pos += n
            return
        if n > self.remaining():
            raise self._truncated(n, what)
        self.f.seek(self.tell() + n)
        self.buf, self.pos = b"", 0

    def keep(self, n: int) -> bool:
        """Whether ``n`` more bytes of metadata may be kept in memory."""
        if self.kept + n > KEEP_BUDGET:
            return False
        self.kept += n
        return True


def _read_value(cur: _Cursor, vtype: int, key: str, depth: int = 0) -> Any:
    if vtype in _SCALAR:
        return cur.unpack(_SCALAR[vtype], f"value of {key}")
    if vtype == _STRING:
        n = cur.length(f"value of {key}", MAX_STRING_LEN)
        if not cur.keep(n):
            cur.skip(n, f"value of {key}")
            return SkippedArray(n)
        cur._need(n, f"value of {key}")
        v = cur.buf[cur.pos : cur.pos + n].decode("utf-8", errors="replace")
        cur.pos += n
        return v
    if vtype == _ARRAY:
        if depth >= MAX_ARRAY_DEPTH:
            raise corrupt(cur.path, f"{key} nests arrays deeper than {MAX_ARRAY_DEPTH} levels")
        etype = cur.unpack("<I", f"array type of {key}")
        raw = cur.unpack("<Q", f"array length of {key}")
        if etype == _STRING:
            count = cur.count(f"array {key}", raw, 8)
            if count <= 16 and cur.keep(8 * count):
                return [cur.string(f"{key}[]") for _ in range(count)]
            cur.skip_strings(count, f"{key}[]")
            return SkippedArray(count)
        if etype in _SCALAR:
            fmt = _SCALAR[etype]
            size = struct.calcsize(fmt)
            count = cur.count(f"array {key}", raw, size)
            if count > _KEEP_ARRAY_MAX or not cur.keep(size * count):
                cur.skip(size * count, f"{key}[]")
                return SkippedArray(count)
            cur._need(size * count, f"{key}[]")
            vals = list(struct.unpack_from(f"<{count}{fmt[1]}", cur.buf, cur.pos))
            cur.pos += size * count
            return vals
        if etype == _ARRAY:
            count = cur.count(f"array {key}", raw, 12)  # each inner array: type + length
            return [_read_value(cur, _ARRAY, key, depth + 1) for _ in range(count)]
        raise InputError(
            f"{cur.path}: corrupt GGUF header: array {key} has unknown element type {etype}",
            "the file is damaged or from a newer GGUF version",
        )
    raise InputError(
        f"{cur.path}: corrupt GGUF header: key {key} has unknown value type {vtype}",
        "the file is damaged or from a newer GGUF version",
    )


@dataclass(frozen=True)
class SkippedArray:
    """A long array (or value) not kept; its length is what matters (e.g. the
    vocabulary size)."""

    count: int


def _read_tensor_info(cur: _Cursor, i: int) -> TensorInfo:
    name = cur.string(f"tensor #{i} name", max_len=MAX_NAME_LEN)
    n_dims = cur.unpack("<I", f"dims of {name}")
    if n_dims > MAX_DIMS:
        raise corrupt(cur.path, f"tensor {name!r} has {n_dims} dims (ggml takes at most 4)")
    shape = tuple(cur.unpack("<Q", f"shape of {name}") for _ in range(n_dims))
    n = 1
    for d in shape:
        n *= d
    if any(d > _INT64_MAX for d in shape) or n > _INT64_MAX:
        raise corrupt(cur.path, f"tensor {name!r} shape {list(shape)} overflows int64")
    ttype = cur.unpack("<I", f"type of {name}")
    offset = cur.unpack("<Q", f"offset of {name}")
    try:
        nbytes = tensor_nbytes(shape, ttype, name)
    except InputError as e:
        raise InputError(f"{cur.path}: {e.message}", e.fix) from None
    return TensorInfo(name, shape, ttype, offset, nbytes)


def read_header(path: str | os.PathLike) -> tuple[int, dict[str, Any], list[TensorInfo], int, int]:
    """(version, metadata, tensor infos, header size, file size). Reads only header bytes."""
    p = Path(path)
    try:
        size = p.stat().st_size
        f = p.open("rb")
    except FileNotFoundError:
        raise InputError(f"--model {path}: no such file", "give the path to a .gguf file") from None
    except IsADirectoryError:
        raise InputError(
            f"--model {path}: is a directory", "give the path to a .gguf file"
        ) from None
    except OSError as e:
        raise InputError(f"--model {path}: cannot read: {e.strerror}") from None
    with f:
        head = f.read(4)
        if head != GGUF_MAGIC:
            raise InputError(
                f"{path}: not a GGUF file (starts with {head!r}, expected b'GGUF')",
                "give a llama.cpp .gguf model; convert others with convert_hf_to_gguf.py",
            )
        cur = _Cursor(f, str(path), size)
        version = cur.unpack("<I", "version")
        if version not in (2, 3):
            raise InputError(
                f"{path}: GGUF version {version} is not supported (this reader knows 2 and 3)",
                "re-convert the model with a current llama.cpp",
            )
        n_tensors = cur.unpack("<Q", "tensor count")
        n_kv = cur.unpack("<Q", "metadata count")
        cur.count("metadata key count", n_kv, _MIN_KV_BYTES, MAX_KV)
        cur.count("tensor count", n_tensors, _MIN_TENSOR_BYTES, MAX_TENSORS)
        meta: dict[str, Any] = {}
        for i in range(n_kv):
            key = cur.string(f"key #{i}", max_len=MAX_KEY_LEN)
            if not key or key in meta:
                raise corrupt(str(path), f"key #{i} {key!r} is {'a duplicate' if key else 'empty'}")
            vtype = cur.unpack("<I", f"type of {key}")
            meta[key] = _read_value(cur, vtype, key)
        tensors = []
        names: set[str] = set()
        for i in range(n_tensors):
            t = _read_tensor_info(cur, i)
            if t.name in names:
                raise corrupt(str(path), f"tensor name {t.name!r} appears twice")
            names.add(t.name)
            tensors.append(t)
        end = cur.tell()
    align = meta.get("general.alignment", DEFAULT_ALIGNMENT)
    if isinstance(align, bool) or not isinstance(align, int):
        align = DEFAULT_ALIGNMENT
    if align <= 0 or align & (align - 1):
        raise corrupt(str(path), f"general.alignment {align} is not a power of 2")
    header_size = (end + align - 1) // align * align
    return version, meta, tensors, header_size, size
