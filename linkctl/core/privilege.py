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


def require_root(why: str, command: str | None = None) -> None:
    """Refuse (NeedsRoot, exit 2) unless running as root. ``why`` says what needs it
    (raw-socket ARP, the link's addresses, boot units); ``command`` is what to type
    (default: this command line)."""
    if is_root():
        return
    raise NeedsRoot(
        f"needs root: sudo {command or invoked_as()}",
        f"{why}; run it with sudo",
    )
