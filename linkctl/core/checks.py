"""One check vocabulary: the verdict and the check record every command reports with
(status, probe, doctor, verify, serve's gates). The NIC checks that status, probe and
doctor share are linkctl.net.nic_checks.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass
from enum import StrEnum
from typing import Any


class Verdict(StrEnum):
    PASS = "PASS"
    WARN = "WARN"
    FAIL = "FAIL"
    SKIP = "SKIP"  # not judged: a check it needs failed, or the OS does not say


_SEVERITY = {Verdict.SKIP: 0, Verdict.PASS: 1, Verdict.WARN: 2, Verdict.FAIL: 3}


def worst(verdicts: Iterable[Verdict], default: Verdict = Verdict.PASS) -> Verdict:
    """The most severe verdict: FAIL over WARN over PASS over SKIP (``default`` if none)."""
    return max(verdicts, key=_SEVERITY.__getitem__, default=default)


@dataclass
class Check:
    """One check's result: what was seen (value) against what is wanted (threshold)."""

    name: str
    verdict: Verdict
    value: Any = None
    threshold: Any = None
    detail: str = ""
    fix: str | None = None  # for WARN and FAIL: what to do

    def __post_init__(self) -> None:
        self.verdict = Verdict(self.verdict)  # ValueError for a word that is not one

    @property
    def ok(self) -> bool:
        return self.verdict is not Verdict.FAIL

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["verdict"] = self.verdict.value
        return d


def failed_text(checks: Iterable[Check]) -> str:
    """'tcp rtt 1 B (7310 vs limit 5000), ...': the failed checks with figure and limit."""
    out = []
    for c in checks:
        if c.verdict is not Verdict.FAIL:
            continue
        value, limit = c.value, c.threshold
        numbers = isinstance(value, int | float) and isinstance(limit, int | float)
        figures = f" ({value:g} vs limit {limit:g})" if numbers else ""
        out.append(f"{c.name}{figures}")
    return ", ".join(out)
