"""What a GGUF model costs, from its header (linkctl.gguf.reader): the metadata
mapped to the hyperparameters the estimate needs, and each tensor's bytes and
FLOPs per token, by block.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from linkctl.core.errors import InputError
from linkctl.gguf.reader import (
    MAX_BLOCKS,
    MAX_HPARAM,
    SkippedArray,
    TensorInfo,
    corrupt,
    known_architectures,
    read_header,
)

# Sliding-window attention pattern per architecture (see ModelInfo.swa_layers).
SWA_PATTERN = {"gpt-oss": 2, "gemma3": 6}


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
    # The bytes read per token by ggml type id (routed experts scaled as above): what the
    # estimate prices per type (linkctl.estimate.weight_types).
    type_bytes: tuple[tuple[int, float], ...] = ()


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
        acc = [[0.0] * 5 for _ in range(self.block_count)]
        moe = [False] * self.block_count
        by_type: list[dict[int, float]] = [{} for _ in range(self.block_count)]
        for t in self.tensors:
            li = t.layer
            if li is None or li >= self.block_count:
                continue
            a = acc[li]
            share = frac if t.is_expert else 1.0
            a[1 if t.type_id in UNQUANTIZED_TYPES else 0] += t.nbytes * share
            by_type[li][t.type_id] = by_type[li].get(t.type_id, 0.0) + t.nbytes * share
            if len(t.shape) >= 2:
                if t.is_expert:
                    a[4] += 2.0 * t.nelements * frac
                    moe[li] = True
                else:
                    a[3 if t.type_id in UNQUANTIZED_TYPES else 2] += 2.0 * t.nelements
        return [
            BlockStats(a[0], a[1], a[2], a[3], a[4], m, tuple(sorted(bt.items())))
            for a, m, bt in zip(acc, moe, by_type, strict=True)
        ]

    def _output_tensors(self) -> list[TensorInfo]:
        own = [t for t in self.tensors if t.layer is None and t.name.startswith("output")]
        if not any(t.name == "output.weight" for t in self.tensors):
            own += [t for t in self.tensors if t.name.startswith("token_embd")]
        return own

    @property
    def output_split(self) -> tuple[int, int]:
        """(quantized, unquantized) bytes of the output head (output_bytes)."""
        own = self._output_tensors()
        f = sum(t.nbytes for t in own if t.type_id in UNQUANTIZED_TYPES)
        return sum(t.nbytes for t in own) - f, f

    @cached_property
    def output_type_bytes(self) -> dict[int, float]:
        """The output head's bytes by ggml type id (output_split, per type)."""
        out: dict[int, float] = {}
        for t in self._output_tensors():
            out[t.type_id] = out.get(t.type_id, 0.0) + t.nbytes
        return out

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
        edges add at most one chunk, 32 or 64 cells; see
        linkctl.estimate.features.skips_masked_kv)."""
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


def _get(meta: dict[str, Any], arch: str, key: str) -> Any:
    v = meta.get(f"{arch}.{key}")
    return None if isinstance(v, SkippedArray) else v


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
            raise corrupt(
                str(path), f"{arch}.{key} = {str(v)[:40]} is not a count in 0..{MAX_HPARAM}"
            )
        return n

    layers_seen = [t.layer for t in tensors if t.layer is not None]
    if layers_seen and max(layers_seen) >= MAX_BLOCKS:
        bad = next(t.name for t in tensors if (t.layer or 0) >= MAX_BLOCKS)
        raise corrupt(str(path), f"tensor {bad!r}: block index past {MAX_BLOCKS - 1}")
    blocks_from_tensors = max(layers_seen) + 1 if layers_seen else 0
    block_count = num("block_count")
    if block_count is None:
        block_count = blocks_from_tensors
        if arch_known:
            warnings.append(f"{arch}.block_count missing: took {block_count} from tensor names")
    if block_count > MAX_BLOCKS:
        raise corrupt(str(path), f"{arch}.block_count {block_count} is past {MAX_BLOCKS}")
    embd = num("embedding_length")
    tok = next((t for t in tensors if t.name == "token_embd.weight"), None)
    if embd is None:
        embd = tok.shape[0] if tok else 0
        if arch_known:
            warnings.append(f"{arch}.embedding_length missing: took {embd} from token_embd")
    vocab = tok.shape[1] if tok and len(tok.shape) > 1 else 0
    toks = meta.get("tokenizer.ggml.tokens")
    if not vocab and toks is not None:
        vocab = toks.count if isinstance(toks, SkippedArray) else len(toks)
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
        raise corrupt(
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
        metadata={k: v for k, v in meta.items() if not isinstance(v, SkippedArray | list)},
        sliding_window=num("attention.sliding_window") or 0,
    )
