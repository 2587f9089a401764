"""Header-only GGUF files shaped like real models, for the estimate tests and benches.

Written with the gguf package's GGUFWriter (header, metadata, tensor infos)
and no tensor data: a "70B" file is a few hundred KB. Shapes follow the
published configs (Llama-2-7B, Llama-3-70B, Qwen3-235B-A22B).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

# ggml type ids and (block, bytes per block), written out here so the tests check
# the reader against an independent table rather than the one it uses.
F32, F16, Q4_0, Q4_K, Q6_K, Q8_0 = 0, 1, 2, 12, 14, 8
BLOCK = {
    F32: (1, 4),
    F16: (1, 2),
    Q4_0: (32, 18),
    Q4_K: (256, 144),
    Q6_K: (256, 210),
    Q8_0: (32, 34),
}


def nbytes(shape: tuple[int, ...], t: int) -> int:
    n = 1
    for d in shape:
        n *= d
    b, s = BLOCK[t]
    return n // b * s


@dataclass
class Shape:
    arch: str
    n_embd: int
    n_layer: int
    n_head: int
    n_head_kv: int
    n_ff: int
    vocab: int
    ctx: int
    head_dim: int | None = None
    n_expert: int = 0
    n_expert_used: int = 0
    n_ff_exp: int = 0
    wtype: int = Q4_K
    tied: bool = False

    @property
    def hd(self) -> int:
        return self.head_dim or self.n_embd // self.n_head

    def tensors(self) -> list[tuple[str, tuple[int, ...], int]]:
        """(name, ggml shape ne0-first, type) of every tensor."""
        e, hd, w = self.n_embd, self.hd, self.wtype
        out: list[tuple[str, tuple[int, ...], int]] = [("token_embd.weight", (e, self.vocab), w)]
        for i in range(self.n_layer):
            p = f"blk.{i}."
            out += [
                (p + "attn_norm.weight", (e,), F32),
                (p + "attn_q.weight", (e, self.n_head * hd), w),
                (p + "attn_k.weight", (e, self.n_head_kv * hd), w),
                (p + "attn_v.weight", (e, self.n_head_kv * hd), Q6_K),
                (p + "attn_output.weight", (self.n_head * hd, e), w),
                (p + "ffn_norm.weight", (e,), F32),
            ]
            if self.n_expert:
                x, f = self.n_expert, self.n_ff_exp
                out += [
                    (p + "attn_q_norm.weight", (hd,), F32),
                    (p + "attn_k_norm.weight", (hd,), F32),
                    (p + "ffn_gate_inp.weight", (e, x), F32),
                    (p + "ffn_gate_exps.weight", (e, f, x), w),
                    (p + "ffn_up_exps.weight", (e, f, x), w),
                    (p + "ffn_down_exps.weight", (f, e, x), Q6_K),
                ]
            else:
                out += [
                    (p + "ffn_gate.weight", (e, self.n_ff), w),
                    (p + "ffn_up.weight", (e, self.n_ff), w),
                    (p + "ffn_down.weight", (self.n_ff, e), Q6_K),
                ]
        out.append(("output_norm.weight", (e,), F32))
        if not self.tied:
            out.append(("output.weight", (e, self.vocab), Q6_K))
        return out

    def layer_bytes(self, i: int = 0) -> int:
        return sum(nbytes(s, t) for n, s, t in self.tensors() if n.startswith(f"blk.{i}."))

    def expert_bytes(self, i: int = 0) -> int:
        return sum(
            nbytes(s, t) for n, s, t in self.tensors() if n.startswith(f"blk.{i}.") and "_exps" in n
        )


LLAMA_7B = Shape("llama", 4096, 32, 32, 32, 11008, 32000, 4096)
LLAMA_70B = Shape("llama", 8192, 80, 64, 8, 28672, 128256, 8192)
QWEN3_235B_A22B = Shape(
    "qwen3moe",
    4096,
    94,
    64,
    4,
    12288,
    151936,
    40960,
    head_dim=128,
    n_expert=128,
    n_expert_used=8,
    n_ff_exp=1536,
)


def write_header_only(
    path: Path, shape: Shape, *, arch: str | None = None, drop_keys: tuple[str, ...] = ()
) -> Path:
    """A GGUF with the full header of ``shape`` and no tensor data."""
    import numpy as np
    from gguf import GGUFWriter
    from gguf.constants import GGMLQuantizationType

    arch = arch or shape.arch
    w = GGUFWriter(str(path), arch)
    kv = {
        "block_count": shape.n_layer,
        "context_length": shape.ctx,
        "embedding_length": shape.n_embd,
        "feed_forward_length": shape.n_ff,
        "attention.head_count": shape.n_head,
        "attention.head_count_kv": shape.n_head_kv,
    }
    if shape.head_dim:
        kv["attention.key_length"] = shape.head_dim
        kv["attention.value_length"] = shape.head_dim
    if shape.n_expert:
        kv["expert_count"] = shape.n_expert
        kv["expert_used_count"] = shape.n_expert_used
        kv["expert_feed_forward_length"] = shape.n_ff_exp
    for k, v in kv.items():
        if k not in drop_keys:
            w.add_uint32(f"{arch}.{k}", v)
    w.add_name(f"header-only {shape.arch} test shape")
    # A vocabulary, as real files carry (long string arrays the reader must skip).
    w.add_tokenizer_model("gpt2")
    w.add_token_list([f"tok{i}" for i in range(shape.vocab)])
    w.add_token_merges([f"t{i} k{i}" for i in range(shape.vocab - 256)])
    for name, ggml_shape, t in shape.tensors():
        np_shape = tuple(reversed(ggml_shape))
        w.add_tensor_info(
            name,
            np_shape,
            np.dtype(np.float32),
            nbytes(ggml_shape, t),
            raw_dtype=GGMLQuantizationType(t),
        )
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    w.close()
    return path
