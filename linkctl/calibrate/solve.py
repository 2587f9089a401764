"""`linkctl calibrate`: measure this host's real llama.cpp figures and store them.

1. llama-server runs the given model alone on this host (127.0.0.1 only). One
   warm-up request, then ``runs`` timed /completion requests of ``tokens``
   decode tokens each (ignore_eos, prompt cache off); llama-server's own
   ``timings`` give decode tok/s (predicted_per_second) and prefill tok/s
   (prompt_per_second); the median run is kept (by decode tok/s). Not the fastest:
   on a busy host one run in five can catch the CPUs free (lab, 2 shared cores:
   40.7, 55.6, 44.1, 41.9, 41.4 tok/s), and a split served later on that host
   runs at the typical speed, not at that outlier's (bench/split_gain.py).
2. The two decode terms, per-block cost and effective bandwidth, are solved from
   two models (or more) of different shape: t = blocks x layer_us + bytes / bw for
   each, bytes per token from the GGUF header exactly as the estimate counts them
   (active weights + output head + KV cache at the mean context of the run). The
   models are the unquantized given --model(s) plus generated ones (linkctl.gguf.tiny:
   24 thin blocks, 2 wide blocks) until two differ in blocks per byte.
   A given model the plan found reads mostly quantized weights (plan.reads_quantized)
   is the host's measure of its types: its time less the two terms' share (per-block
   cost, its F32/F16 and KV bytes at bw) is its quantized bytes' read time, so their
   rate, as a factor of bw, is the record's weight_rates for each type it holds (one
   rate for the types one model reads together: it cannot tell them apart). The
   estimate then prices those types on this host by the measured rate, not the
   catalog's prior (estimate.catalog.apply_calibration).
3. effective prefill compute = FLOPs per prompt x prefill tok/s, on the model
   with the most FLOPs.
4. ``--rpc``: the same model through a ggml-rpc-server on 127.0.0.1 (all layers
   on the RPC device), as this host works when it is the rpc end of a split.
   Its per-token time minus the loopback round trip (timed with
   GET_DEVICE_MEMORY before llama-server connects) gives this host's effective
   bandwidth *as an RPC device* (rpc_effective_bandwidth_gbs), which folds in
   the RPC processing cost (request (de)serialisation, the rpc-server's graph
   dispatch); the estimate uses it for this host's rpc role. The difference to
   the local run is reported as rpc_overhead_us (noisy on a busy host).

Three stages, one module each: calibrate_plan.plan (what `--dry-run` prints),
calibrate_measure.measure (runs llama.cpp: the only one that takes time) and record
here, which solves the terms; records.save_calibration stores the record in
state_dir()/calibration.json under this host's profile name.
"""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from linkctl.calibrate.measure import Measurements
from linkctl.calibrate.plan import CalibrationPlan
from linkctl.core.errors import CheckFailed
from linkctl.core.records import CalibrationRecord, WeightRate, dump
from linkctl.llama.client import Timing


def typical_run(runs: list[Timing]) -> Timing:
    """The median run by decode tok/s (the lower middle one of an even count)."""
    ranked = sorted(runs, key=lambda r: r.predicted_per_second)
    return ranked[(len(ranked) - 1) // 2]


def solve_two_terms(
    points: list[tuple[float, float, float]],
) -> tuple[float, float]:
    """(layer_us, bandwidth GB/s) from (blocks, bytes per token, measured µs per token)
    of two or more models: t = blocks x layer_us + bytes / bandwidth, least squares on
    relative error, both terms >= 0."""
    from linkctl.estimate.solve import nnls

    a = [[blocks / t, nbytes / t] for blocks, nbytes, t in points]
    (c, inv_bw), _ = nnls(a, [1.0] * len(points))
    if inv_bw <= 0:
        raise CheckFailed(
            "calibration: the measured times do not rise with the bytes read "
            f"({points}); the host was too busy, re-run"
        )
    return c, 1e-3 / inv_bw


def type_rates(
    info, run: Timing, x: dict[str, Any], layer_us: float, bw: float
) -> dict[str, WeightRate]:
    """A quantized model's types' read rate: its per-token time less what the two terms
    price (per-block cost, its F32/F16 and KV bytes at ``bw``) reads its quantized bytes.
    Every type the model holds (typefit.SHARE_MIN of them, as the catalog fit counts a
    type held) gets that one rate."""
    from linkctl.estimate.features import decode_features, quant_type_bytes
    from linkctl.estimate.typefit import SHARE_MIN

    layers = list(range(info.block_count))
    f = decode_features(info, layers, True, run.prompt_n + run.predicted_n / 2)
    q_us = x["per_token_us"] - info.block_count * layer_us - (f[3] + f[4]) / (bw * 1e3)
    if q_us <= 0:
        raise CheckFailed(
            f"calibration: {x['model_name']} decoded faster than the F32 terms price its "
            f"other bytes alone ({x['per_token_us']:.0f} µs a token); the host was too "
            "busy, re-run"
        )
    gbs = f[2] / q_us / 1e3
    by_type = quant_type_bytes(info, layers, True)
    held = sorted(t for t, b in by_type.items() if b >= SHARE_MIN * f[2])
    name = str(x["model_name"])
    return {t: WeightRate(factor=gbs / bw, gbs=gbs, model=name, together=held) for t in held}


def record(plan: CalibrationPlan, m: Measurements) -> CalibrationRecord:
    """The calibration record from the plan's models and their measured runs: the two
    decode terms, the prefill compute and (``--rpc``) this host as an RPC device."""
    from dataclasses import asdict

    from linkctl.estimate.features import decode_features, prefill_features
    from linkctl.gguf.info import read_model

    def bytes_per_token(model, run: Timing) -> float:
        # Active weights + output head + KV cache at the mean context of the run.
        depth = run.prompt_n + run.predicted_n / 2
        f = decode_features(model, list(range(model.block_count)), True, depth)
        return f[2] + f[3] + f[4]

    infos = [read_model(pm.path) for pm in plan.models]
    measured: list[dict[str, Any]] = []
    for pm, info, model_runs in zip(plan.models, infos, m.runs, strict=True):
        best = typical_run(model_runs)
        measured.append(
            {
                "model": pm.path,
                "model_name": info.name or Path(pm.path).name,
                "blocks": info.block_count,
                "bytes_per_token": bytes_per_token(info, best),
                "decode_tok_s": best.predicted_per_second,
                "per_token_us": 1e6 / best.predicted_per_second,
                "prefill_tok_s": best.prompt_per_second,
                "prompt_n": best.prompt_n,
                "runs": [asdict(r) for r in model_runs],
                "generated": pm.generated,
                "quantized": pm.quantized,
            }
        )
    layer_us, bw = solve_two_terms(
        [
            (x["blocks"], x["bytes_per_token"], x["per_token_us"])
            for x in measured
            if not x["quantized"]
        ]
    )
    rates: dict[str, WeightRate] = {}
    for x, info, model_runs in zip(measured, infos, m.runs, strict=True):
        x["predicted_us"] = x["blocks"] * layer_us + x["bytes_per_token"] / (bw * 1e3)
        if x["quantized"]:
            for t, r in type_rates(info, typical_run(model_runs), x, layer_us, bw).items():
                rates.setdefault(t, r)
            x["predicted_us"] = x["per_token_us"]  # its types' rate is what it measured
    # Prefill compute: from the model with the most FLOPs per prompt (the per-micro-batch
    # fixed cost is not separated here; it is small against a whole prompt's FLOPs).
    flops = [
        sum(prefill_features(info, list(range(info.block_count)), True, int(x["prompt_n"]))[2:])
        for info, x in zip(infos, measured, strict=True)
    ]
    k = max(range(len(measured)), key=lambda i: flops[i])
    pk = measured[k]
    tflops = (
        flops[k] / (pk["prompt_n"] / pk["prefill_tok_s"]) / 1e12 if pk["prefill_tok_s"] else None
    )
    first = measured[0]
    rec: dict[str, Any] = {
        "host": plan.host,
        "device": plan.device,
        "model": first["model"],
        "model_name": first["model_name"],
        "measured_at": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "threads": plan.threads,
        "tokens": plan.tokens,
        "runs": first["runs"],
        "models": measured,
        "decode_tok_s": first["decode_tok_s"],
        "prefill_tok_s": first["prefill_tok_s"],
        "bytes_per_token": first["bytes_per_token"],
        "layer_us": layer_us,
        "effective_bandwidth_gbs": bw,
        "effective_tflops": tflops,
        "weight_rates": rates or None,
        "catalog_layer_us": plan.catalog_layer_us,
        "catalog_effective_bandwidth_gbs": plan.catalog_effective_bandwidth_gbs,
        "llama_server": plan.llama_server,
        "build": plan.build,
    }
    if plan.cpu_quota and plan.cpu_quota.cpus:
        rec["cpu_quota"] = plan.cpu_quota.model_dump()
    if m.rpc:
        rb = typical_run(m.rpc.runs)
        loop_rtt = m.rpc.loopback_rtt_us
        per_tok_local = first["per_token_us"]
        per_tok_rpc = 1e6 / rb.predicted_per_second
        # This host as an RPC device: its per-token time behind a (loopback) RPC boundary,
        # less the round trip, over the bytes it reads. Folds in the RPC processing cost.
        rpc_bytes = bytes_per_token(infos[0], rb)
        rec["rpc"] = {
            "runs": [asdict(r) for r in m.rpc.runs],
            "decode_tok_s": rb.predicted_per_second,
            "loopback_rtt_us": loop_rtt,
            "per_token_us": per_tok_rpc,
            "local_per_token_us": per_tok_local,
        }
        rec["rpc_overhead_us"] = per_tok_rpc - per_tok_local - loop_rtt
        rec["rpc_effective_bandwidth_gbs"] = (
            rpc_bytes / max(1.0, per_tok_rpc - loop_rtt) * 1e6 / 1e9
        )
    return CalibrationRecord.model_validate(rec)


def as_json(rec: CalibrationRecord, saved_to: Path) -> dict[str, Any]:
    """What `linkctl calibrate --json` prints: the record as stored, and where."""
    import json

    return {**json.loads(dump(rec)), "saved_to": str(saved_to)}


def render_calibration(rec: dict[str, Any]) -> None:
    from linkctl.core.output import console

    console.print(f"[bold]{rec['host']}[/] ({rec['device']}):")
    for x in rec.get("models", []):
        console.print(
            f"  {x['model_name']}: {x['blocks']} blocks, {x['bytes_per_token'] / 1e6:.1f} MB/token"
            f" -> {x['decode_tok_s']:.1f} tok/s ({x['per_token_us']:.0f} µs/token, "
            + (
                "quantized: its types' rate below)"
                if x.get("quantized")
                else f"two-term fit {x['predicted_us']:.0f} µs)"
            )
        )
    console.print(
        f"  decode terms: {rec.get('layer_us', 0):.1f} µs per block + bytes / "
        f"{rec['effective_bandwidth_gbs']:.1f} GB/s (catalog: "
        f"{rec.get('catalog_layer_us', 0):.1f} µs + bytes / "
        f"{rec['catalog_effective_bandwidth_gbs']:.1f} GB/s)"
    )
    for t, r in (rec.get("weight_rates") or {}).items():
        with_ = (
            f" (read together with {', '.join(r['together'])})" if len(r["together"]) > 1 else ""
        )
        console.print(
            f"  {t} weights: {r['gbs']:.1f} GB/s = {r['factor']:.2f} x that bandwidth, on "
            f"{r['model']}{with_}"
        )
    if rec.get("effective_tflops"):
        console.print(
            f"  prefill {rec['prefill_tok_s']:.0f} tok/s = "
            f"{rec['effective_tflops']:.2f} TFLOPS effective"
        )
    if "rpc" in rec:
        r = rec["rpc"]
        console.print(
            f"  via loopback RPC {r['decode_tok_s']:.1f} tok/s: "
            f"{r['per_token_us']:.0f} µs/token vs {r['local_per_token_us']:.0f} local, "
            f"loopback RTT {r['loopback_rtt_us']:.0f} µs -> as an RPC device "
            f"{rec['rpc_effective_bandwidth_gbs']:.1f} GB/s effective (RPC costs "
            f"{rec['rpc_overhead_us']:+.0f} µs per token over local)"
        )
    console.print(f"  saved to {rec['saved_to']}")
