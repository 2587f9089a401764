"""Error types that map to linkctl's exit codes.

0 ok, 1 a check failed, 2 bad input or environment. Every error carries a
one-line message naming what is wrong and, where there is one, the fix.
"""

from __future__ import annotations


class LinkctlError(Exception):
    """Base for errors the CLI turns into a one-line message and an exit code."""

    exit_code = 2

    def __init__(self, message: str, fix: str | None = None):
        self.message = message
        self.fix = fix
        super().__init__(self.line())

    def line(self) -> str:
        return f"{self.message} (fix: {self.fix})" if self.fix else self.message


class InputError(LinkctlError):
    """Bad input or environment: nothing was changed (exit 2)."""

    exit_code = 2


class CheckFailed(LinkctlError):
    """A verification ran and failed (exit 1)."""

    exit_code = 1


class ApplyError(LinkctlError):
    """Applying a plan failed; every applied change was rolled back (exit 1)."""

    exit_code = 1
