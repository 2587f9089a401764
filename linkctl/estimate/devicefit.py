"""Fit each catalog device's decode and prefill terms to public llama-bench rows.

The rows (data/published_bench.toml) go through the estimator's own feature code
(linkctl.estimate.features.decode_features / prefill_features on a linkctl.gguf.shapes model),
so a row's predicted time is exactly what `linkctl estimate` computes for that
model on that device. Time is linear in the terms' coefficients (µs per block,
µs per byte, µs per FLOP), so each device is a non-negative least-squares problem
on relative error: minimise sum over rows of (predicted / published - 1)^2.

A device's data rarely pins every term, so terms are tied or borrowed, and the
fit records which (devices_fit.toml `notes`):
  - F16 bandwidth tied to the quantized one (x the family anchor's ratio) unless the
    device has rows whose weights are mostly F16;
  - KV bandwidth tied likewise unless it has decode rows at depth >= 2048;
  - the MoE per-block cost tied to the per-block cost (x the anchor's ratio) unless it
    has MoE rows; prefill's MoE terms the same way;
  - with fewer distinct rows than free terms, the per-block cost is the family
    anchor's (assumed).
The family anchor is the family's device with the most rows; it is fitted first.
A device with no rows at all takes its anchor's terms, bandwidth and FLOPS scaled
by the spec ratio (assumed); a family without an anchor (cpu) falls back to the
catalog's spec x prior efficiency.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cache
from typing import Any

from linkctl.core.errors import InputError
from linkctl.estimate.catalog import (
    DECODE_FIELDS,
    ON_BOUND,
    PREFILL_FIELDS,
    load_spec,
    prior_terms,
)
from linkctl.estimate.features import (
    D_BLOCK,
    D_F16,
    D_KV,
    D_MOE,
    D_Q,
    P_ATTN,
    P_F16,
    P_MOE,
    P_MOE_UB,
    P_Q,
    P_UB,
    decode_coefs,
    decode_features,
    dot,
    prefill_coefs,
    prefill_features,
    skips_masked_kv,
)
from linkctl.estimate.kernel_rates import TypeRate, family_rates
from linkctl.estimate.published import Row, row_model, row_time_us
from linkctl.estimate.solve import Sample, full_rank, solve_tied
from linkctl.estimate.typefit import TypeColumns, fittable, fitted_rates, rate_name, tied_note

KV_DEPTH_MIN = 2048  # a decode row this deep (mean position) pins the KV bandwidth
F16_SHARE_MIN = 0.5  # a row whose weight bytes are mostly F16 pins the F16 terms


def row_features(row: Row, factors: dict[str, float] | None = None) -> list[float]:
    """What the estimator counts for this llama-bench test on one device (all blocks
    and the output head): per generated token for tg, per prompt for pp; ``factors``:
    the device's weight-type read rates (features.decode_features)."""
    m = row_model(row)
    layers = list(range(m.block_count))
    # Whether the row's backend skips the cache chunks the mask fully masks (Metal's flash
    # attention does, CUDA's single-sequence decode does not): a sliding-window block then
    # reads its window, not its whole cache (linkctl.estimate.features.skips_masked_kv).
    skip = skips_masked_kv(_family(row.device), row.flash_attn)
    if row.kind == "decode":
        depth = row.depth + row.n / 2
        return decode_features(m, layers, True, depth, row.ubatch, row.flash_attn, skip, factors)
    return prefill_features(m, layers, True, row.n, row.depth, row.ubatch, skip)


@cache
def _family(device: str) -> str:
    """The catalog family of a row's device ("apple" runs llama.cpp's Metal backend)."""
    return str(load_spec().get(device, {}).get("family", ""))


def _f16_heavy(row: Row) -> bool:
    f = row_features(row)
    if row.kind == "decode":
        return f[D_F16] > F16_SHARE_MIN * (f[D_Q] + f[D_F16])
    return f[P_F16] > F16_SHARE_MIN * (f[P_Q] + f[P_F16])


@dataclass
class Prior:
    """What a device borrows from its family anchor for the terms its rows do not pin."""

    decode: list[float]  # the anchor's decode coefficients (absolute)
    prefill: list[float]
    anchor: str | None = None

    def ratio(self, coefs: list[float], i: int, j: int, default: float) -> float:
        return coefs[i] / coefs[j] if coefs[j] > 0 and coefs[i] > 0 else default


@dataclass
class DeviceFit:
    decode: list[float]
    prefill: list[float]
    notes: dict[str, str] = field(default_factory=dict)
    n_decode: int = 0
    n_prefill: int = 0
    # Each quantized ggml type's read rate relative to Q8_0 (kernel_rates), fitted or tied.
    rates: dict[str, TypeRate] = field(default_factory=dict)

    @property
    def factors(self) -> dict[str, float]:
        return {t: r.factor for t, r in self.rates.items()}


def _samples(rows: list[Row], cols: TypeColumns | None = None) -> list[Sample]:
    if cols is None:
        return [(row_features(r), row_time_us(r)) for r in rows]
    f = cols.base_factors()
    return [(row_features(r, f) + cols.extra(r), row_time_us(r)) for r in rows]


# A bound in coefficient space: the fewest µs per unit (byte, FLOP) the device can
# spend, with the text that cites it.
Bounds = dict[int, tuple[float, str]]


def bounds(spec: dict[str, Any]) -> tuple[Bounds, Bounds]:
    """(decode, prefill) bounds of a device: every bandwidth term at most what it reaches
    in a memory-bound kernel, every FLOPS term at most its compute-bound rate
    (devices.toml `bound_bandwidth_gbs` / `bound_tflops` with their sources, else the
    vendor's peak, which nothing exceeds).

    Compute bounds only where the catalog's FLOPS figure is the rate llama.cpp's kernels
    can reach at most: Apple GPUs (Metal's simdgroup matrix multiply runs FP16 and FP32
    at one rate, devices.toml). On NVIDIA, llama.cpp's quantized matmul runs on the int8
    tensor cores (ggml-cuda mmq.cuh) and its flash attention can accumulate in FP16, both
    above the FP16-with-FP32-accumulate figure the catalog holds: the fitted rtx4090
    prompt rate (193 TFLOPS) is above its 165; those terms stay unbounded."""
    bw = spec.get("bound_bandwidth_gbs")
    bw_src = spec.get("bound_bandwidth_gbs_source") if bw else None
    if not bw:
        bw, bw_src = (
            spec["mem_bandwidth_gbs"],
            f"the vendor's peak ({spec['mem_bandwidth_gbs_source']})",
        )
    per_byte = 1e6 / (float(bw) * 1e9)
    dec = {i: (per_byte, f"{float(bw):g} GB/s, {bw_src}") for i in (D_Q, D_F16, D_KV)}
    tf = spec.get("bound_tflops")
    tf_src = spec.get("bound_tflops_source") if tf else None
    if not tf and spec.get("family") == "apple":
        tf, tf_src = spec["fp16_tflops"], f"the vendor's peak ({spec['fp16_tflops_source']})"
    pre: Bounds = {}
    if tf:
        per_flop = 1e6 / (float(tf) * 1e12)
        pre = {
            i: (per_flop, f"{float(tf):g} TFLOPS, {tf_src}") for i in (P_Q, P_F16, P_MOE, P_ATTN)
        }
    return dec, pre


def _on_bound(
    c: list[float], mins: Bounds, names: tuple[str, ...], notes: dict[str, str], refit
) -> list[float]:
    """Hold every term to its bound: one faster than it is fixed at the bound (the terms
    tied to it follow) and the rest refitted around it, and marked in the notes."""
    for _ in range(len(mins)):
        over = [i for i in mins if c[i] < mins[i][0] * (1 - 1e-9)]
        if not over:
            break
        i = over[0]
        notes[names[i]] = f"{ON_BOUND}: {mins[i][1]}"
        c = refit(i, mins[i][0])
    return c


def _held(coefs: list[float]):
    """For assumed terms (no rows to refit): the term alone is held at its bound."""

    def refit(i: int, v: float) -> list[float]:
        nonlocal coefs
        coefs = [v if j == i else c for j, c in enumerate(coefs)]
        return coefs

    return refit


def _solve_pinned(
    rows: list[Row],
    n_coef: int,
    ties: dict[int, tuple[int, float]],
    fixed: dict[int, float],
    throughput: tuple[int, ...],
    prior: list[float],
    names: tuple[str, ...],
    notes: dict[str, str],
    src: str,
    mins: Bounds,
    cols: TypeColumns | None = None,
) -> list[float]:
    """Fit; a throughput term the rows leave at zero cost (unbounded) is tied to the
    quantized one at the prior's ratio (the main one: fixed at the prior, with what is
    tied to it) and the rest refitted around it, not added on top of a fit that spent
    its time elsewhere. Ratios carry across a family better than absolute rates."""
    main = throughput[0]
    c = solve_tied(_samples(rows, cols), n_coef, ties, fixed)
    for _ in throughput:
        bad = [i for i in throughput if c[i] <= 0 and i not in fixed and i not in ties]
        if not bad:
            break
        i = bad[0]
        if i != main and main not in fixed:
            r = prior[i] / prior[main] if prior[main] > 0 else 1.0
            ties[i] = (main, r)
            notes[names[i]] = (
                f"assumed (not pinned by the rows): {names[main]} x the ratio in {src}"
            )
        else:
            fixed[i] = prior[i]
            for j, (p, k) in list(ties.items()):
                if p == i:
                    del ties[j]
                    fixed[j] = k * prior[i]
            notes[names[i]] = f"assumed (not pinned by the rows): {src}"
        c = solve_tied(_samples(rows, cols), n_coef, ties, fixed)

    def refit(i: int, v: float) -> list[float]:
        ties.pop(i, None)
        fixed[i] = v
        return solve_tied(_samples(rows, cols), n_coef, ties, fixed)

    return _on_bound(c, mins, names, notes, refit)


def _distinct(rows: list[Row]) -> int:
    return len({tuple(round(v, 6) for v in row_features(r)) for r in rows})


def _block_share(row: Row, pc: list[float]) -> float:
    """The share of the row's time the prior's per-block costs explain."""
    f = row_features(row)
    total = dot(pc, f)
    return (pc[D_BLOCK] * f[D_BLOCK] + pc[D_MOE] * f[D_MOE]) / total if total > 0 else 0.0


def _tied_note(prior: Prior, why: str, base: str, alone: int = 1) -> str:
    """Why a term is tied to another, and to what ratio."""
    if prior.anchor:
        return f"assumed ({why}): {base} x the ratio in the {prior.anchor} fit"
    return f"assumed ({why}): {base} x {alone} (no device to borrow a ratio from)"


def fit_decode(
    rows: list[Row], prior: Prior, mins: Bounds | None = None, cols: TypeColumns | None = None
) -> tuple[list[float], dict[str, str]]:
    """The decode coefficients (DECODE_FEATURES, then one per type in ``cols.fitted``:
    the µs per byte of that type) and the notes on what is assumed."""
    cols = cols or TypeColumns()
    nc = 5 + len(cols.fitted)
    pc = prior.decode + [prior.decode[D_Q] / cols.factors.get(t, 1.0) for t in cols.fitted]
    names = DECODE_FIELDS + tuple(rate_name(t) for t in cols.fitted)
    mn = dict(mins or {})  # a fitted type's bytes: the same bound as every quantized byte
    if D_Q in mn:
        mn |= {5 + j: mn[D_Q] for j in range(len(cols.fitted))}
    src = f"the {prior.anchor} fit" if prior.anchor else "no device to borrow from"

    ties: dict[int, tuple[int, float]] = {}
    fixed: dict[int, float] = {}
    notes: dict[str, str] = {}
    if not any(_f16_heavy(r) for r in rows):
        ties[D_F16] = (D_Q, prior.ratio(pc, D_F16, D_Q, 1.0))
        notes["bw_f16_gbs"] = _tied_note(prior, "no F16 rows", "bw_gbs")
    if not any(r.depth + r.n / 2 >= KV_DEPTH_MIN for r in rows):
        ties[D_KV] = (D_Q, prior.ratio(pc, D_KV, D_Q, 1.0))
        notes["kv_bw_gbs"] = _tied_note(prior, "no deep decode rows", "bw_gbs")
    if not any(row_model(r).is_moe for r in rows):
        ties[D_MOE] = (D_BLOCK, prior.ratio(pc, D_MOE, D_BLOCK, 0.0))
        notes["moe_layer_us"] = _tied_note(prior, "no MoE rows", "layer_us", 0)
    n = _distinct(rows)
    if cols.fitted and (
        nc - len(ties) > n - 2 or not full_rank(_samples(rows, cols), nc, ties, fixed)
    ):
        # Too few rows, or rows that do not separate a type's rate: every type at its prior.
        return fit_decode(rows, prior, mins, TypeColumns(cols.factors))
    order = [D_MOE, D_KV, D_F16]
    while nc - len(ties) - len(fixed) > n and order:
        i = order.pop(0)
        if i not in ties:
            partner = D_BLOCK if i == D_MOE else D_Q
            ties[i] = (partner, prior.ratio(pc, i, partner, 1.0 if i != D_MOE else 0.0))
            notes[DECODE_FIELDS[i]] = f"assumed (too few rows): the ratio in {src}"
    if nc - len(ties) - len(fixed) > n and _block_share(rows[0], prior.decode) >= 0.5:
        # One row shape cannot split per-block cost from bandwidth: borrow from the
        # family anchor the term that explains less of its time, and fit the other,
        # so the borrowed term's error moves the prediction least. Per-block cost
        # explains more (a small model): take the share of the spec bandwidth the
        # anchor reaches, unless that leaves no per-block cost (then the bandwidth
        # alone explains the row); bandwidth explains more (a large model): the
        # anchor's per-block cost, below.
        c = solve_tied(_samples(rows, cols), nc, ties, {D_Q: pc[D_Q]})
        if c[D_BLOCK] > 0:
            notes["bw_gbs"] = f"assumed (too few rows): the spec share of {src}"
            return c, notes
        fixed[D_BLOCK] = 0.0
        notes["layer_us"] = "assumed (too few rows): 0, the bandwidth alone explains the row"
    if (
        nc - len(ties) - len(fixed) > n or not full_rank(_samples(rows, cols), nc, ties, fixed)
    ) and D_BLOCK not in fixed:
        # Every quantized row (or every F16 row) is one model shape: per-block cost and
        # bandwidth are collinear. Take the family anchor's per-block cost, fit the rest.
        _pin(fixed, ties, pc, D_BLOCK, D_MOE)
        notes["layer_us"] = f"assumed (rows do not separate it from bandwidth): {src}"
    through = (D_Q, D_F16, D_KV, *range(5, nc))
    c = _solve_pinned(rows, nc, ties, fixed, through, pc, names, notes, src, mn, cols)
    return c, notes


def _pin(
    fixed: dict[int, float], ties: dict[int, tuple[int, float]], pc: list[float], i: int, tied: int
) -> None:
    """Fix term i at the anchor's value; a term tied to it is fixed at the anchor's value too."""
    fixed[i] = pc[i]
    if tied in ties:
        del ties[tied]
        fixed[tied] = pc[tied]


def fit_prefill(
    rows: list[Row], prior: Prior, mins: Bounds | None = None
) -> tuple[list[float], dict[str, str]]:
    pc = prior.prefill
    src = f"the {prior.anchor} fit" if prior.anchor else "no device to borrow from"
    ties: dict[int, tuple[int, float]] = {}
    fixed: dict[int, float] = {}
    notes: dict[str, str] = {}
    if not any(_f16_heavy(r) for r in rows):
        ties[P_F16] = (P_Q, prior.ratio(pc, P_F16, P_Q, 1.0))
        notes["tflops_f16"] = _tied_note(prior, "no F16 rows", "tflops")
    if not any(r.depth + r.n >= 4096 for r in rows):
        ties[P_ATTN] = (P_Q, prior.ratio(pc, P_ATTN, P_Q, 1.0))
        notes["attn_tflops"] = _tied_note(prior, "no long-context rows", "tflops")
    if not any(row_model(r).is_moe for r in rows):
        ties[P_MOE] = (P_Q, prior.ratio(pc, P_MOE, P_Q, 1.0))
        ties[P_MOE_UB] = (P_UB, prior.ratio(pc, P_MOE_UB, P_UB, 0.0))
        notes["moe_tflops"] = _tied_note(prior, "no MoE rows", "tflops")
        notes["moe_ubatch_layer_us"] = _tied_note(prior, "no MoE rows", "ubatch_layer_us", 0)
    n = _distinct(rows)
    order = [P_MOE_UB, P_ATTN, P_F16, P_MOE]
    while 6 - len(ties) - len(fixed) > n and order:
        i = order.pop(0)
        if i not in ties:
            partner = P_UB if i == P_MOE_UB else P_Q
            ties[i] = (partner, prior.ratio(pc, i, partner, 0.0 if i == P_MOE_UB else 1.0))
            notes[PREFILL_FIELDS[i]] = f"assumed (too few rows): the ratio in {src}"
    if 6 - len(ties) - len(fixed) > n:
        _pin(fixed, ties, pc, P_UB, P_MOE_UB)
        notes["ubatch_layer_us"] = f"assumed (too few rows): {src}"
    if (
        not full_rank(_samples(rows), 6, ties, fixed)
        and P_MOE_UB not in ties
        and P_MOE_UB not in fixed
    ):
        # Every MoE prompt a whole number of micro-batches: the MoE per-micro-batch cost
        # and MoE throughput are collinear. Tie the former to the dense one (anchor ratio).
        ties[P_MOE_UB] = (P_UB, prior.ratio(pc, P_MOE_UB, P_UB, 0.0))
        notes["moe_ubatch_layer_us"] = f"assumed (rows do not separate it): the ratio in {src}"
    if len({r.model for r in rows}) < 2 and P_UB not in fixed:
        # One model: every row's micro-batch count and FLOPs grow together with the
        # prompt (only its attention differs, and that has its own rate), so the rows
        # cannot tell a per-micro-batch cost from a FLOPS rate.
        _pin(fixed, ties, pc, P_UB, P_MOE_UB)
        notes["ubatch_layer_us"] = f"assumed (one model: rows do not separate it from FLOPS): {src}"
    if not full_rank(_samples(rows), 6, ties, fixed) and P_UB not in fixed:
        _pin(fixed, ties, pc, P_UB, P_MOE_UB)
        notes["ubatch_layer_us"] = f"assumed (rows do not separate it from FLOPS): {src}"
    c = _solve_pinned(
        rows,
        6,
        ties,
        fixed,
        (P_Q, P_F16, P_MOE, P_ATTN),
        pc,
        PREFILL_FIELDS,
        notes,
        src,
        mins or {},
    )
    return c, notes


def _scaled(coefs: list[float], byte_idx: tuple[int, ...], k: float) -> list[float]:
    return [c / k if i in byte_idx else c for i, c in enumerate(coefs)]


def fit_device(
    key: str,
    specs: dict[str, dict[str, Any]],
    rows: list[Row],
    anchors: dict[str, tuple[str, DeviceFit]],
) -> DeviceFit:
    """One device's terms from its rows, borrowing from its family anchor where needed."""
    spec = specs[key]
    fam = spec["family"]
    dec_rows = [r for r in rows if r.kind == "decode"]
    pre_rows = [r for r in rows if r.kind == "prefill"]
    anchor = anchors.get(fam)
    if anchor and anchor[0] != key:
        akey, afit = anchor
        aspec = specs[akey]
        kb = spec["mem_bandwidth_gbs"] / aspec["mem_bandwidth_gbs"]
        kf = spec["fp16_tflops"] / aspec["fp16_tflops"]
        prior = Prior(
            _scaled(afit.decode, (D_Q, D_F16, D_KV), kb),
            _scaled(afit.prefill, (P_Q, P_F16, P_MOE, P_ATTN), kf),
            akey,
        )
        scaled_note = (
            f"assumed: {akey}'s fitted terms, bandwidth x {kb:.3g} and FLOPS x {kf:.3g} "
            "(spec ratios)"
        )
    else:
        d, p = prior_terms(spec)
        prior = Prior(decode_coefs(d), prefill_coefs(p), None)
        scaled_note = "assumed: spec x prior efficiency (devices.toml), no per-block cost"
    notes: dict[str, str] = {}
    dmin, pmin = bounds(spec)
    rates = family_rates(fam)
    if dec_rows:
        cols = TypeColumns({t: r.factor for t, r in rates.items()}, fittable(dec_rows))
        dc, dn = fit_decode(dec_rows, prior, dmin, cols)
        fitted = cols.fitted if len(dc) > 5 else ()
        rates = fitted_rates(rates, TypeColumns(cols.factors, fitted), dc, D_Q, dn, len(dec_rows))
        notes |= {k: v for k, v in dn.items() if not k.startswith("rate_")}
        dc = dc[:5]
    else:
        notes["decode"] = scaled_note
        dc = _on_bound(prior.decode, dmin, DECODE_FIELDS, notes, _held(prior.decode))
        fitted = ()
    if tied_note(rates, fitted):
        notes["weight_types"] = tied_note(rates, fitted)
    if pre_rows:
        pc, pn = fit_prefill(pre_rows, prior, pmin)
        notes |= pn
    else:
        notes["prefill"] = scaled_note
        pc = _on_bound(prior.prefill, pmin, PREFILL_FIELDS, notes, _held(prior.prefill))
    return DeviceFit(dc, pc, notes, len(dec_rows), len(pre_rows), rates)


def catalog_group(rows: list[Row], device: str) -> str:
    """The build group a device's catalog terms come from: its current-build rows
    (no `fit_group`), else, where it has only older-build rows, the newest of those."""
    groups = {r.group for r in rows if r.device == device and not r.exclude}
    return "" if "" in groups or not groups else max(groups)


def fit_units(
    rows: list[Row],
    spec: dict[str, dict[str, Any]] | None = None,
    also: tuple[str, str] | None = None,
) -> dict[tuple[str, str], DeviceFit]:
    """Every (device, build group) with rows fitted on its own: the catalog's (from
    fit_all) plus each older-build group, which borrows from the same family anchors
    (`also`: a unit to include even with no rows: then it is the family assumption)."""
    spec = spec or load_spec()
    fits, anchors = _fit_catalog(rows, spec)
    used = [r for r in rows if not r.exclude and r.device in spec]
    out = {(k, catalog_group(rows, k)): f for k, f in fits.items()}
    for key, group in sorted({(r.device, r.group) for r in used} | ({also} if also else set())):
        if (key, group) not in out:
            unit = [r for r in used if r.device == key and r.group == group]
            out[(key, group)] = fit_device(key, spec, unit, anchors)
    return out


def fit_all(rows: list[Row], spec: dict[str, dict[str, Any]] | None = None) -> dict[str, DeviceFit]:
    """The catalog: one fit per device, from the rows of its catalog_group."""
    return _fit_catalog(rows, spec or load_spec())[0]


def _fit_catalog(
    rows: list[Row], spec: dict[str, dict[str, Any]]
) -> tuple[dict[str, DeviceFit], dict[str, tuple[str, DeviceFit]]]:
    used = [r for r in rows if not r.exclude and r.device in spec]
    unknown = sorted({r.device for r in rows if not r.exclude} - set(spec))
    if unknown:
        raise InputError(f"benchmark rows name devices not in the catalog: {', '.join(unknown)}")
    by_dev = {
        k: [r for r in used if r.device == k and r.group == catalog_group(used, k)] for k in spec
    }
    anchors: dict[str, tuple[str, DeviceFit]] = {}
    for fam in sorted({d["family"] for d in spec.values()}):
        members = [k for k in spec if spec[k]["family"] == fam and by_dev[k]]
        if members:
            top = max(members, key=lambda k: (len(by_dev[k]), k))
            anchors[fam] = (top, fit_device(top, spec, by_dev[top], {}))
    out = {}
    for k in spec:
        a = anchors.get(spec[k]["family"])
        out[k] = a[1] if a and a[0] == k else fit_device(k, spec, by_dev[k], anchors)
    return out, anchors


def predict_us(fit: DeviceFit, row: Row) -> float:
    if row.kind == "decode":
        return dot(fit.decode, row_features(row, fit.factors))
    return dot(fit.prefill, row_features(row))


def loo_fit(rows: list[Row], row: Row, spec: dict[str, dict[str, Any]]) -> DeviceFit:
    """The row's unit (device, build group) refitted without the row (its family
    anchor refitted likewise; other families cannot reach it)."""
    fam = spec[row.device]["family"]
    sub = {k: v for k, v in spec.items() if v["family"] == fam}
    rest = [r for r in rows if r.index != row.index and r.device in sub]
    return fit_units(rest, sub, (row.device, row.group))[(row.device, row.group)]
