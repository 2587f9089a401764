"""The weight types a device's decode is priced with: for each ggml type it reads, the
bytes per token, the read-rate factor relative to Q8_0 (linkctl.estimate.kernel_rates),
whether the factor is fitted to the device's rows or tied to a prior, and the time it
costs. `estimate --json` carries it per device (DeviceLoad.weight_types)."""

from __future__ import annotations

from typing import Any

from linkctl.estimate.catalog import Device
from linkctl.estimate.features import weight_type_bytes
from linkctl.estimate.kernel_rates import REFERENCE, TypeRate
from linkctl.gguf.info import UNQUANTIZED_TYPES, ModelInfo
from linkctl.gguf.reader import type_name

NO_PRIOR = TypeRate(
    1.0, "none", f"no kernel-rate prior for this type: priced at the {REFERENCE} rate"
)


def type_rate(dev: Device, type_id: int) -> TypeRate:
    """The read rate a device prices a ggml type at, relative to Q8_0 (its bw_gbs).
    F16/BF16/F32 weights are read at the device's bw_f16_gbs: their factor is that over
    bw_gbs, as the fit left it (fitted, or tied to bw_gbs: devices_fit.toml notes)."""
    d = dev.decode
    if type_id in UNQUANTIZED_TYPES:
        note = dev.fit.get("bw_f16_gbs") or "fitted to the device's F16 rows"
        if dev.calibration:
            note = "calibrated on this host (its bandwidth, measured on F32 models)"
        return TypeRate(d.bw_f16_gbs / d.bw_gbs if d.bw_gbs else 1.0, "f16 term", note)
    name = type_name(type_id)
    measured = dev.weight_rates.get(name)
    if measured and measured.how == "calibrated":  # beats the reference and the priors
        return measured
    if name == REFERENCE:
        return TypeRate(1.0, "reference", f"{REFERENCE} is read at bw_gbs")
    return dev.weight_rates.get(name, NO_PRIOR)


def priced(
    model: ModelInfo, layers: list[int], holds_output: bool, dev: Device
) -> list[dict[str, Any]]:
    """Per ggml type the device reads for one token: bytes, factor, where it comes from,
    and µs per token (bytes / (factor x bw_gbs)), largest first."""
    out = []
    for t, b in weight_type_bytes(model, layers, holds_output).items():
        r = type_rate(dev, t)
        gbs = dev.decode.bw_gbs * r.factor
        out.append(
            {
                "type": type_name(t),
                "bytes_per_token": int(b),
                **r.as_dict(),
                "read_gbs": round(gbs, 1),
                "us_per_token": round(b / (gbs * 1e3), 2) if gbs > 0 else 0.0,
            }
        )
    return sorted(out, key=lambda x: -x["bytes_per_token"])


def summary(types: list[dict[str, Any]]) -> str:
    """One short line: the types read, each with its factor and how it was set."""
    parts = [
        f"{x['type']} {x['bytes_per_token'] / 1e9:.2f} GB x{x['factor']:.2f} ({x['how']})"
        for x in types
        if x["bytes_per_token"] >= 0.01 * sum(y["bytes_per_token"] for y in types)
    ]
    return "weight types priced: " + ", ".join(parts)
