"""Who runs this command, and the one refusal for a command that needs root.

A command that changes the machine or opens raw sockets checks first, before it does
anything, and refuses in one line that names the command to type instead
(``needs root: sudo linkctl probe --profile dgx-mac``), exit 2, nothing changed.
"""

from __future__ import annotations

import os
import shlex
import sys

from linkctl.core.errors import NeedsRoot


def is_root() -> bool:
    return os.geteuid() == 0


def invoked_as() -> str:
    """The command line as the user typed it, for the sudo hint (``linkctl`` first,
    whatever path or ``python -m`` started it)."""
    return shlex.join(["linkctl", *sys.argv[1:]])


def sudo_line(command: str | None = None) -> str:
    """``needs root: sudo linkctl ...``: ``command`` (default: this command line)."""
    return f"needs root: sudo {command or invoked_as()}"


def require_root(why: str, command: str | None = None) -> None:
    """Refuse (NeedsRoot, exit 2) unless running as root. ``why`` says what needs it
    (raw-socket ARP, the link's addresses, boot units); ``command`` is what to type
    (default: this command line)."""
    if is_root():
        return
    raise NeedsRoot(sudo_line(command), f"{why}; run it with sudo")


def require_writable_state(what: str) -> None:
    """Refuse (NeedsRoot, exit 2) a command that would write ``what`` to a state
    directory this user cannot write. Once root's /var/lib/linkctl exists it is the one
    state every linkctl reads (linkctl.core.paths.state_dir); its writers run with sudo
    rather than keep a second state that root's commands and services never see."""
    from linkctl.core.paths import state_dir, writable

    d = state_dir()
    if not writable(d):
        require_root(f"it writes {what} to {d}, which is not yours")
