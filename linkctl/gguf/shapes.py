"""Published model architectures as in-memory GGUF headers (ModelInfo), so the device
fit and the published-accuracy bench run each public benchmark row through the same
estimator code a real GGUF goes through.

A shape is the model's published config (Hugging Face config.json: layers, widths,
heads, experts, vocabulary, tied embeddings, sliding window). The quantization label
of a llama-bench row ("Q4_0", "Q8_0", "F16", "MXFP4") sets each tensor's ggml type
the way llama.cpp's quantizer does by default (llama-quant.cpp: Q4_0 keeps the output
head in Q6_K; gpt-oss MXFP4 files quantize only the routed experts to MXFP4 and the
rest to Q8_0), so the bytes read per token follow from the real ggml block sizes.
`model_info()` also reports how far the resulting total is from the size llama-bench
printed, so a wrong shape shows up in the bench instead of hiding in the fit.
"""

from __future__ import annotations

from dataclasses import dataclass

from linkctl.core.errors import InputError
from linkctl.gguf.info import ModelInfo
from linkctl.gguf.reader import TensorInfo, tensor_nbytes

# ggml type ids (ggml.h enum ggml_type)
F32, F16, Q4_0, Q8_0, Q4_K, Q6_K, MXFP4 = 0, 1, 2, 8, 12, 14, 39


@dataclass(frozen=True)
class Shape:
    arch: str
    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    n_ff: int
    vocab: int
    head_dim: int | None = None
    n_expert: int = 0
    n_expert_used: int = 0
    n_ff_exp: int = 0
    tied: bool = False
    sliding_window: int = 0
    config: str = ""  # where the numbers come from

    @property
    def hd(self) -> int:
        return self.head_dim or self.n_embd // self.n_head


HF = "https://huggingface.co/{}/blob/main/config.json"

SHAPES: dict[str, Shape] = {
    "llama-2-7b": Shape(
        "llama", 32, 4096, 32, 32, 11008, 32000, config=HF.format("meta-llama/Llama-2-7b-hf")
    ),
    "tinyllama-1.1b": Shape(
        "llama",
        22,
        2048,
        32,
        4,
        5632,
        32000,
        config=HF.format("TinyLlama/TinyLlama-1.1B-Chat-v1.0"),
    ),
    "llama-3-8b": Shape(
        "llama", 32, 4096, 32, 8, 14336, 128256, config=HF.format("meta-llama/Meta-Llama-3-8B")
    ),
    "llama-3-70b": Shape(
        "llama", 80, 8192, 64, 8, 28672, 128256, config=HF.format("meta-llama/Meta-Llama-3-70B")
    ),
    "llama-3.2-3b": Shape(
        "llama",
        28,
        3072,
        24,
        8,
        8192,
        128256,
        head_dim=128,
        tied=True,
        config=HF.format("meta-llama/Llama-3.2-3B"),
    ),
    "qwen2.5-7b": Shape(
        "qwen2", 28, 3584, 28, 4, 18944, 152064, config=HF.format("Qwen/Qwen2.5-Coder-7B")
    ),
    "qwen3-30b-a3b": Shape(
        "qwen3moe",
        48,
        2048,
        32,
        4,
        6144,
        151936,
        head_dim=128,
        n_expert=128,
        n_expert_used=8,
        n_ff_exp=768,
        config=HF.format("Qwen/Qwen3-Coder-30B-A3B-Instruct"),
    ),
    "gpt-oss-20b": Shape(
        "gpt-oss",
        24,
        2880,
        64,
        8,
        2880,
        201088,
        head_dim=64,
        n_expert=32,
        n_expert_used=4,
        n_ff_exp=2880,
        sliding_window=128,
        config=HF.format("openai/gpt-oss-20b"),
    ),
    "gpt-oss-120b": Shape(
        "gpt-oss",
        36,
        2880,
        64,
        8,
        2880,
        201088,
        head_dim=64,
        n_expert=128,
        n_expert_used=4,
        n_ff_exp=2880,
        sliding_window=128,
        config=HF.format("openai/gpt-oss-120b"),
    ),
    "mixtral-8x7b": Shape(
        "llama",
        32,
        4096,
        32,
        8,
        14336,
        32000,
        n_expert=8,
        n_expert_used=2,
        n_ff_exp=14336,
        config=HF.format("mistralai/Mixtral-8x7B-v0.1"),
    ),
    "gemma-3-4b": Shape(
        "gemma3",
        34,
        2560,
        8,
        4,
        10240,
        262144,
        head_dim=256,
        tied=True,
        sliding_window=1024,
        config=HF.format("google/gemma-3-4b-it"),
    ),
}


_TYPE_NAMES = {
    "F32": F32,
    "F16": F16,
    "Q4_0": Q4_0,
    "Q8_0": Q8_0,
    "Q4_K": Q4_K,
    "Q6_K": Q6_K,
    "MXFP4": MXFP4,
}


def _use_more_bits(i: int, n: int) -> bool:
    """llama-quant.cpp use_more_bits: the blocks Q4_K_M gives Q6_K attn_v/ffn_down."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def _types(quant: str, tied: bool) -> tuple[int, int, int, int]:
    """(matrix type, routed-expert type, output-head type, embedding type).
    ``quant`` is a llama-bench label, optionally with ``+embd=TYPE`` where a published
    file keeps its token embeddings in another type than llama.cpp's default."""
    q, _, extra = quant.upper().partition("+EMBD=")
    w, wx, wo, we = _base_types(q)
    if tied:
        # A tied model's embedding matrix is its output head: llama-quant.cpp gives
        # token_embd the output type then.
        we = wo
    if extra:
        if extra not in _TYPE_NAMES:
            raise InputError(f"quantization {quant!r}: unknown type {extra}", "use Q8_0, F16, ...")
        we = _TYPE_NAMES[extra]
    return w, wx, wo, we


def _base_types(q: str) -> tuple[int, int, int, int]:
    if q in ("F16", "BF16"):
        return F16, F16, F16, F16
    if q == "Q8_0":
        return Q8_0, Q8_0, Q8_0, Q8_0
    if q == "Q4_0":
        return Q4_0, Q4_0, Q6_K, Q4_0
    if q == "MXFP4":
        return Q8_0, MXFP4, Q8_0, Q8_0
    if q == "Q4_K_M":  # attn_v / ffn_down get Q6_K in some blocks (see tensors())
        return Q4_K, Q4_K, Q6_K, Q4_K
    raise InputError(
        f"quantization {q!r} has no shape rule", "use F16, Q8_0, Q4_0, Q4_K_M or MXFP4"
    )


def tensors(shape: Shape, quant: str) -> list[tuple[str, tuple[int, ...], int]]:
    """(name, ggml shape ne0 first, ggml type) of every tensor of ``shape``."""
    w, wx, wo, we = _types(quant, shape.tied)
    k_m = quant.upper().startswith("Q4_K_M")
    e, hd = shape.n_embd, shape.hd
    out: list[tuple[str, tuple[int, ...], int]] = [("token_embd.weight", (e, shape.vocab), we)]
    for i in range(shape.n_layer):
        p = f"blk.{i}."
        more = Q6_K if k_m and _use_more_bits(i, shape.n_layer) else w
        out += [
            (p + "attn_norm.weight", (e,), F32),
            (p + "attn_q.weight", (e, shape.n_head * hd), w),
            (p + "attn_k.weight", (e, shape.n_head_kv * hd), w),
            (p + "attn_v.weight", (e, shape.n_head_kv * hd), more),
            (p + "attn_output.weight", (shape.n_head * hd, e), w),
            (p + "ffn_norm.weight", (e,), F32),
        ]
        if shape.n_expert:
            x, f = shape.n_expert, shape.n_ff_exp
            out += [
                (p + "ffn_gate_inp.weight", (e, x), F32),
                (p + "ffn_gate_exps.weight", (e, f, x), wx),
                (p + "ffn_up_exps.weight", (e, f, x), wx),
                (p + "ffn_down_exps.weight", (f, e, x), wx),
            ]
        else:
            out += [
                (p + "ffn_gate.weight", (e, shape.n_ff), w),
                (p + "ffn_up.weight", (e, shape.n_ff), w),
                (p + "ffn_down.weight", (shape.n_ff, e), more),
            ]
    out.append(("output_norm.weight", (e,), F32))
    if not shape.tied:
        out.append(("output.weight", (e, shape.vocab), wo))
    return out


def model_info(key: str, quant: str) -> ModelInfo:
    """The ModelInfo a GGUF of published model ``key`` quantized as ``quant`` would read as."""
    if key not in SHAPES:
        raise InputError(f"model shape {key!r} is unknown", f"use one of: {', '.join(SHAPES)}")
    s = SHAPES[key]
    tis, off = [], 0
    for name, ne, t in tensors(s, quant):
        n = tensor_nbytes(ne, t, name)
        tis.append(TensorInfo(name, ne, t, off, n))
        off += n
    return ModelInfo(
        path=f"<{key} {quant}>",
        file_size=off,
        version=3,
        architecture=s.arch,
        arch_known=True,
        name=key,
        block_count=s.n_layer,
        embedding_length=s.n_embd,
        head_count=s.n_head,
        head_count_kv=s.n_head_kv,
        context_length=None,
        expert_count=s.n_expert,
        expert_used_count=s.n_expert_used,
        key_length=s.hd,
        value_length=s.hd,
        vocab_size=s.vocab,
        tensors=tis,
        header_size=0,
        data_present=False,
        sliding_window=s.sliding_window,
    )
