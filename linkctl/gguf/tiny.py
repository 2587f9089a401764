"""A tiny random-weight llama GGUF for tests, benchmarks and the lab demo.

Nothing is downloaded: the weights are drawn from a seeded generator, so the
same arguments always write the same bytes. The tokenizer is llama's
SentencePiece model with byte fallback: ``<unk>``, ``<s>``, ``</s>`` and the
256 byte tokens ``<0x00>``..``<0xFF>``, so any text tokenizes (one token per
byte) and llama.cpp loads it like any llama model. The output is noise; the
point is real tensors of a real architecture moving over a real link.

``sliding_window`` > 0 writes a gemma2 instead: llama.cpp's llama-shaped architecture
with sliding-window attention (every other block sees only the last
``sliding_window`` positions; llama-model.cpp, LLM_ARCH_GEMMA2, set_swa_pattern(2)).
Its tensors are llama's plus two norms a block, and the output is tied to the
embedding. Its slot restores reuse nothing (linkctl.disagg.router): the lab's case of
a model whose restores do not take.

``n_vocab`` > 259 adds ordinary tokens ``▁w<i>`` after the byte tokens, up to that
vocabulary size, so the output layer, the logits and everything llama-server does
per token over the whole vocabulary (its sampler chain, common/sampling.cpp
set_logits) have a real model's size: bench/serving_overhead.py measures that cost at
32k and 152k tokens. The token embedding and output matrices grow with it
(n_vocab x n_embd each).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from linkctl.core.errors import InputError
from linkctl.core.paths import atomic_path


@dataclass(frozen=True)
class TinySpec:
    n_layer: int = 4
    n_embd: int = 64
    n_head: int = 4
    n_ff: int = 128
    n_ctx: int = 512
    seed: int = 0
    sliding_window: int = 0  # > 0: a gemma2 (see the module's note)
    n_vocab: int = 0  # 0: the 259 special and byte tokens only; else that many tokens
    # The blocks' weight matrices' ggml type (norms, embeddings and output stay F32):
    # `linkctl calibrate` times generated models of a quantized type beside F32 ones.
    wtype: str = "F32"

    def check(self) -> None:
        small = self.n_layer < 1 or self.n_embd < 8 or self.n_ff < 8 or self.n_ctx < 16
        if small or self.sliding_window < 0:
            raise InputError(f"tiny model {self}: sizes too small", "use the defaults")
        if self.n_vocab and not N_VOCAB <= self.n_vocab <= MAX_VOCAB:
            raise InputError(
                f"tiny model: n_vocab {self.n_vocab} is outside {N_VOCAB}..{MAX_VOCAB}",
                f"use 0 (the {N_VOCAB} byte-level tokens) or a size in that range",
            )
        if self.wtype not in WEIGHT_TYPES:
            raise InputError(
                f"tiny model: wtype {self.wtype!r} is not one the writer quantizes",
                f"use one of {', '.join(WEIGHT_TYPES)}",
            )
        if self.wtype != "F32" and (self.n_embd % 32 or self.n_ff % 32):
            raise InputError(
                f"tiny model: {self.wtype} needs n_embd and n_ff multiples of 32 (its block), "
                f"not {self.n_embd} and {self.n_ff}",
                "use sizes that are multiples of 32",
            )
        if self.n_embd % self.n_head or (self.n_embd // self.n_head) % 2:
            raise InputError(
                f"tiny model: n_embd {self.n_embd} must split into {self.n_head} even-sized heads",
                "use n_embd a multiple of 2*n_head",
            )

    @property
    def vocab_size(self) -> int:
        return self.n_vocab or N_VOCAB


N_SPECIAL = 3  # <unk>, <s>, </s>
N_VOCAB = N_SPECIAL + 256
MAX_VOCAB = 262_144  # gemma3's 262k, the largest vocabulary in common use
# The types gguf-py's numpy quantizer writes (gguf/quants.py; K-quants it only reads),
# with the llama file type each makes.
WEIGHT_TYPES = ("F32", "Q8_0", "Q4_0")
BOS_ID, EOS_ID, UNK_ID = 1, 2, 0


def vocab(n_vocab: int = N_VOCAB) -> tuple[list[str], list[float], list[int]]:
    import gguf

    n_words = max(0, n_vocab - N_VOCAB)
    # U+2581 is SentencePiece's word-start mark (llama-vocab.cpp: a piece's "▁" detokenizes
    # to a space), so each extra token reads as a word.
    words = [f"\u2581w{i}" for i in range(n_words)]
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + words
    # Lower scores for later words: SentencePiece merges by score, and distinct scores
    # keep the tokenizer's choice deterministic.
    scores = [0.0] * N_VOCAB + [-float(i + 1) for i in range(n_words)]
    types = (
        [gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL]
        + [gguf.TokenType.BYTE] * 256
        + [gguf.TokenType.NORMAL] * n_words
    )
    return tokens, scores, [int(t) for t in types]


def write_tiny_llama(path: str | Path, spec: TinySpec | None = None) -> dict[str, Any]:
    """Write the model to ``path`` and return a summary (sizes, tensor count, bytes)."""
    import gguf
    import numpy as np

    spec = spec or TinySpec()
    spec.check()
    path = Path(path)
    rng = np.random.default_rng(spec.seed)
    e, ff, v = spec.n_embd, spec.n_ff, spec.vocab_size

    def w(*shape: int, scale: float | None = None) -> np.ndarray:
        # numpy shape is ggml's ne reversed: (rows, cols) = (out, in).
        s = scale if scale is not None else 1.0 / np.sqrt(shape[-1])
        return (rng.standard_normal(shape) * s).astype(np.float32)

    def ones(n: int) -> np.ndarray:
        return np.ones(n, dtype=np.float32)

    swa = spec.sliding_window > 0
    tensors: dict[str, np.ndarray] = {
        "token_embd.weight": w(v, e, scale=0.5),
        "output_norm.weight": ones(e),
    }
    if not swa:
        tensors["output.weight"] = w(v, e)
    for i in range(spec.n_layer):
        p = f"blk.{i}."
        tensors |= {
            p + "attn_norm.weight": ones(e),
            p + "attn_q.weight": w(e, e),
            p + "attn_k.weight": w(e, e),
            p + "attn_v.weight": w(e, e),
            p + "attn_output.weight": w(e, e),
            p + "ffn_norm.weight": ones(e),
            p + "ffn_gate.weight": w(ff, e),
            p + "ffn_up.weight": w(ff, e),
            p + "ffn_down.weight": w(e, ff),
        }
        if swa:
            tensors |= {
                p + "post_attention_norm.weight": ones(e),
                p + "post_ffw_norm.weight": ones(e),
            }

    # The blocks' weight matrices: their 2-D tensors (the norms are 1-D).
    quantized = {n for n, a in tensors.items() if n.startswith("blk.") and a.ndim == 2}
    qtype = gguf.GGMLQuantizationType[spec.wtype]

    with atomic_path(path) as tmp:
        arch = "gemma2" if swa else "llama"
        writer = gguf.GGUFWriter(str(tmp), arch)
        vtag = (f"-v{v}" if spec.n_vocab else "") + (
            f"-{spec.wtype}" if spec.wtype != "F32" else ""
        )
        writer.add_name(f"linkctl-tiny-{arch}-{spec.n_layer}L-{e}d-seed{spec.seed}{vtag}")
        if swa:
            writer.add_sliding_window(spec.sliding_window)
        writer.add_context_length(spec.n_ctx)
        writer.add_embedding_length(e)
        writer.add_block_count(spec.n_layer)
        writer.add_feed_forward_length(ff)
        writer.add_head_count(spec.n_head)
        writer.add_head_count_kv(spec.n_head)
        writer.add_rope_dimension_count(e // spec.n_head)
        writer.add_rope_freq_base(10000.0)
        writer.add_layer_norm_rms_eps(1e-5)
        writer.add_vocab_size(v)
        ftype = {"F32": "ALL_F32", "Q8_0": "MOSTLY_Q8_0", "Q4_0": "MOSTLY_Q4_0"}[spec.wtype]
        writer.add_file_type(gguf.LlamaFileType[ftype])

        tokens, scores, types = vocab(v)
        writer.add_tokenizer_model("llama")
        writer.add_token_list(tokens)
        writer.add_token_scores(scores)
        writer.add_token_types(types)
        writer.add_bos_token_id(BOS_ID)
        writer.add_eos_token_id(EOS_ID)
        writer.add_unk_token_id(UNK_ID)
        writer.add_add_bos_token(True)
        writer.add_add_eos_token(False)
        for name, arr in tensors.items():
            if spec.wtype != "F32" and name in quantized:
                writer.add_tensor(name, gguf.quants.quantize(arr, qtype), raw_dtype=qtype)
            else:
                writer.add_tensor(name, arr)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
    n_params = sum(int(a.size) for a in tensors.values())
    return {
        "path": str(path),
        "bytes": path.stat().st_size,
        "tensors": len(tensors),
        "params": n_params,
        "vocab": v,
        **asdict(spec),
    }
