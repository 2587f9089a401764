"""The device catalog (linkctl/data/devices.toml) and this host's calibrations.

The catalog is two files: data/devices.toml (vendor specs and prior efficiencies,
hand-written, every number sourced) and data/devices_fit.toml (the decode and
prefill terms of each device, written by scripts/fit_devices.py from the public
llama-bench rows in data/published_bench.toml; terms a device has no rows for are
marked assumed there).

A calibration (written by `linkctl calibrate`) holds the terms measured on one
profile host: the fixed per-block decode cost and the effective bandwidth (solved
from two models of different depth and width), optionally the prefill compute and
the RPC figures. It overrides the catalog's terms for that host. Calibrations
live in state_dir()/calibration.json as {"hosts": {name: {...}}}, stored and read by
linkctl.core.records (CalibrationFile / CalibrationRecord).
"""

from __future__ import annotations

import os
import tomllib
from dataclasses import dataclass, field, replace
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any

from linkctl.core.errors import InputError
from linkctl.estimate.kernel_rates import TypeRate, family_rates
from linkctl.estimate.ranges import KINDS, NONE, ErrorRange

if TYPE_CHECKING:
    from linkctl.core.records import CalibrationRecord

_FIELDS = (
    "memory_gb",
    "mem_bandwidth_gbs",
    "fp16_tflops",
    "usable_fraction",
    "efficiency",
    "compute_efficiency",
)
FAMILIES = ("apple", "nvidia", "cpu")

# A fit note's first words say what the fit did with the term (devicefit writes them,
# devices_fit.toml stores them): the one place that reads them back.
ASSUMED = "assumed"
ON_BOUND = "on its physical bound"


def fit_kind(fit_note: str) -> str:
    """ "assumed", "on bound" or "fitted": what a term's note in devices_fit.toml says."""
    if fit_note.startswith(ASSUMED):
        return "assumed"
    return "on bound" if fit_note.startswith(ON_BOUND) else "fitted"


@dataclass(frozen=True)
class DecodeTerms:
    """Time of one generated token on one device, per block it holds (docs/estimate-model.md):
    layer_us x blocks + moe_layer_us x MoE blocks + quantized weight bytes / bw_gbs
    + F16/BF16/F32 weight bytes / bw_f16_gbs + KV-cache bytes read / kv_bw_gbs."""

    layer_us: float  # fixed cost per block per token: kernel launches, graph, sync
    moe_layer_us: float  # extra fixed cost per MoE block: routing, top-k, expert dispatch
    bw_gbs: float  # effective bandwidth on quantized weights
    bw_f16_gbs: float  # effective bandwidth on F16/BF16/F32 weights
    kv_bw_gbs: float  # effective bandwidth reading the KV cache (attention at depth)


@dataclass(frozen=True)
class PrefillTerms:
    """Time of one prompt micro-batch: ubatch_layer_us x blocks + moe_ubatch_layer_us x MoE
    blocks + dense FLOPs / tflops (quantized) or / tflops_f16 + routed-expert FLOPs /
    moe_tflops + attention FLOPs / attn_tflops."""

    ubatch_layer_us: float
    moe_ubatch_layer_us: float
    tflops: float
    tflops_f16: float
    moe_tflops: float
    attn_tflops: float


DECODE_FIELDS = tuple(DecodeTerms.__dataclass_fields__)
PREFILL_FIELDS = tuple(PrefillTerms.__dataclass_fields__)


@dataclass(frozen=True)
class Device:
    key: str
    name: str
    kind: str  # "gpu" or "cpu"
    family: str  # "apple", "nvidia", "cpu": where an unfitted term borrows its prior
    memory_gb: float
    mem_bandwidth_gbs: float
    fp16_tflops: float
    usable_fraction: float
    efficiency: float  # prior only: decode bandwidth / spec where no public rows exist
    compute_efficiency: float  # prior only: prefill FLOPS / spec likewise
    decode: DecodeTerms
    prefill: PrefillTerms
    sources: dict[str, str] = field(default_factory=dict)
    fit: dict[str, str] = field(default_factory=dict)  # term -> "fitted ..." / "assumed ..."
    # How far the fit's figures were from rows it did not see (linkctl.estimate.ranges),
    # by kind ("decode", "prefill").
    ranges: dict[str, ErrorRange] = field(default_factory=dict)
    build: str = ""  # the llama.cpp build(s) the fitted rows ran, as their sources name them
    build_numbers: tuple[int, ...] = ()
    # Each quantized ggml type's read rate relative to Q8_0 (bw_gbs is the Q8_0 rate):
    # fitted to the device's rows or tied to its family's kernel-rate prior.
    weight_rates: dict[str, TypeRate] = field(default_factory=dict)
    # Measured by `linkctl calibrate` (None: catalog figures are used).
    calibration: CalibrationRecord | None = None

    @property
    def factors(self) -> dict[str, float]:
        return {t: r.factor for t, r in self.weight_rates.items()}

    @property
    def calibrated(self) -> bool:
        return bool(self.calibration)

    @property
    def on_bound(self) -> list[str]:
        """The terms the fit holds at the device's physical bound (devicefit.bounds); a
        calibrated host's measured terms are its own."""
        if self.calibration:
            return []
        return sorted(k for k, v in self.fit.items() if fit_kind(v) == "on bound")

    def error_range(self, kind: str) -> ErrorRange:
        return self.ranges.get(kind, NONE)

    @property
    def figures_source(self) -> str:
        if self.calibration:
            c = self.calibration
            return f"calibrated {c.measured_at or ''} on {c.model_name or 'a model'}".strip()
        return self.fit.get("summary", "catalog")


def prior_terms(
    d: dict[str, Any],
) -> tuple[DecodeTerms, PrefillTerms]:
    """Terms from the spec x prior efficiencies alone (no fitted rows, no per-block cost)."""
    bw = float(d["mem_bandwidth_gbs"]) * float(d["efficiency"])
    tf = float(d["fp16_tflops"]) * float(d["compute_efficiency"])
    return DecodeTerms(0.0, 0.0, bw, bw, bw), PrefillTerms(0.0, 0.0, tf, tf, tf, tf)


def catalog_path() -> Path:
    env = os.environ.get("LINKCTL_DEVICES")
    if env:
        return Path(env)
    return Path(str(resources.files("linkctl") / "data" / "devices.toml"))


def fit_path() -> Path:
    """The fitted device terms, written by scripts/fit_devices.py."""
    env = os.environ.get("LINKCTL_DEVICE_FIT")
    if env:
        return Path(env)
    return Path(str(resources.files("linkctl") / "data" / "devices_fit.toml"))


def _toml(path: Path, what: str) -> dict[str, Any]:
    try:
        return tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise InputError(f"{what} {path} is missing", "reinstall linkctl") from None
    except tomllib.TOMLDecodeError as e:
        raise InputError(f"{what} {path}: not valid TOML: {e}") from None


def load_spec(path: Path | None = None) -> dict[str, dict[str, Any]]:
    """The hand-written part of the catalog (vendor specs, priors), validated."""
    path = path or catalog_path()
    data = _toml(path, "device catalog")
    for key, d in data.items():
        missing = [f for f in (*_FIELDS, "name", "kind") if f not in d]
        if missing:
            raise InputError(
                f"device catalog {path}: [{key}] lacks {', '.join(missing)}", "add them"
            )
        unsourced = [f for f in _FIELDS if f"{f}_source" not in d]
        if unsourced:
            raise InputError(
                f"device catalog {path}: [{key}] has no source for {', '.join(unsourced)}",
                "note where each number comes from in <field>_source",
            )
        for f in _FIELDS:
            if not isinstance(d[f], int | float) or d[f] <= 0:
                raise InputError(f"device catalog {path}: [{key}].{f} = {d[f]!r} must be > 0")
        for b in ("bound_bandwidth_gbs", "bound_tflops"):
            if b in d and (
                not isinstance(d[b], int | float) or d[b] <= 0 or f"{b}_source" not in d
            ):
                raise InputError(
                    f"device catalog {path}: [{key}].{b} = {d[b]!r}",
                    f"give a measured figure > 0 and where it was measured in {b}_source",
                )
        if d["kind"] not in ("gpu", "cpu"):
            raise InputError(f"device catalog {path}: [{key}].kind = {d['kind']!r}: gpu or cpu")
        if d.get("family") not in FAMILIES:
            raise InputError(
                f"device catalog {path}: [{key}].family = {d.get('family')!r}",
                f"use one of: {', '.join(FAMILIES)}",
            )
    return data


def load_catalog(path: Path | None = None, fit: Path | None = None) -> dict[str, Device]:
    spec = load_spec(path)
    fpath = fit or fit_path()
    fitted = _toml(fpath, "fitted device terms") if fpath.is_file() or fit else {}
    out = {}
    for key, d in spec.items():
        dec, pre = prior_terms(d)
        f = fitted.get(key) or {}
        notes = {"summary": "catalog spec x prior efficiency (no fitted terms)"}
        ranges: dict[str, ErrorRange] = {}
        build, numbers = "", tuple[int, ...]()
        rates = family_rates(d["family"])
        if f:
            try:
                dec = DecodeTerms(**{k: float(f["decode"][k]) for k in DECODE_FIELDS})
                pre = PrefillTerms(**{k: float(f["prefill"][k]) for k in PREFILL_FIELDS})
            except (KeyError, TypeError, ValueError) as e:
                raise InputError(
                    f"fitted device terms {fpath}: [{key}] is incomplete ({e})",
                    "re-run scripts/fit_devices.py",
                ) from None
            notes = {str(k): str(v) for k, v in (f.get("notes") or {}).items()}
            notes["summary"] = str(f.get("summary", "fitted"))
            ranges = _ranges(f.get("range") or {}, fpath, key)
            build = str(f.get("build", ""))
            numbers = tuple(int(n) for n in f.get("build_numbers", []))
            rates |= _weight_rates(f.get("weight_types") or {}, fpath, key)
        figures: dict[str, Any] = {x: float(d[x]) for x in _FIELDS}
        out[key] = Device(
            key=key,
            name=d["name"],
            kind=d["kind"],
            family=d["family"],
            **figures,
            decode=dec,
            prefill=pre,
            sources={x: d[f"{x}_source"] for x in _FIELDS},
            fit=notes,
            ranges=ranges,
            build=build,
            build_numbers=numbers,
            weight_rates=rates,
        )
    return out


def _weight_rates(table: dict[str, Any], fpath: Path, key: str) -> dict[str, TypeRate]:
    out = {}
    for t, r in table.items():
        try:
            out[str(t)] = TypeRate(float(r["factor"]), str(r["how"]), str(r["source"]))
        except (KeyError, TypeError, ValueError) as e:
            raise InputError(
                f"fitted device terms {fpath}: [{key}.weight_types].{t} is incomplete ({e})",
                "re-run scripts/fit_devices.py",
            ) from None
        if not out[str(t)].factor > 0:
            raise InputError(
                f"fitted device terms {fpath}: [{key}.weight_types].{t} factor must be > 0",
                "re-run scripts/fit_devices.py",
            )
    return out


def _ranges(table: dict[str, Any], fpath: Path, key: str) -> dict[str, ErrorRange]:
    out = {}
    for kind in KINDS:
        r = table.get(kind)
        if r is None:
            continue
        try:
            out[kind] = ErrorRange(float(r["err"]), int(r["n"]), str(r["pool"]))
        except (KeyError, TypeError, ValueError) as e:
            raise InputError(
                f"fitted device terms {fpath}: [{key}.range].{kind} is incomplete ({e})",
                "re-run scripts/fit_devices.py",
            ) from None
    return out


def get_device(catalog: dict[str, Device], key: str | None, where: str) -> Device:
    if key is None:
        raise InputError(
            f"{where}.device is not set",
            f"add device = one of: {', '.join(sorted(catalog))} to the profile",
        )
    if key not in catalog:
        raise InputError(
            f"{where}.device = {key!r} is not in the device catalog",
            f"use one of: {', '.join(sorted(catalog))}",
        )
    return catalog[key]


# -- calibrations ----------------------------------------------------------------


def apply_calibration(dev: Device, record: CalibrationRecord | None) -> Device:
    """This host's measured terms replace the catalog's: the per-block cost and the
    bandwidth (both weight classes: calibrate measures on F32 weights), the read rate of
    each quantized type a given model held (its factor of that bandwidth), and the
    prefill compute when measured. Terms calibrate does not measure (MoE, KV, types no
    given model held) keep the catalog's ratio to the bandwidth."""
    if record is None or not record.effective_bandwidth_gbs:
        return dev
    bw = float(record.effective_bandwidth_gbs)
    d = dev.decode
    scale = bw / d.bw_gbs if d.bw_gbs else 1.0
    dec = replace(
        d,
        layer_us=float(record.layer_us or 0.0),
        bw_gbs=bw,
        bw_f16_gbs=bw,
        kv_bw_gbs=d.kv_bw_gbs * scale,
    )
    pre = dev.prefill
    tf = record.effective_tflops
    if tf:
        k = float(tf) / pre.tflops if pre.tflops else 1.0
        pre = replace(
            pre,
            tflops=float(tf),
            tflops_f16=float(tf),
            moe_tflops=pre.moe_tflops * k,
            attn_tflops=pre.attn_tflops * k,
        )
    rates = dict(dev.weight_rates)
    for t, r in (record.weight_rates or {}).items():
        with_ = f", read together with {', '.join(r.together)}" if len(r.together) > 1 else ""
        rates[t] = TypeRate(
            r.factor,
            "calibrated",
            f"measured by linkctl calibrate on {r.model} ({record.measured_at}): "
            f"{r.gbs:.1f} GB/s{with_}",
        )
    return replace(dev, decode=dec, prefill=pre, calibration=record, weight_rates=rates)


def rpc_role(dev: Device, record: CalibrationRecord | None) -> Device | None:
    """The device as the rpc end of a split, from `linkctl calibrate --rpc`: its per-token
    time behind a loopback RPC boundary folds the per-block and RPC processing costs into
    one measured bandwidth (rpc_effective_bandwidth_gbs), so that figure stands alone."""
    if record is None or not record.rpc_effective_bandwidth_gbs:
        return None
    bw = float(record.rpc_effective_bandwidth_gbs)
    dec = replace(
        dev.decode, layer_us=0.0, moe_layer_us=0.0, bw_gbs=bw, bw_f16_gbs=bw, kv_bw_gbs=bw
    )
    return replace(dev, decode=dec, calibration=record)
