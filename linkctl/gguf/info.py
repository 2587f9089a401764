"""What a GGUF model costs, read from its header only.

A minimal GGUF v2/v3 header parser: magic, version, tensor count, metadata
key/value pairs (typed values, arrays included) and tensor infos (name,
dims, type, offset). It reads only the header bytes, never tensor data, so a
100+ GB model or a header-only file (tensor data absent) reads in
milliseconds. (The ``gguf`` package's GGUFReader memory-maps the whole file
and builds numpy views of every tensor, which fails on header-only files.)

Bytes per tensor come from ggml's (block size, type size) table,
``GGML_QUANT_SIZES`` in the ``gguf`` package: ``nelements / block * type_size``.
"""

from __future__ import annotations

import importlib.util
import math
import os
import re
import struct
from dataclasses import dataclass, field
from functools import cache, cached_property
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
# Sliding-window attention pattern per architecture (see ModelInfo.swa_layers).
SWA_PATTERN = {"gpt-oss": 2, "gemma3": 6}
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


# ggml types that are not quantized (F32, F16, BF16): decode reads them at another
# effective bandwidth than block-quantized weights.
UNQUANTIZED_TYPES = frozenset({0, 1, 30})


@dataclass(frozen=True)
class BlockStats:
    """What one block costs one token: bytes read (routed experts scaled to the share
    used per token), split quantized / unquantized, and matrix-product FLOPs."""

    quant_bytes: float
    f16_bytes: float
    dense_quant_flops: float
    dense_f16_flops: float
    expert_flops: float  # routed experts in use
    moe: bool


@dataclass
class ModelInfo:
    path: str
    file_size: int
    version: int
    architecture: str
    arch_known: bool
    name: str | None
    block_count: int
    embedding_length: int
    head_count: int
    head_count_kv: int
    context_length: int | None
    expert_count: int
    expert_used_count: int
    key_length: int  # per head, for the KV cache
    value_length: int
    vocab_size: int
    tensors: list[TensorInfo]
    header_size: int  # bytes up to the start of tensor data
    data_present: bool  # file holds all tensor data (False for header-only files)
    warnings: list[str] = field(default_factory=list)
    metadata: dict[str, Any] = field(default_factory=dict, repr=False)
    sliding_window: int = 0  # {arch}.attention.sliding_window; 0: every layer attends fully

    @cached_property
    def block_stats(self) -> list[BlockStats]:
        frac = self.expert_used_count / self.expert_count if self.expert_count else 1.0
        acc = [[0.0] * 5 + [False] for _ in range(self.block_count)]
        for t in self.tensors:
            li = t.layer
            if li is None or li >= self.block_count:
                continue
            a = acc[li]
            share = frac if t.is_expert else 1.0
            a[1 if t.type_id in UNQUANTIZED_TYPES else 0] += t.nbytes * share
            if len(t.shape) >= 2:
                if t.is_expert:
                    a[4] += 2.0 * t.nelements * frac
                    a[5] = True
                else:
                    a[3 if t.type_id in UNQUANTIZED_TYPES else 2] += 2.0 * t.nelements
        return [BlockStats(*a) for a in acc]

    @property
    def output_split(self) -> tuple[int, int]:
        """(quantized, unquantized) bytes of the output head (output_bytes)."""
        own = [t for t in self.tensors if t.layer is None and t.name.startswith("output")]
        if not any(t.name == "output.weight" for t in self.tensors):
            own += [t for t in self.tensors if t.name.startswith("token_embd")]
        f = sum(t.nbytes for t in own if t.type_id in UNQUANTIZED_TYPES)
        return sum(t.nbytes for t in own) - f, f

    @cached_property
    def _swa(self) -> frozenset[int]:
        n = SWA_PATTERN.get(self.architecture)
        if not self.sliding_window or not n:
            return frozenset()
        return frozenset(il for il in range(self.block_count) if il % n < n - 1)

    def swa_layers(self) -> frozenset[int]:
        """Blocks whose attention sees only the last ``sliding_window`` positions.
        llama.cpp (llama-model.cpp load_hparams, hparams.set_swa_pattern(n)): in every run
        of n blocks the first n-1 use the window and the n-th attends fully; gpt-oss
        alternates (n = 2), gemma3 has 5 local blocks per global one (n = 6)."""
        return self._swa

    def kv_positions(
        self, layer: int, depth: float, ubatch: int = 512, skips_masked: bool = False
    ) -> float:
        """Cache cells block ``layer`` reads at context position ``depth``. A sliding-window
        block's cache holds window + one micro-batch of cells (llama-kv-cache-iswa.cpp
        sizes it n_swa + n_ubatch; llama-kv-cache.cpp get_n_kv makes the attention's view
        every used cell, padded to 256) and the mask sets the cells outside the window to
        -INF. A kernel that runs over the whole view reads them all (window + ubatch);
        ``skips_masked``: the backend's flash attention skips the cache chunks the mask
        fully masks, so the block reads about its window (the chunks cut by the window's
        edges add at most one chunk, 32 or 64 cells; see linkctl.estimate.cost.skips_masked_kv)."""
        if layer in self._swa:
            return min(depth, self.sliding_window + (0 if skips_masked else ubatch))
        return depth

    # -- sizes -----------------------------------------------------------------
    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    def layer_bytes(self) -> list[int]:
        """Weight bytes of each repeating block blk.N (all experts included)."""
        out = [0] * self.block_count
        for t in self.tensors:
            li = t.layer
            if li is not None and li < self.block_count:
                out[li] += t.nbytes
        return out

    def layer_expert_bytes(self) -> list[int]:
        """Routed-expert weight bytes of each block (0 for dense blocks)."""
        out = [0] * self.block_count
        for t in self.tensors:
            li = t.layer
            if li is not None and li < self.block_count and t.is_expert:
                out[li] += t.nbytes
        return out

    def layer_active_bytes(self) -> list[int]:
        """Bytes a block reads per generated token: everything but the routed experts,
        plus experts_used/expert_count of those."""
        total, experts = self.layer_bytes(), self.layer_expert_bytes()
        if not self.expert_count:
            return total
        frac = self.expert_used_count / self.expert_count
        return [t - e + round(e * frac) for t, e in zip(total, experts, strict=True)]

    def layer_params(self, active: bool = False) -> list[int]:
        """Weights (elements) of each block; ``active``: routed experts scaled to the
        share used per token (what a token's matrix products multiply)."""
        out = [0] * self.block_count
        frac = self.expert_used_count / self.expert_count if self.expert_count else 1.0
        for t in self.tensors:
            li = t.layer
            if li is not None and li < self.block_count:
                out[li] += round(t.nelements * frac) if (active and t.is_expert) else t.nelements
        return out

    @property
    def output_params(self) -> int:
        out = next((t for t in self.tensors if t.name == "output.weight"), None)
        if out is None:
            out = next((t for t in self.tensors if t.name == "token_embd.weight"), None)
        return out.nelements if out else 0

    @property
    def embedding_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors if t.name.startswith("token_embd"))

    @property
    def output_bytes(self) -> int:
        """The output head (output.weight, output_norm); a tied model reuses the embedding."""
        own = sum(t.nbytes for t in self.tensors if t.layer is None and t.name.startswith("output"))
        if not any(t.name == "output.weight" for t in self.tensors):
            own += self.embedding_bytes
        return own

    @property
    def other_bytes(self) -> int:
        named = self.embedding_bytes + sum(
            t.nbytes for t in self.tensors if t.layer is None and t.name.startswith("output")
        )
        return self.total_bytes - sum(self.layer_bytes()) - named

    @property
    def kv_bytes_per_token_per_layer(self) -> int:
        """K and V cache bytes one token of context occupies in one layer (f16 cache)."""
        return self.head_count_kv * (self.key_length + self.value_length) * 2

    def attn_bytes_per_position(self, flash_attn: bool = True) -> int:
        """Bytes one block's attention moves per context position for one generated token.
        With flash attention (llama-server's default, -fa auto) the fused kernel reads the
        cached K and V rows: the cache bytes. Without it, build_attn_mha
        (src/llama-graph.cpp) runs kq = ggml_mul_mat(k, q) in F32, ggml_soft_max_ext(kq)
        and ggml_mul_mat(v, kq), and the mat-vec kernels broadcast K and V over the query
        heads (ggml-metal.metal kernel_mul_mv_*: offset0 = (i12/r2)*nb02, one threadgroup
        per query head), so every row is read once per query head, and the F32 KQ row of
        each head is written, read and written by the soft_max, then read: 4 x 4 bytes."""
        if flash_attn:
            return self.kv_bytes_per_token_per_layer
        return self.head_count * ((self.key_length + self.value_length) * 2 + 4 * 4)

    @property
    def is_moe(self) -> bool:
        return self.expert_count > 1

    def as_dict(self) -> dict[str, Any]:
        lb = self.layer_bytes()
        return {
            "path": self.path,
            "file_size": self.file_size,
            "gguf_version": self.version,
            "architecture": self.architecture,
            "architecture_known": self.arch_known,
            "name": self.name,
            "block_count": self.block_count,
            "embedding_length": self.embedding_length,
            "head_count": self.head_count,
            "head_count_kv": self.head_count_kv,
            "context_length": self.context_length,
            "expert_count": self.expert_count,
            "expert_used_count": self.expert_used_count,
            "vocab_size": self.vocab_size,
            "tensor_count": len(self.tensors),
            "total_bytes": self.total_bytes,
            "layer_bytes_mean": sum(lb) / len(lb) if lb else 0,
            "layer_active_bytes_mean": (sum(self.layer_active_bytes()) / len(lb) if lb else 0),
            "embedding_bytes": self.embedding_bytes,
            "output_bytes": self.output_bytes,
            "kv_bytes_per_token_per_layer": self.kv_bytes_per_token_per_layer,
            "data_present": self.data_present,
            "warnings": self.warnings,
        }


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


def _corrupt(path: str, what: str) -> InputError:
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
            raise _corrupt(self.path, f"{what} claims {n} bytes (limit {limit})")
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
            raise _corrupt(self.path, f"{what}: {n} claimed (limit {limit})")
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
            return _SkippedArray(n)
        cur._need(n, f"value of {key}")
        v = cur.buf[cur.pos : cur.pos + n].decode("utf-8", errors="replace")
        cur.pos += n
        return v
    if vtype == _ARRAY:
        if depth >= MAX_ARRAY_DEPTH:
            raise _corrupt(cur.path, f"{key} nests arrays deeper than {MAX_ARRAY_DEPTH} levels")
        etype = cur.unpack("<I", f"array type of {key}")
        raw = cur.unpack("<Q", f"array length of {key}")
        if etype == _STRING:
            count = cur.count(f"array {key}", raw, 8)
            if count <= 16 and cur.keep(8 * count):
                return [cur.string(f"{key}[]") for _ in range(count)]
            cur.skip_strings(count, f"{key}[]")
            return _SkippedArray(count)
        if etype in _SCALAR:
            fmt = _SCALAR[etype]
            size = struct.calcsize(fmt)
            count = cur.count(f"array {key}", raw, size)
            if count > _KEEP_ARRAY_MAX or not cur.keep(size * count):
                cur.skip(size * count, f"{key}[]")
                return _SkippedArray(count)
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
class _SkippedArray:
    """A long array (or value) not kept; its length is what matters (e.g. the
    vocabulary size)."""

    count: int


def _read_tensor_info(cur: _Cursor, i: int) -> TensorInfo:
    name = cur.string(f"tensor #{i} name", max_len=MAX_NAME_LEN)
    n_dims = cur.unpack("<I", f"dims of {name}")
    if n_dims > MAX_DIMS:
        raise _corrupt(cur.path, f"tensor {name!r} has {n_dims} dims (ggml takes at most 4)")
    shape = tuple(cur.unpack("<Q", f"shape of {name}") for _ in range(n_dims))
    n = 1
    for d in shape:
        n *= d
    if any(d > _INT64_MAX for d in shape) or n > _INT64_MAX:
        raise _corrupt(cur.path, f"tensor {name!r} shape {list(shape)} overflows int64")
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
                raise _corrupt(
                    str(path), f"key #{i} {key!r} is {'a duplicate' if key else 'empty'}"
                )
            vtype = cur.unpack("<I", f"type of {key}")
            meta[key] = _read_value(cur, vtype, key)
        tensors = []
        names: set[str] = set()
        for i in range(n_tensors):
            t = _read_tensor_info(cur, i)
            if t.name in names:
                raise _corrupt(str(path), f"tensor name {t.name!r} appears twice")
            names.add(t.name)
            tensors.append(t)
        end = cur.tell()
    align = meta.get("general.alignment", DEFAULT_ALIGNMENT)
    if isinstance(align, bool) or not isinstance(align, int):
        align = DEFAULT_ALIGNMENT
    if align <= 0 or align & (align - 1):
        raise _corrupt(str(path), f"general.alignment {align} is not a power of 2")
    header_size = (end + align - 1) // align * align
    return version, meta, tensors, header_size, size


def _get(meta: dict[str, Any], arch: str, key: str) -> Any:
    v = meta.get(f"{arch}.{key}")
    return None if isinstance(v, _SkippedArray) else v


def _scalar(v: Any) -> int | None:
    """A per-layer array (some architectures vary heads per layer) reduces to its max."""
    if isinstance(v, list):
        nums = [x for x in v if isinstance(x, int | float) and math.isfinite(x)]
        return int(max(nums)) if nums else None
    if isinstance(v, bool):
        return int(v)
    if isinstance(v, int | float) and math.isfinite(v):
        return int(v)
    return None


def read_model(path: str | os.PathLike) -> ModelInfo:
    """Everything the estimate needs from a GGUF header."""
    version, meta, tensors, header_size, size = read_header(path)
    warnings: list[str] = []
    arch = meta.get("general.architecture")
    if not isinstance(arch, str) or not arch:
        arch = "unknown"
    arch_known = arch in known_architectures()
    if not arch_known:
        warnings.append(
            f"unknown architecture {arch!r}: figures are estimated from the tensors alone"
        )
    if not tensors:
        raise InputError(
            f"{path}: GGUF header lists no tensors", "give a model file, not a vocab-only file"
        )

    def num(key: str) -> int | None:
        v = _get(meta, arch, key)
        if v is None:
            return None
        n = _scalar(v)
        if n is None or not 0 <= n <= MAX_HPARAM:
            raise _corrupt(
                str(path), f"{arch}.{key} = {str(v)[:40]} is not a count in 0..{MAX_HPARAM}"
            )
        return n

    layers_seen = [t.layer for t in tensors if t.layer is not None]
    if layers_seen and max(layers_seen) >= MAX_BLOCKS:
        bad = next(t.name for t in tensors if (t.layer or 0) >= MAX_BLOCKS)
        raise _corrupt(str(path), f"tensor {bad!r}: block index past {MAX_BLOCKS - 1}")
    blocks_from_tensors = max(layers_seen) + 1 if layers_seen else 0
    block_count = num("block_count")
    if block_count is None:
        block_count = blocks_from_tensors
        if arch_known:
            warnings.append(f"{arch}.block_count missing: took {block_count} from tensor names")
    if block_count > MAX_BLOCKS:
        raise _corrupt(str(path), f"{arch}.block_count {block_count} is past {MAX_BLOCKS}")
    embd = num("embedding_length")
    tok = next((t for t in tensors if t.name == "token_embd.weight"), None)
    if embd is None:
        embd = tok.shape[0] if tok else 0
        if arch_known:
            warnings.append(f"{arch}.embedding_length missing: took {embd} from token_embd")
    vocab = tok.shape[1] if tok and len(tok.shape) > 1 else 0
    toks = meta.get("tokenizer.ggml.tokens")
    if not vocab and toks is not None:
        vocab = toks.count if isinstance(toks, _SkippedArray) else len(toks)
    heads = num("attention.head_count") or 0
    heads_kv = num("attention.head_count_kv") or heads
    head_dim = embd // heads if heads else 0
    key_len = num("attention.key_length") or head_dim
    val_len = num("attention.value_length") or head_dim
    if not heads or not key_len:
        # Estimate from the K projection of the first block: [n_embd, n_head_kv*head_dim].
        k = next((t for t in tensors if t.name in ("blk.0.attn_k.weight",)), None)
        if k is not None and len(k.shape) > 1:
            if not key_len:
                key_len = val_len = 128 if k.shape[1] % 128 == 0 else 64
            heads_kv = heads_kv or max(1, k.shape[1] // key_len)
            heads = heads or heads_kv
            warnings.append("attention heads missing: KV-cache size estimated from attn_k shape")
    expert_count = num("expert_count") or 0
    expert_used = num("expert_used_count") or 0
    has_experts = any(t.is_expert for t in tensors)
    if has_experts and not expert_count:
        e = next(t for t in tensors if t.is_expert)
        expert_count = e.shape[-1] if len(e.shape) >= 3 else 0
        warnings.append(f"expert_count missing: took {expert_count} from {e.name}")
    if expert_used > expert_count:
        raise _corrupt(
            str(path), f"{expert_used} experts used per token of {expert_count} (expert_count)"
        )
    if expert_count and not expert_used:
        expert_used = expert_count
        warnings.append(
            "expert_used_count missing: assuming every expert is read per token (pessimistic)"
        )
    data_end = max((t.offset + t.nbytes for t in tensors), default=0)
    data_present = size >= header_size + data_end
    name = meta.get("general.name")
    return ModelInfo(
        path=str(path),
        file_size=size,
        version=version,
        architecture=arch,
        arch_known=arch_known,
        name=name if isinstance(name, str) else None,
        block_count=block_count,
        embedding_length=embd,
        head_count=heads,
        head_count_kv=heads_kv,
        context_length=num("context_length"),
        expert_count=expert_count,
        expert_used_count=expert_used,
        key_length=key_len,
        value_length=val_len,
        vocab_size=vocab,
        tensors=tensors,
        header_size=header_size,
        data_present=data_present,
        warnings=warnings,
        metadata={k: v for k, v in meta.items() if not isinstance(v, _SkippedArray | list)},
        sliding_window=num("attention.sliding_window") or 0,
    )
