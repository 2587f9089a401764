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


# ---- errors by cause ---------------------------------------------------------------
#
# As psutil does (NoSuchProcess, AccessDenied, ...): the module that talks to the OS,
# a tool or a peer (runner, macos, rpc, arp) translates what it saw into one of these,
# and callers decide by type, never by reading the message. Each keeps the one-line
# message the CLI prints and carries its exit code.


class CommandNotFound(InputError):
    """An external command is not installed or not on PATH (exit 2)."""

    exit_code = 2

    def __init__(self, command: str, fix: str | None = None):
        self.command = command
        super().__init__(f"command not found: {command}", fix)


class Timeout(InputError):
    """A command or a connection did not finish within its deadline (exit 2).

    ``seconds``: how long it was given (or waited) before giving up."""

    exit_code = 2

    def __init__(self, message: str, fix: str | None = None, *, seconds: float):
        self.seconds = seconds
        super().__init__(message, fix)


class ConnectionRefused(InputError):
    """Nothing listens at ``host:port``: the peer answered the connect with a reset (exit 2)."""

    exit_code = 2

    def __init__(self, message: str, fix: str | None = None, *, host: str, port: int):
        self.host, self.port = host, port
        super().__init__(message, fix)


class PermissionDenied(InputError):
    """The OS refused the operation to this user (EPERM/EACCES, no CAP_NET_RAW) (exit 2)."""

    exit_code = 2


class NeedsRoot(PermissionDenied):
    """The operation needs root or admin privileges: run it with sudo (exit 2)."""

    exit_code = 2


class RpcProtocolMismatch(InputError):
    """An rpc endpoint speaks an RPC protocol the local llama.cpp build cannot use (exit 2).

    ``local`` is this build's (major, minor, patch), ``remote`` the endpoint's."""

    exit_code = 2

    def __init__(
        self,
        message: str,
        fix: str | None = None,
        *,
        local: tuple[int, int, int],
        remote: tuple[int, int, int],
    ):
        self.local, self.remote = local, remote
        super().__init__(message, fix)
