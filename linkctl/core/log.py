"""The one stderr logger: every progress and event line linkctl writes is

    2026-12-04T19:48:17.123Z linkctl[who] message

one line, flushed at once (a supervisor's log is read while it runs), from any thread
without interleaving. ``who`` names the part speaking (serve, route, kv-agent,
calibrate, verify, a supervised child's name). Output meant as the command's result
goes through linkctl.core.output instead.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from datetime import UTC, datetime
from typing import IO

Say = Callable[[str], None]

# One lock for every stream: two speakers on one stream (a supervisor and its route
# thread share serve's stderr) never cut each other's lines.
_LOCK = threading.Lock()


def stamp() -> str:
    """UTC now, to the millisecond: 2026-12-04T19:48:17.123Z."""
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"


def write_line(line: str, stream: IO[str] | None = None) -> None:
    """``line`` (without its newline) to ``stream`` (default: stderr at call time)."""
    out = stream or sys.stderr
    with _LOCK:
        out.write(line + "\n")
        out.flush()


def speaker(who: str, stream: IO[str] | None = None) -> Say:
    """A ``say(message)`` that writes ``{stamp} linkctl[who] message`` to ``stream``."""

    def say(message: str) -> None:
        write_line(f"{stamp()} linkctl[{who}] {message}", stream)

    return say


def quiet(_message: str) -> None:
    """A ``say`` that says nothing."""
