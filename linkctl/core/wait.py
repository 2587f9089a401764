"""Waiting for something that is still starting (an rpc-server, a llama-server loading
its model): try again until it answers or time runs out, saying each new reason once."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

from linkctl.core.errors import LinkctlError
from linkctl.core.log import Say

T = TypeVar("T")


def until_answered(
    ask: Callable[[], T],
    *,
    within: float,
    what: str,
    say: Say,
    retry_on: type[LinkctlError] | tuple[type[LinkctlError], ...] = LinkctlError,
    never_retry: tuple[type[LinkctlError], ...] = (),
    interval: float = 0.5,
) -> T:
    """``ask()`` until it returns; a ``retry_on`` error is tried again (``never_retry``
    ones, which no wait can mend, are raised at once) until ``within`` seconds have
    passed, then the last one is raised."""
    deadline = time.monotonic() + within
    last = None
    while True:
        try:
            return ask()
        except never_retry:
            raise
        except retry_on as e:
            if time.monotonic() > deadline:
                raise
            if e.message != last:
                say(f"waiting for {what}: {e.message}")
                last = e.message
            time.sleep(interval)
