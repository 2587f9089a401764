"""Plans: ordered changes, each carrying its own undo, applied as one transaction.

A backend turns a profile into a Plan and knows how to execute one Change.
``apply`` runs the changes in order; if any change, hook or final verify
fails, it undoes every applied change in reverse and re-raises, so the
machine is left as it was.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from linkctl.core.errors import ApplyError, LinkctlError


def _log(msg: str, *args: object) -> None:
    # logging is imported on the first change applied: read-only commands never need it.
    import logging

    logging.getLogger("linkctl.net.plan").info(msg, *args)


class Kind(StrEnum):
    """What a change is, as the backend executes it. A StrEnum: recorded and shown
    (JSON, LINKCTL_INJECT_FAULT) as its value."""

    SET_MTU = "set_mtu"  # netlink: args mtu
    LINK_UP = "link_up"
    LINK_DOWN = "link_down"
    ADDR_ADD = "addr_add"  # netlink: args address, prefixlen
    ADDR_DEL = "addr_del"
    RUN = "run"  # an external command (nmcli, networksetup, route): args argv


class Effect(StrEnum):
    """What a change alters in the running network state. The backend declares it on
    every change it plans, so link-level logic (the duplicate-address probe, above
    all) asks the change, never its name or its argv."""

    ADDRESS = "address"  # an IPv4 address appears on or leaves the interface
    MTU = "mtu"
    LINK = "link"  # administrative state (up/down), and with it carrier
    ROUTE = "route"  # a route appears or goes (the subnet route comes with an address)


# What a netlink change does by its nature; RUN changes say it themselves.
KIND_EFFECTS: dict[Kind, frozenset[Effect]] = {
    Kind.SET_MTU: frozenset({Effect.MTU}),
    Kind.LINK_UP: frozenset({Effect.LINK}),
    Kind.LINK_DOWN: frozenset({Effect.LINK}),
    Kind.ADDR_ADD: frozenset({Effect.ADDRESS, Effect.ROUTE}),
    Kind.ADDR_DEL: frozenset({Effect.ADDRESS, Effect.ROUTE}),
    Kind.RUN: frozenset(),
}


ALL_EFFECTS: frozenset[Effect] = frozenset(Effect)


@dataclass(frozen=True)
class Change:
    action: Kind  # what the backend executes
    target: str  # the interface or service it acts on
    summary: str  # one human line, e.g. "enP7s7: MTU 1500 -> 9000"
    args: dict[str, Any] = field(default_factory=dict, hash=False, compare=True)
    undo: Change | None = None
    # What it alters (see Effect). None takes the kind's own (KIND_EFFECTS); a RUN
    # change must declare them, since only its backend knows what the command does.
    effects: frozenset[Effect] | None = None

    def __post_init__(self) -> None:
        kind = Kind(self.action)  # ValueError for a verb no backend executes
        object.__setattr__(self, "action", kind)
        if self.effects is None and kind is Kind.RUN:
            raise ValueError(f"run change {self.summary!r} declares no effects")
        fx = KIND_EFFECTS[kind] if self.effects is None else self.effects
        object.__setattr__(self, "effects", frozenset(Effect(e) for e in fx))

    def has(self, effect: Effect) -> bool:
        return effect in (self.effects or ())

    def as_dict(self) -> dict[str, Any]:
        return {
            "action": self.action.value,
            "target": self.target,
            "summary": self.summary,
            "args": self.args,
            "effects": sorted(e.value for e in self.effects or ()),
            "undo": self.undo.as_dict() if self.undo else None,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Change:
        undo = cls.from_dict(d["undo"]) if d.get("undo") else None
        # Records written before effects were declared: the kind's own, none for a
        # command (teardown uses only a recorded change's kind, args and undo).
        fx: Iterable[str] | None = d.get("effects")
        if fx is None and d["action"] == Kind.RUN:
            fx = ()
        return cls(
            d["action"],
            d["target"],
            d["summary"],
            dict(d.get("args") or {}),
            undo,
            None if fx is None else frozenset(Effect(e) for e in fx),
        )


@dataclass
class Plan:
    changes: list[Change] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # facts worth showing, not changes

    @property
    def empty(self) -> bool:
        return not self.changes

    def as_dict(self) -> dict[str, Any]:
        return {"changes": [c.as_dict() for c in self.changes], "notes": self.notes}

    def touches(self, effect: Effect) -> bool:
        return any(c.has(effect) for c in self.changes)


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
            _log("apply: %s", change.summary)
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
            _log("rollback: %s", change.undo.summary)
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
