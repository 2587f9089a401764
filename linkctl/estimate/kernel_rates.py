"""Per-ggml-type weight read rates of llama.cpp's one-token mat-vec kernels, per backend
family: the priors (data/kernel_rates.toml, each figure with its source) that price a
type's weight bytes where a device's published rows do not pin its rate.

A type's factor is the share of the reference type's (Q8_0) read rate its mat-vec kernels
reach: decode reads ``bytes_t / factor_t`` reference-equivalent bytes of type t
(linkctl.estimate.features.decode_features). Factors come from tables of one model in
several quantizations on one device and build: (tok/s x bytes read per token) of a type
over the same of the reference type.
"""

from __future__ import annotations

import os
import tomllib
from dataclasses import dataclass
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Any

from linkctl.core.errors import InputError

REFERENCE = "Q8_0"


@dataclass(frozen=True)
class TypeRate:
    """A type's read rate relative to the reference type, and where it comes from:
    ``how`` is "prior", "assumed" (no figure: a stated rule), "fitted" (the device's
    rows), "fitted, on its bound" (held at the device's physical read bound),
    "calibrated" (measured on this host by `linkctl calibrate --model`) or "none" (no
    prior: the reference rate); ``source`` says which."""

    factor: float
    how: str
    source: str

    def as_dict(self) -> dict[str, Any]:
        return {"factor": round(self.factor, 4), "how": self.how, "source": self.source}


def rates_path() -> Path:
    env = os.environ.get("LINKCTL_KERNEL_RATES")
    if env:
        return Path(env)
    return Path(str(resources.files("linkctl") / "data" / "kernel_rates.toml"))


def _bad(path: Path, where: str, what: str) -> InputError:
    return InputError(
        f"kernel rates {path}: {where}: {what}",
        "fix the file (each table: id, url, rows of type + tok_s > 0 + size_gib or "
        "bytes_per_weight > 0)",
    )


def _num(v: Any) -> float | None:
    return float(v) if isinstance(v, int | float) and not isinstance(v, bool) and v > 0 else None


def _table_rates(path: Path, where: str, t: dict[str, Any]) -> dict[str, float]:
    """{type: tok/s x bytes per token (any unit shared by the table)} of one table."""
    for key in ("id", "url", "rows"):
        if not t.get(key):
            raise _bad(path, where, f"lacks {key}")
    out: dict[str, float] = {}
    for i, r in enumerate(t["rows"]):
        w = f"{where} row {i + 1}"
        if not isinstance(r, dict) or not isinstance(r.get("type"), str):
            raise _bad(path, w, "no type")
        tok_s = _num(r.get("tok_s"))
        size = _num(r.get("size_gib")) or _num(r.get("bytes_per_weight"))
        if tok_s is None or size is None:
            raise _bad(path, w, f"{r['type']}: tok_s and size_gib or bytes_per_weight > 0")
        out[r["type"]] = tok_s * size
    return out


def parse_rates(data: dict[str, Any], path: Path) -> dict[str, dict[str, TypeRate]]:
    """{family: {type: TypeRate}} from the file's tables (checked)."""
    out: dict[str, dict[str, TypeRate]] = {}
    for fam, d in data.items():
        if not isinstance(d, dict) or not d.get("table"):
            raise _bad(path, f"[{fam}]", "no [[table]]")
        ref = str(d.get("reference", REFERENCE))
        rates = {
            str(t.get("id")): _table_rates(path, f"[{fam}] table {i + 1}", t)
            for i, t in enumerate(d["table"])
        }
        fam_out: dict[str, TypeRate] = {ref: TypeRate(1.0, "reference", f"{ref} is the reference")}
        for t in d["table"]:
            own = rates[str(t["id"])]
            base = own if ref in own else rates.get(str(t.get("reference_from", "")), {})
            if ref not in base:
                raise _bad(path, f"[{fam}] {t['id']}", f"no {ref} row and no reference_from table")
            for typ, r in own.items():
                if typ != ref:
                    src = f"{t['id']} ({t['url']})"
                    fam_out[typ] = TypeRate(r / base[ref], "prior", src)
        for a in d.get("assumed", []):
            parts = [fam_out.get(str(x)) for x in a.get("mean_of", [])]
            if not parts or any(p is None for p in parts) or not a.get("why"):
                raise _bad(path, f"[{fam}] assumed {a.get('type')}", "mean_of needs priors and why")
            f = sum(p.factor for p in parts if p) / len(parts)
            fam_out[str(a["type"])] = TypeRate(f, "assumed", str(a["why"]))
        out[str(fam)] = fam_out
    return out


@cache
def _load(path: str) -> dict[str, dict[str, TypeRate]]:
    p = Path(path)
    try:
        data = tomllib.loads(p.read_text())
    except FileNotFoundError:
        raise InputError(f"kernel rates {p} is missing", "reinstall linkctl") from None
    except tomllib.TOMLDecodeError as e:
        raise InputError(f"kernel rates {p}: not valid TOML: {e}") from None
    return parse_rates(data, p)


def load_rates(path: Path | None = None) -> dict[str, dict[str, TypeRate]]:
    return _load(str(path or rates_path()))


def family_rates(family: str) -> dict[str, TypeRate]:
    """The priors of a backend family ({} for a family without kernel tables: cpu)."""
    return dict(load_rates().get(family, {}))
