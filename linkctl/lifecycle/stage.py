"""One stage of up or down: what it is, whether it changed the host, what it did."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from linkctl.core.log import Say


@dataclass
class Stage:
    name: str
    changed: bool
    detail: str
    seconds: float = 0.0


def run_stage(
    stages: list[Stage], say: Say, name: str, run: Callable[[], tuple[bool, str]]
) -> Stage:
    """``run()`` -> (changed, detail), timed, appended to ``stages`` and said."""
    t = time.monotonic()
    changed, detail = run()
    st = Stage(name, changed, detail, round(time.monotonic() - t, 1))
    stages.append(st)
    say(f"{name}: {detail}")
    return st
