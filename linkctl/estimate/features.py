"""The work one device does, as feature vectors: decode_features (one generated token)
and prefill_features (a prompt), and the coefficients a device's terms map to (µs per
unit of each feature). Time is the dot product of the two, so the estimate
(linkctl.estimate.cost), the device fit (linkctl.estimate.devicefit) and calibration
(linkctl.calibrate.solve) share one model of the work.
"""

from __future__ import annotations

from collections.abc import Mapping

from linkctl.estimate.catalog import DecodeTerms, Device, PrefillTerms
from linkctl.gguf.info import UNQUANTIZED_TYPES, ModelInfo
from linkctl.gguf.reader import type_name

DEFAULT_UBATCH = 512  # llama.cpp's default micro-batch (-ub)


def skips_masked_kv(family: str, flash_attn: bool = True) -> bool:
    """Whether a backend's flash attention skips the KV-cache chunks the mask fully masks,
    so that a sliding-window block reads about its window, not its whole cache view
    (ModelInfo.kv_positions). Read in ggml's source as llama.cpp ships it (ggml-org/ggml
    mirrors llama.cpp's ggml/ tree, each commit naming the llama.cpp PR):

    - Metal (family "apple"): yes. The decode kernel (kernel_flash_attn_ext_vec, used
      while the batch is < 20 tokens: ggml-metal-ops.cpp ggml_metal_op_flash_attn_ext_use_vec)
      loads the mask of each 32-cell chunk (C = OP_FLASH_ATTN_EXT_VEC_NCPSG) and, before
      any K or V read, ``// skip -INF blocks`` ``if (simd_max(sm[tiisg]) <= -MAXHALF)
      continue;`` (https://github.com/ggml-org/ggml/blob/e9e0035d477923a3e91d344768e6d4bc1a55a564/src/ggml-metal/ggml-metal.metal#L6376-L6379,
      llama.cpp #19369, 5 Feb 2026, next to the M2 Ultra rows' build b7948; the check
      dates from flash attention's introduction, llama.cpp #5021, Apr 2024, and is there
      through Aug 2026). The prompt kernel skips the (8 query x 64 cell) blocks that
      kernel_flash_attn_ext_blk marks fully masked (``if (blk[ic0] == 0) ... continue;``,
      llama.cpp #16372, Oct 2025; before it an inline ``if (smax == -INFINITY) continue;``).
    - CUDA (family "nvidia"): no, for one sequence. launch_fattn scans the mask only
      ``if (mask && K->ne[1] % FATTN_KQ_STRIDE == 0 && (Q->ne[1] >= 1024 || Q->ne[3] > 1))``
      (https://github.com/ggml-org/ggml/blob/09aa758381718f7731c148238574a7e169001f13/src/ggml-cuda/fattn-common.cuh#L876-L879,
      31 Oct 2025, as in the GB10 rows' build b6918 of 2 Nov; unchanged through Aug 2026),
      and then only to cut the fully masked tiles at the end of the view
      (flash_attn_mask_to_KV_max);
      for a decode token the vector kernel loops ``k_VKQ_0 < k_VKQ_max`` with
      ``k_VKQ_max = KV_max ? ... : ne11``: every cell of the view, masked or not
      (fattn-vec.cuh L239-L243 there). llama.cpp #14924 (Jul 2025) put this in place of
      the vector kernel's own skip of fully masked slices (#13584, May 2025); no row in
      the data is from that window.
    - Without flash attention (either backend) the KQ product runs over the whole view.
    """
    return flash_attn and family == "apple"


# Work is a vector of features, time is the dot product with the device's
# coefficients, so scripts/fit_devices.py fits exactly the model the estimate runs.
DECODE_FEATURES = ("blocks", "moe_blocks", "quant_bytes", "f16_bytes", "kv_bytes")
PREFILL_FEATURES = (
    "ubatch_blocks",
    "moe_ubatch_blocks",
    "dense_quant_flops",
    "dense_f16_flops",
    "moe_flops",
    "attn_flops",
)
# Indices into DECODE_FEATURES and PREFILL_FEATURES (and the coefficient lists).
D_BLOCK, D_MOE, D_Q, D_F16, D_KV = range(len(DECODE_FEATURES))
P_UB, P_MOE_UB, P_Q, P_F16, P_MOE, P_ATTN = range(len(PREFILL_FEATURES))


def decode_coefs(t: DecodeTerms) -> list[float]:
    """µs per unit of each DECODE_FEATURES entry."""
    return [
        t.layer_us,
        t.moe_layer_us,
        1e6 / (t.bw_gbs * 1e9),
        1e6 / (t.bw_f16_gbs * 1e9),
        1e6 / (t.kv_bw_gbs * 1e9),
    ]


def decode_terms_from_coefs(c: list[float]) -> DecodeTerms:
    return DecodeTerms(c[0], c[1], 1e-3 / c[2], 1e-3 / c[3], 1e-3 / c[4])


def prefill_coefs(t: PrefillTerms) -> list[float]:
    return [
        t.ubatch_layer_us,
        t.moe_ubatch_layer_us,
        1e6 / (t.tflops * 1e12),
        1e6 / (t.tflops_f16 * 1e12),
        1e6 / (t.moe_tflops * 1e12),
        1e6 / (t.attn_tflops * 1e12),
    ]


def prefill_terms_from_coefs(c: list[float]) -> PrefillTerms:
    return PrefillTerms(c[0], c[1], 1e-6 / c[2], 1e-6 / c[3], 1e-6 / c[4], 1e-6 / c[5])


def dot(coefs: list[float], feats: list[float]) -> float:
    return sum(a * b for a, b in zip(coefs, feats, strict=True))


def weight_type_bytes(model: ModelInfo, layers: list[int], holds_output: bool) -> dict[int, float]:
    """Weight bytes one token reads on a device holding ``layers`` (+ the output head), by
    ggml type id (a Q4_K_M file mixes Q4_K, Q6_K, F32 ...)."""
    out: dict[int, float] = {}
    st = model.block_stats
    for il in layers:
        for t, b in st[il].type_bytes:
            out[t] = out.get(t, 0.0) + b
    if holds_output:
        for t, b in model.output_type_bytes.items():
            out[t] = out.get(t, 0.0) + b
    return out


def quant_type_bytes(model: ModelInfo, layers: list[int], holds_output: bool) -> dict[str, float]:
    """weight_type_bytes' quantized types only, by ggml type name."""
    out: dict[str, float] = {}
    for t, b in weight_type_bytes(model, layers, holds_output).items():
        if t not in UNQUANTIZED_TYPES:
            out[type_name(t)] = out.get(type_name(t), 0.0) + b
    return out


def priced_quant_bytes(by_type: Mapping[int, float], factors: Mapping[str, float]) -> float:
    """The quantized weight bytes in reference-type (Q8_0) equivalents: each type's bytes
    over its read-rate factor (linkctl.estimate.kernel_rates; a type without one: 1)."""
    return sum(
        b / factors.get(type_name(t), 1.0) for t, b in by_type.items() if t not in UNQUANTIZED_TYPES
    )


def decode_features(
    model: ModelInfo,
    layers: list[int],
    holds_output: bool,
    depth: float,
    ubatch: int = DEFAULT_UBATCH,
    flash_attn: bool = True,
    skips_masked: bool = False,
    factors: Mapping[str, float] | None = None,
) -> list[float]:
    """DECODE_FEATURES for one token on a device holding ``layers`` (+ the output head);
    ``ubatch`` sizes a sliding-window block's cache and ``skips_masked`` says whether the
    backend reads only its window of it (ModelInfo.kv_positions, skips_masked_kv); the
    KV feature is the attention's bytes, which depend on the flash-attention path
    (ModelInfo.attn_bytes_per_position; llama-server defaults to it). ``factors``: the
    device's read rate of each quantized ggml type relative to Q8_0 (by type name), so
    the quantized feature is Q8_0-equivalent bytes (priced_quant_bytes); None: raw bytes."""
    st = model.block_stats
    q = sum(st[il].quant_bytes for il in layers)
    f = sum(st[il].f16_bytes for il in layers)
    kv = model.attn_bytes_per_position(flash_attn) * sum(
        model.kv_positions(il, depth, ubatch, skips_masked) for il in layers
    )
    moe = sum(1 for il in layers if st[il].moe)
    if holds_output:
        oq, of = model.output_split
        q, f = q + oq, f + of
    if factors:
        q = priced_quant_bytes(weight_type_bytes(model, layers, holds_output), factors)
    return [float(len(layers)), float(moe), q, f, kv]


def prefill_features(
    model: ModelInfo,
    layers: list[int],
    holds_output: bool,
    n_prompt: int,
    depth: float = 0,
    ubatch: int = DEFAULT_UBATCH,
    skips_masked: bool = False,
) -> list[float]:
    """PREFILL_FEATURES summed over the micro-batches of an ``n_prompt``-token prompt
    that starts at context position ``depth`` (``skips_masked``: see decode_features)."""
    st = model.block_stats
    dq = sum(st[il].dense_quant_flops for il in layers)
    df = sum(st[il].dense_f16_flops for il in layers)
    mx = sum(st[il].expert_flops for il in layers)
    moe_blocks = sum(1 for il in layers if st[il].moe)
    per_pos = 4.0 * model.head_count * (model.key_length or 1)
    n_mb = max(1, -(-n_prompt // ubatch))
    out = [0.0] * len(PREFILL_FEATURES)
    for b in range(n_mb):
        tokens = min(ubatch, n_prompt - b * ubatch)
        mid = depth + b * ubatch + tokens / 2  # mean position attended in this micro-batch
        attn = per_pos * sum(model.kv_positions(il, mid, ubatch, skips_masked) for il in layers)
        out[0] += len(layers)
        out[1] += moe_blocks
        out[2] += tokens * dq
        out[3] += tokens * df
        out[4] += tokens * mx
        out[5] += tokens * attn
    if holds_output:  # llama.cpp computes logits for the last token of the prompt only
        out[2] += 2.0 * model.output_params
    return out


def prefill_us(dev: Device, feats: list[float]) -> float:
    return dot(prefill_coefs(dev.prefill), feats)
