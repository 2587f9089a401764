"""The device fit judged on rows it did not see: each row left out in turn, and a fixed
share of sources set aside before fitting.

Leave-one-out (loo): the row's unit (device, build group) and its family anchor refitted
without the row, then the row predicted. Source-held-out: whole sources (a published
table: one build, one operator, one setup) set aside, the catalog fitted on the rest,
and their rows predicted; rows from one table share its build and setup, so a row's
neighbours in its own table make leave-one-out easier than a new table is. The held-out
sources are fixed before any fit, by a hash of their ids (HELD_OUT_SHARE of the rows),
not chosen by how well they come out.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any

from linkctl.estimate.devicefit import fit_all, fit_units, loo_fit, predict_us
from linkctl.estimate.published import Row, row_time_us
from linkctl.estimate.ranges import KINDS, LOO_MIN_LEFT, ErrorRange, Residual, error_range

HELD_OUT_SHARE = 0.25  # of the scored rows, taken by whole sources


@dataclass(frozen=True)
class Judged:
    """One row predicted by a fit that did not see it."""

    row: Row
    tok_s: float  # predicted
    left_same_kind: int  # rows of the row's kind its unit kept
    left_total: int
    assumed: list[str] = field(default_factory=list)  # terms that became assumed without it

    @property
    def err(self) -> float:
        return self.tok_s / self.row.tok_s - 1

    @property
    def testable(self) -> bool:
        """Whether the refit is a fit and not the family's assumption."""
        return self.left_same_kind >= LOO_MIN_LEFT

    def residual(self, new_table: bool = False) -> Residual:
        r = self.row
        return Residual(r.device, r.kind, self.err, self.testable, new_table, r.source, r.index)


def _predict(fit: Any, r: Row) -> float:
    return r.tok_s * row_time_us(r) / predict_us(fit, r)


def leave_one_out(rows: list[Row], spec: dict[str, dict[str, Any]]) -> list[Judged]:
    """Every scored row, predicted by its unit refitted without it."""
    units = fit_units(rows, spec)
    out = []
    for r in rows:
        if r.exclude or r.device not in spec:
            continue
        lf = loo_fit(rows, r, spec)
        full = units[(r.device, r.group)].notes
        lost = sorted(k for k, v in lf.notes.items() if v != full.get(k))
        left = lf.n_decode if r.kind == "decode" else lf.n_prefill
        out.append(Judged(r, _predict(lf, r), left, lf.n_decode + lf.n_prefill, lost))
    return out


def held_out_sources(rows: list[Row], share: float = HELD_OUT_SHARE) -> set[str]:
    """Sources in the order of a hash of their ids, taken until ``share`` of the scored
    rows is set aside: fixed by the data alone, whatever the fit makes of them."""
    scored = [r for r in rows if not r.exclude]
    count: dict[str, int] = {}
    for r in scored:
        count[r.source] = count.get(r.source, 0) + 1
    order = sorted(count, key=lambda s: hashlib.sha256(s.encode()).hexdigest())
    out: set[str] = set()
    taken = 0
    for s in order:
        if taken >= share * len(scored):
            break
        out.add(s)
        taken += count[s]
    return out


def source_held_out(
    rows: list[Row], spec: dict[str, dict[str, Any]], held: set[str]
) -> list[Judged]:
    """The rows of the ``held`` sources predicted by a catalog fitted on the others (a
    row whose unit has no rows left is predicted by its family's assumption: not
    testable)."""
    rest = [r for r in rows if r.source not in held]
    fits = fit_units(rest, spec)
    out = []
    for r in rows:
        if r.source not in held or r.exclude or r.device not in spec:
            continue
        unit = (r.device, r.group)
        if unit not in fits:
            fits |= fit_units(rest, spec, unit)
        f = fits[unit]
        left = f.n_decode if r.kind == "decode" else f.n_prefill
        out.append(Judged(r, _predict(f, r), left, f.n_decode + f.n_prefill))
    return out


def leave_one_source_out(rows: list[Row], spec: dict[str, dict[str, Any]]) -> list[Judged]:
    """Every scored row predicted by the catalog fitted without the row's whole source."""
    return [
        j for src in sorted({r.source for r in rows}) for j in source_held_out(rows, spec, {src})
    ]


def residuals(loo: list[Judged], loso: list[Judged]) -> list[Residual]:
    return [j.residual() for j in loo] + [j.residual(new_table=True) for j in loso]


def catalog_ranges(
    rows: list[Row], spec: dict[str, dict[str, Any]], res: list[Residual]
) -> dict[str, dict[str, ErrorRange]]:
    """Each catalog device's interval by kind: from the fitted pools where the catalog
    fitted the device's terms of that kind to LOO_MIN_LEFT rows or more, else from the
    residuals of assumed terms (linkctl.estimate.ranges)."""
    fits = fit_all(rows, spec)
    families = {k: str(v["family"]) for k, v in spec.items()}
    return {
        key: {
            kind: error_range(
                res,
                families,
                key,
                kind,
                (f.n_decode if kind == "decode" else f.n_prefill) >= LOO_MIN_LEFT,
            )
            for kind in KINDS
        }
        for key, f in fits.items()
    }
