"""Plans: ordered changes, each carrying its own undo, applied as one transaction.

A backend turns a profile into a Plan and knows how to execute one Change.
``apply`` runs the changes in order; if any change, hook or final verify
fails, it undoes every applied change in reverse and re-raises, so the
machine is left as it was.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from linkctl.errors import ApplyError, LinkctlError

log = logging.getLogger("linkctl.plan")


@dataclass(frozen=True)
class Change:
    action: str  # backend verb, e.g. "set_mtu", "addr_add", "run"
    target: str  # the interface or service it acts on
    summary: str  # one human line, e.g. "enP7s7: MTU 1500 -> 9000"
    args: dict[str, Any] = field(default_factory=dict, hash=False, compare=True)
    undo: Change | None = None

    def as_dict(self) -> dict[str, Any]:
        return {
            "action": self.action,
            "target": self.target,
            "summary": self.summary,
            "args": self.args,
            "undo": self.undo.as_dict() if self.undo else None,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Change:
        undo = cls.from_dict(d["undo"]) if d.get("undo") else None
        return cls(d["action"], d["target"], d["summary"], dict(d.get("args") or {}), undo)


@dataclass
class Plan:
    changes: list[Change] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # facts worth showing, not changes

    @property
    def empty(self) -> bool:
        return not self.changes

    def as_dict(self) -> dict[str, Any]:
        return {"changes": [c.as_dict() for c in self.changes], "notes": self.notes}

    def undo_plan(self) -> Plan:
        """The plan that reverses this one: the undos, last change first."""
        return Plan([c.undo for c in reversed(self.changes) if c.undo])


# Failpoint for tests of the rollback path: names a change action to fail at, or
# ACTION#N for the Nth change of the plan (1-based) when several share an action.
FAULT_ENV = "LINKCTL_INJECT_FAULT"

Executor = Callable[[Change], None]
Hook = Callable[[Change], None]


def apply(
    plan: Plan,
    execute: Executor,
    *,
    before: Hook | None = None,
    verify: Callable[[], None] | None = None,
) -> list[Change]:
    """Apply every change or none. Returns the applied changes.

    ``before(change)`` runs just before each change (e.g. the duplicate-address
    probe before an address is added) and may raise to abort; ``verify()`` runs
    after the last change and may raise to roll everything back.
    """
    applied: list[Change] = []
    try:
        for n, change in enumerate(plan.changes, start=1):
            if before:
                before(change)
            log.info("apply: %s", change.summary)
            if os.environ.get(FAULT_ENV) in (change.action, f"{change.action}#{n}"):
                raise ApplyError(f"injected fault before {change.summary!r} ({FAULT_ENV})")
            execute(change)
            applied.append(change)
        if verify:
            verify()
    except BaseException as exc:
        failures = rollback(applied, execute)
        if failures:
            raise ApplyError(
                f"{_reason(exc)}; rollback left {len(failures)} change(s) in place: "
                + "; ".join(failures),
                "inspect with `linkctl status` and fix by hand",
            ) from exc
        if isinstance(exc, LinkctlError):
            # Keep the original class (and exit code): a device refusing an MTU
            # is still bad input, and nothing is left changed.
            exc.message = f"{exc.message} (all {len(applied)} applied change(s) rolled back)"
            exc.args = (exc.line(),)
            raise
        raise ApplyError(
            f"{_reason(exc)} (all {len(applied)} applied change(s) rolled back)"
        ) from exc
    return applied


def rollback(applied: list[Change], execute: Executor) -> list[str]:
    """Undo applied changes, last first. Returns summaries of undos that failed."""
    failures = []
    for change in reversed(applied):
        if change.undo is None:
            continue
        try:
            log.info("rollback: %s", change.undo.summary)
            execute(change.undo)
        except Exception as e:  # keep undoing the rest
            failures.append(f"{change.undo.summary}: {_reason(e)}")
    return failures


def _reason(exc: BaseException) -> str:
    if isinstance(exc, LinkctlError):
        return exc.line()
    if isinstance(exc, KeyboardInterrupt):
        return "interrupted"
    return f"{type(exc).__name__}: {exc}"
