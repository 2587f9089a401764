"""How far a catalog figure may be from what the device delivers: an interval for each
predicted tok/s, from the fit's own leave-one-out residuals.

A row's residual is e = predicted / published - 1 when its device (and build group) is
refitted without it (linkctl.estimate.holdout.leave_one_out): the error the catalog
makes on a figure it has not seen. A prediction P then reads "published = P / (1 + e)"
for |e| up to the split-conformal COVERAGE quantile of |e| over a pool of residuals
(the ceil((n + 1) x COVERAGE)-th smallest of n: four unseen figures in five inside,
were they drawn like the pool's):

  - a figure from fitted terms: the widest of the device's pool (its residuals of that
    kind, decode or prefill), its family's (apple, nvidia) and the new tables' pool,
    each where it holds MIN_POOL residuals; none: every device's. One device's
    residuals come from one or two published tables, whose rows agree with each other
    more than a new table agrees with them: the new tables' pool holds the residuals of
    rows predicted with their whole source left out (linkctl.estimate.holdout
    .leave_one_source_out), where the device kept rows from other sources;
  - a figure from assumed terms (a device with fewer than LOO_MIN_LEFT rows of the kind:
    the family's terms scaled by spec): the residuals of rows whose refit was such an
    assumption.

Pools by weight type as well were tried and covered less (68% of decode rows): a
type's rows on a device are mostly one table's. scripts/fit_devices.py writes each
device's ranges into devices_fit.toml ([key.range]); bench/published_accuracy.py
reports how often an interval built without the row covers the published figure.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

KINDS = ("decode", "prefill")
COVERAGE = 0.8
MIN_POOL = 8  # residuals a pool needs before its quantile means anything
LOO_MIN_LEFT = 2  # rows of the kind a refit must keep for its residual to be a fit's
MAX_ERR = 0.95  # a wider |e| would put the high end at infinity


@dataclass(frozen=True)
class Residual:
    device: str
    kind: str
    err: float  # predicted / published - 1, by a fit that did not see the row
    fitted: bool  # the refit kept LOO_MIN_LEFT rows of the kind (else: assumed terms)
    new_table: bool = False  # predicted with the row's whole source left out
    source: str = ""
    row: int = -1  # the row's index in the benchmark data


@dataclass(frozen=True)
class ErrorRange:
    """The |predicted / published - 1| a figure is widened by, and where it came from."""

    err: float
    n: int  # residuals in the pool
    pool: str  # e.g. "m2-ultra decode (fitted)"

    def tok_s(self, predicted: float) -> tuple[float, float]:
        """(low, high) around a predicted rate."""
        return predicted / (1 + self.err), predicted / (1 - self.err)

    def time(self, predicted: float) -> tuple[float, float]:
        """(short, long) around a predicted time."""
        return predicted * (1 - self.err), predicted * (1 + self.err)

    def as_dict(self) -> dict[str, Any]:
        return {"err": self.err, "n": self.n, "pool": self.pool}


NONE = ErrorRange(0.0, 0, "no residuals")


def conformal(xs: list[float]) -> float:
    """The split-conformal COVERAGE quantile of |x|."""
    a = sorted(abs(x) for x in xs)
    k = min(len(a), math.ceil((len(a) + 1) * COVERAGE)) - 1
    return min(a[k], MAX_ERR)


def error_range(
    residuals: list[Residual], families: dict[str, str], device: str, kind: str, fitted: bool
) -> ErrorRange:
    """The interval for a ``kind`` figure of ``device`` (the pools of the module
    docstring; ``families``: device -> family)."""
    mine = [r for r in residuals if r.kind == kind and r.fitted == fitted and not r.new_table]
    if not fitted:
        xs = [r.err for r in mine]
        return ErrorRange(conformal(xs), len(xs), f"{kind} (assumed terms)") if xs else NONE
    fam = families.get(device, "")
    pools = [
        (f"{device} {kind}", [r.err for r in mine if r.device == device]),
        (f"{fam} {kind}", [r.err for r in mine if families.get(r.device) == fam]),
        (
            f"new tables' {kind}",
            [r.err for r in residuals if r.kind == kind and r.fitted and r.new_table],
        ),
    ]
    held = [ErrorRange(conformal(xs), len(xs), p) for p, xs in pools if len(xs) >= MIN_POOL]
    if held:
        return max(held, key=lambda g: g.err)
    xs = [r.err for r in mine]
    return ErrorRange(conformal(xs), len(xs), f"every device's {kind}") if xs else NONE


def widened(devices: list[tuple[float, ErrorRange]], fixed_us: float, work: float):
    """(rate, low, high) = work / time: each device's µs widened by its range, the rest
    (``fixed_us``: the link) as predicted."""

    def rate(k: float) -> float:
        t = sum(us * (1 + k * g.err) for us, g in devices) + fixed_us
        return work / t if t > 0 else 0.0

    return rate(0), rate(1), rate(-1)
