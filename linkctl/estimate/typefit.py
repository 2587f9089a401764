"""Which ggml weight types a device's decode rows pin (their read rate fitted), and the
extra feature columns the fit solves for them (linkctl.estimate.devicefit.fit_decode).

A type's read rate is priced relative to Q8_0 (linkctl.estimate.kernel_rates): decode
reads ``bytes_t / factor_t`` Q8_0-equivalent bytes. A type the rows pin gets a column of
its own (its bytes, out of the quantized feature), whose coefficient is fitted; the
factor is then the quantized coefficient over it. A type is pinned only where the rows
hold it in at least two models (one model's rows cannot tell its rate from the per-block
cost) beside at least two rows without it; every other type stays at its prior
("tied"), which devices_fit.toml says.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from linkctl.estimate.catalog import fit_kind
from linkctl.estimate.features import quant_type_bytes
from linkctl.estimate.kernel_rates import REFERENCE, TypeRate
from linkctl.estimate.published import Row, row_model

SHARE_MIN = 0.2  # a row "holds" a type when it is this share of its quantized bytes


def row_type_bytes(row: Row) -> dict[str, float]:
    """A decode row's quantized weight bytes per token by ggml type name."""
    m = row_model(row)
    return quant_type_bytes(m, list(range(m.block_count)), True)


def _shares(row: Row) -> dict[str, float]:
    tb = row_type_bytes(row)
    total = sum(tb.values())
    return {t: b / total for t, b in tb.items()} if total else {}


def fittable(rows: list[Row]) -> tuple[str, ...]:
    """The quantized types (not the reference) these decode rows pin."""
    shares = [(r, _shares(r)) for r in rows]
    types = sorted({t for _, s in shares for t in s} - {REFERENCE})
    out = []
    for t in types:
        holding = [r for r, s in shares if s.get(t, 0.0) >= SHARE_MIN]
        others = [r for r, s in shares if s.get(t, 0.0) < SHARE_MIN]
        if len({r.model for r in holding}) >= 2 and len(others) >= 2:
            out.append(t)
    return tuple(out)


@dataclass(frozen=True)
class TypeColumns:
    """The prior factors (name -> factor) and the types fitted as their own columns."""

    factors: dict[str, float] = field(default_factory=dict)
    fitted: tuple[str, ...] = ()

    def base_factors(self) -> dict[str, float]:
        """Factors for the quantized feature: a fitted type's bytes leave it (factor inf)."""
        return {**self.factors, **{t: math.inf for t in self.fitted}}

    def extra(self, row: Row) -> list[float]:
        tb = row_type_bytes(row)
        return [tb.get(t, 0.0) for t in self.fitted]


def fitted_rates(
    prior: dict[str, TypeRate],
    cols: TypeColumns,
    coefs: list[float],
    q_index: int,
    notes: dict[str, str],
    n_rows: int,
) -> dict[str, TypeRate]:
    """The device's rates: the prior's, with each fitted type's from its coefficient
    (the quantized coefficient over the type's); one the fit left tied or on a bound
    says so (its note)."""
    out = dict(prior)
    base = len(coefs) - len(cols.fitted)
    for j, t in enumerate(cols.fitted):
        c = coefs[base + j]
        factor = coefs[q_index] / c if c > 0 else cols.factors.get(t, 1.0)
        note = notes.get(rate_name(t), "")
        how = {"assumed": "assumed", "on bound": "fitted, on its bound"}.get(
            fit_kind(note), "fitted"
        )
        src = note or f"fitted to {n_rows} decode rows (rows of two or more models hold {t})"
        out[t] = TypeRate(factor, how, src)
    return out


def rate_name(t: str) -> str:
    """The note key of a type's read rate in devices_fit.toml."""
    return f"rate_{t}"


def tied_note(rates: dict[str, TypeRate], fitted: tuple[str, ...]) -> str:
    """What the device's types not fitted are tied to (for devices_fit.toml notes)."""
    tied = sorted(t for t, r in rates.items() if t not in fitted and r.how != "reference")
    if not tied:
        return ""
    return (
        f"tied to the kernel-rate priors (data/kernel_rates.toml): {', '.join(tied)}; "
        "the rows do not pin them (a type needs rows of two models beside rows without it)"
    )
