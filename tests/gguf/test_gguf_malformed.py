"""A corpus of damaged and hostile GGUF headers, generated here byte by byte: every
one is refused with a one-line InputError (exit 2 from the CLI), in bounded memory
and time, never a traceback. The writer below is independent of the reader."""

from __future__ import annotations

import struct
import time
import tracemalloc
from pathlib import Path

import pytest

from linkctl.core.errors import InputError
from linkctl.gguf.info import read_model
from support.cli import error_lines, linkctl

U8, U32, I32, F32, STR, ARR, U64 = 0, 4, 5, 6, 8, 9, 10
BIG = (1 << 64) - 1


def s(text: str | bytes) -> bytes:
    b = text.encode() if isinstance(text, str) else text
    return struct.pack("<Q", len(b)) + b


def kv(key: str, vtype: int, payload: bytes) -> bytes:
    return s(key) + struct.pack("<I", vtype) + payload


def u32(key: str, v: int) -> bytes:
    return kv(key, U32, struct.pack("<I", v))


def arr(etype: int, count: int, body: bytes) -> bytes:
    return struct.pack("<IQ", etype, count) + body


def tinfo(name: str | bytes, shape: tuple[int, ...], ttype: int = 0, offset: int = 0) -> bytes:
    dims = struct.pack("<I", len(shape)) + b"".join(struct.pack("<Q", d) for d in shape)
    return s(name) + dims + struct.pack("<IQ", ttype, offset)


def base_kvs() -> list[bytes]:
    return [
        kv("general.architecture", STR, s("llama")),
        u32("llama.block_count", 2),
        u32("llama.embedding_length", 64),
        u32("llama.attention.head_count", 4),
        kv("llama.rope.dims", ARR, arr(U32, 3, struct.pack("<3I", 1, 2, 3))),
        kv("tokenizer.ggml.tokens", ARR, arr(STR, 20, b"".join(s(f"t{i}") for i in range(20)))),
        kv("x.nested", ARR, arr(ARR, 2, arr(U8, 2, b"\1\2") + arr(U8, 1, b"\3"))),
    ]


def base_tensors() -> list[bytes]:
    return [
        tinfo("token_embd.weight", (64, 100)),
        tinfo("blk.0.attn_q.weight", (64, 64), offset=25600),
        tinfo("blk.1.attn_q.weight", (64, 64), offset=41984),
        tinfo("output.weight", (64, 100), offset=58368),
    ]


def gguf(kvs=None, tensors=None, n_kv=None, n_tensors=None, version=3) -> bytes:
    kvs = base_kvs() if kvs is None else kvs
    tensors = base_tensors() if tensors is None else tensors
    n_kv = len(kvs) if n_kv is None else n_kv
    n_tensors = len(tensors) if n_tensors is None else n_tensors
    return (
        b"GGUF" + struct.pack("<IQQ", version, n_tensors, n_kv) + b"".join(kvs) + b"".join(tensors)
    )


def with_kv(*extra: bytes) -> bytes:
    return gguf(kvs=base_kvs() + list(extra))


def with_tensor(*extra: bytes) -> bytes:
    return gguf(tensors=base_tensors() + list(extra))


def replacing(marker: bytes, new: bytes) -> bytes:
    """The base file with the key/value holding ``marker`` replaced by ``new``."""
    return gguf(kvs=[new if marker in k else k for k in base_kvs()])


def nested(depth: int) -> bytes:
    body = arr(U8, 0, b"")
    for _ in range(depth - 1):
        body = arr(ARR, 1, body)
    return kv("x.deep", ARR, body)


CORPUS: dict[str, tuple[bytes, str]] = {
    # counts in the fixed header
    "tensor-count-max": (gguf(n_tensors=BIG), "tensor count"),
    "tensor-count-2^63": (gguf(n_tensors=1 << 63), "tensor count"),
    "tensor-count-past-file": (gguf(n_tensors=100_000), "tensor count"),
    "kv-count-max": (gguf(n_kv=BIG), "metadata key count"),
    "kv-count-past-limit": (gguf(n_kv=(1 << 16) + 1), "metadata key count"),
    "kv-count-past-file": (gguf(n_kv=5000), "metadata key count"),
    # string lengths
    "key-length-max": (gguf(kvs=[struct.pack("<Q", BIG)]), "key #0"),
    "key-length-past-file": (gguf(kvs=[struct.pack("<Q", 1 << 12) + b"abc"]), "key #0"),
    "key-empty": (with_kv(kv("", U32, b"\0\0\0\0")), "is empty"),
    "key-duplicate": (with_kv(u32("llama.block_count", 3)), "is a duplicate"),
    "string-value-max": (with_kv(kv("a.s", STR, struct.pack("<Q", BIG))), "value of a.s"),
    "string-value-2^40": (with_kv(kv("a.s", STR, struct.pack("<Q", 1 << 40))), "value of a.s"),
    "string-value-past-file": (with_kv(kv("a.s", STR, struct.pack("<Q", 900) + b"x")), "a.s"),
    # arrays
    "u8-array-count-max": (with_kv(kv("a.a", ARR, arr(U8, BIG, b""))), "array a.a"),
    "u64-array-count-2^61": (with_kv(kv("a.a", ARR, arr(U64, 1 << 61, b""))), "array a.a"),
    "u32-array-past-file": (with_kv(kv("a.a", ARR, arr(U32, 5000, b"\0" * 8))), "array a.a"),
    "string-array-count-max": (with_kv(kv("a.a", ARR, arr(STR, BIG, b""))), "array a.a"),
    "string-array-element-max": (
        with_kv(kv("a.a", ARR, arr(STR, 40, s("ok") * 39 + struct.pack("<Q", BIG)))),
        "a.a[]",
    ),
    "string-array-element-past-file": (
        with_kv(kv("a.a", ARR, arr(STR, 40, s("ok") * 30 + struct.pack("<Q", 5000)))),
        "a.a[]",
    ),
    "nested-array-count-max": (with_kv(kv("a.a", ARR, arr(ARR, BIG, b""))), "array a.a"),
    "nesting-3-levels": (with_kv(nested(3)), "nests arrays deeper"),
    "nesting-10000-levels": (with_kv(nested(10_000)), "nests arrays deeper"),
    # types
    "unknown-value-type": (with_kv(kv("a.t", 13, b"\0" * 8)), "unknown value type 13"),
    "unknown-value-type-max": (with_kv(kv("a.t", 0xFFFFFFFF, b"")), "unknown value type"),
    "unknown-array-type": (with_kv(kv("a.t", ARR, arr(99, 1, b"\0" * 8))), "element type 99"),
    "unknown-tensor-type": (with_tensor(tinfo("blk.0.x.weight", (64,), 999)), "ggml type 999"),
    "unknown-tensor-type-max": (
        with_tensor(tinfo("blk.0.x.weight", (64,), 0xFFFFFFFF)),
        "unknown ggml type",
    ),
    # tensor infos
    "tensor-name-64-bytes": (with_tensor(tinfo("n" * 64, (64,))), "tensor #4 name"),
    "tensor-name-length-max": (gguf(tensors=[struct.pack("<Q", BIG)]), "tensor #0 name"),
    "tensor-duplicate": (with_tensor(tinfo("output.weight", (64,))), "appears twice"),
    "tensor-dims-5": (with_tensor(tinfo("blk.0.x.weight", (1, 1, 1, 1, 1))), "5 dims"),
    "tensor-dims-max": (with_tensor(s("blk.0.x") + struct.pack("<I", 0xFFFFFFFF)), "dims"),
    "tensor-shape-max": (with_tensor(tinfo("blk.0.x.weight", (BIG,))), "overflows int64"),
    "tensor-shape-product": (
        with_tensor(tinfo("blk.0.x.weight", (1 << 32, 1 << 32))),
        "overflows int64",
    ),
    "tensor-block-index-huge": (
        with_tensor(tinfo("blk.4000000000.attn_q.weight", (64,))),
        "block index",
    ),
    # metadata values the estimate sizes lists and loops from
    "block-count-2^31": (
        replacing(b"block_count", u32("llama.block_count", 1 << 31)),
        "block_count",
    ),
    "head-count-negative": (
        replacing(b"head_count", kv("llama.attention.head_count", I32, struct.pack("<i", -4))),
        "attention.head_count",
    ),
    "head-count-nan": (
        replacing(
            b"head_count", kv("llama.attention.head_count", F32, struct.pack("<f", float("nan")))
        ),
        "attention.head_count",
    ),
    "experts-used-past-count": (
        with_kv(u32("llama.expert_count", 4), u32("llama.expert_used_count", 9)),
        "experts used per token",
    ),
    "alignment-not-power-of-2": (with_kv(u32("general.alignment", 48)), "power of 2"),
    "alignment-zero": (with_kv(u32("general.alignment", 0)), "power of 2"),
}


def _refused(p: Path, want: str) -> str:
    tracemalloc.start()
    t0 = time.monotonic()
    try:
        with pytest.raises(InputError) as e:
            read_model(p)
    finally:
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    took = time.monotonic() - t0
    line = e.value.line()
    assert want in line, line
    assert str(p) in line and "\n" not in line and "(fix: " in line, line
    assert peak < 16 * 2**20, f"{p.name}: {peak / 2**20:.1f} MiB"
    assert took < 5, f"{p.name}: {took:.1f} s"
    return line


def test_the_base_file_is_valid(tmp_path):
    p = tmp_path / "base.gguf"
    p.write_bytes(gguf())
    m = read_model(p)
    assert m.block_count == 2 and m.vocab_size == 100 and len(m.tensors) == 4
    assert m.metadata["llama.block_count"] == 2


@pytest.mark.parametrize("case", list(CORPUS))
def test_malformed_header_is_refused(tmp_path, case):
    data, want = CORPUS[case]
    p = tmp_path / f"{case}.gguf"
    p.write_bytes(data)
    _refused(p, want)


def test_truncation_at_every_byte(tmp_path):
    """Cut the valid header at every byte (so at every field boundary and inside
    every field): each cut is refused as truncated."""
    data = gguf()
    p = tmp_path / "cut.gguf"
    for n in range(4, len(data)):
        p.write_bytes(data[:n])
        with pytest.raises(InputError) as e:
            read_model(p)
        assert "truncated GGUF header" in e.value.line(), (n, e.value.line())


def test_cli_exit_2_one_line_no_traceback(tmp_path):
    for case in ("tensor-count-max", "nesting-10000-levels", "string-value-2^40", "head-count-nan"):
        p = tmp_path / f"{case}.gguf"
        p.write_bytes(CORPUS[case][0])
        r = linkctl(
            "estimate",
            "--model",
            str(p),
            "--rtt-us",
            "100",
            "--throughput-gbps",
            "9",
            env=None,
        )
        assert r.returncode == 2, (case, r.stdout, r.stderr)
        assert "Traceback" not in r.stderr and len(error_lines(r.stderr)) == 1, r.stderr
        assert CORPUS[case][1] in r.stderr
