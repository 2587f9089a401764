"""The device catalog (linkctl/data/devices.toml) and this host's calibrations.

A calibration (written by `linkctl calibrate`) is a measured figure for one
profile host: the effective decode bandwidth llama.cpp reached there, and
optionally the effective prefill compute and the fixed per-token cost of one
RPC boundary. It overrides the catalog's spec x efficiency for that host.
Calibrations live in state_dir()/calibration.json as {"hosts": {name: {...}}}.
"""

from __future__ import annotations

import json
import os
import tomllib
from dataclasses import dataclass, field, replace
from importlib import resources
from pathlib import Path
from typing import Any

from linkctl.errors import InputError
from linkctl.paths import state_dir

_FIELDS = (
    "memory_gb",
    "mem_bandwidth_gbs",
    "fp16_tflops",
    "usable_fraction",
    "efficiency",
    "compute_efficiency",
)


@dataclass(frozen=True)
class Device:
    key: str
    name: str
    kind: str  # "gpu" or "cpu"
    memory_gb: float
    mem_bandwidth_gbs: float
    fp16_tflops: float
    usable_fraction: float
    efficiency: float
    compute_efficiency: float
    sources: dict[str, str] = field(default_factory=dict)
    # Measured by `linkctl calibrate` (None: catalog figures are used).
    calibrated_bandwidth_gbs: float | None = None
    calibrated_tflops: float | None = None
    calibration: dict[str, Any] | None = None

    @property
    def effective_bandwidth_gbs(self) -> float:
        if self.calibrated_bandwidth_gbs:
            return self.calibrated_bandwidth_gbs
        return self.mem_bandwidth_gbs * self.efficiency

    @property
    def effective_tflops(self) -> float:
        if self.calibrated_tflops:
            return self.calibrated_tflops
        return self.fp16_tflops * self.compute_efficiency

    @property
    def figures_source(self) -> str:
        if self.calibrated_bandwidth_gbs:
            c = self.calibration or {}
            return (
                f"calibrated {c.get('measured_at', '')} on {c.get('model_name', 'a model')}".strip()
            )
        return "catalog spec x efficiency"


def catalog_path() -> Path:
    env = os.environ.get("LINKCTL_DEVICES")
    if env:
        return Path(env)
    return Path(str(resources.files("linkctl") / "data" / "devices.toml"))


def load_catalog(path: Path | None = None) -> dict[str, Device]:
    path = path or catalog_path()
    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise InputError(f"device catalog {path} is missing", "reinstall linkctl") from None
    except tomllib.TOMLDecodeError as e:
        raise InputError(f"device catalog {path}: not valid TOML: {e}") from None
    out = {}
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
        if d["kind"] not in ("gpu", "cpu"):
            raise InputError(f"device catalog {path}: [{key}].kind = {d['kind']!r}: gpu or cpu")
        out[key] = Device(
            key=key,
            name=d["name"],
            kind=d["kind"],
            **{f: float(d[f]) for f in _FIELDS},
            sources={f: d[f"{f}_source"] for f in _FIELDS},
        )
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


def calibration_path() -> Path:
    return state_dir() / "calibration.json"


def load_calibrations(extra: list[Path] | None = None) -> dict[str, dict[str, Any]]:
    """{host name: calibration record}, from this host's state dir plus any extra
    files (a calibration copied over from the other host)."""
    out: dict[str, dict[str, Any]] = {}
    for p in [calibration_path(), *(extra or [])]:
        if not p.is_file():
            if p in (extra or []):
                raise InputError(f"--calibration {p}: no such file", "give a calibration.json")
            continue
        try:
            data = json.loads(p.read_text())
            hosts = data["hosts"]
            if not isinstance(hosts, dict):
                raise TypeError
        except (json.JSONDecodeError, KeyError, TypeError):
            raise InputError(
                f"{p}: not a linkctl calibration file",
                "re-run `linkctl calibrate` (or delete the file)",
            ) from None
        out.update(hosts)
    return out


def save_calibration(host: str, record: dict[str, Any]) -> Path:
    path = calibration_path()
    data: dict[str, Any] = {"hosts": {}}
    if path.is_file():
        try:
            data = json.loads(path.read_text())
            data.setdefault("hosts", {})
        except json.JSONDecodeError:
            data = {"hosts": {}}
    data["hosts"][host] = record
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    tmp.replace(path)
    return path


def apply_calibration(dev: Device, record: dict[str, Any] | None) -> Device:
    if not record:
        return dev
    bw = record.get("effective_bandwidth_gbs")
    tf = record.get("effective_tflops")
    return replace(
        dev,
        calibrated_bandwidth_gbs=float(bw) if bw else None,
        calibrated_tflops=float(tf) if tf else None,
        calibration=record,
    )
