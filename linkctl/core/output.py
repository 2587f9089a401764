"""Facts as data first, text second: every command builds a dict, then either
prints it as JSON (--json) or renders it for a person."""

from __future__ import annotations

import json
import sys
from typing import TYPE_CHECKING, Any

from linkctl.core.checks import Verdict

if TYPE_CHECKING:
    from rich.console import Console


class _LazyConsole:
    """A rich Console created on first use: importing rich costs ~50 ms, which
    `linkctl --help` and --json runs need not pay."""

    def __init__(self, **kwargs: Any):
        self._kwargs = kwargs
        self._console: Console | None = None

    def __getattr__(self, name: str) -> Any:
        if self._console is None:
            import os

            from rich.console import Console

            stream = sys.stderr if self._kwargs.get("stderr") else sys.stdout
            kwargs = dict(self._kwargs)
            # Not a terminal (a journal, a log file, a pipe): rich would wrap tables at
            # 80 columns, splitting a probe's reason over lines a grep cannot find.
            if "COLUMNS" not in os.environ and not stream.isatty():
                kwargs.setdefault("width", LOG_WIDTH)
            self._console = Console(**kwargs)
        return getattr(self._console, name)


LOG_WIDTH = 160


# emoji=False: linkctl prints no emoji, and text such as a MAC or a path is never
# searched for :name: codes (nor rich's ~4 ms emoji table loaded to look them up).
console = _LazyConsole(highlight=False, soft_wrap=True, emoji=False)
err_console = _LazyConsole(stderr=True, highlight=False, soft_wrap=True, emoji=False)

VERDICT_STYLE = {
    Verdict.PASS: "green",
    Verdict.WARN: "yellow",
    Verdict.FAIL: "red",
    Verdict.SKIP: "dim",
}


def print_json(data: Any, indent: int | None = 2) -> None:
    sys.stdout.write(json.dumps(data, indent=indent, default=str) + "\n")
    sys.stdout.flush()  # a line at a time to a pipe (status --watch --json | jq)


def verdict(v: Verdict) -> str:
    return f"[{VERDICT_STYLE[v]}]{v}[/]"


def error_line(message: str) -> None:
    from rich.markup import escape

    # Escaped: a message may quote what a peer or a file said ("[/]" is not markup).
    err_console.print(f"[red]linkctl: error:[/] {escape(message)}", markup=True, soft_wrap=True)


def warn_line(message: str) -> None:
    from rich.markup import escape

    err_console.print(
        f"[yellow]linkctl: warning:[/] {escape(message)}", markup=True, soft_wrap=True
    )


def verdict_lines(rows: list[tuple[Verdict, str, str, str | None]]) -> None:
    """One line per check: VERDICT  check  detail  fix: ... (fix shown for FAIL/WARN).
    Rows are (verdict, check, detail, fix)."""
    from rich.markup import escape

    width = max((len(r[1]) for r in rows), default=0)
    for v, check, detail, fix in rows:
        text = f"{verdict(v)}{' ' * (5 - len(v))}{escape(check.ljust(width))}  {escape(detail)}"
        if fix and v in (Verdict.FAIL, Verdict.WARN):
            text += f"  [bold]fix:[/] {escape(fix)}"
        console.print(text)
