"""This machine's hardware, as `linkctl pair` announces it: one public API, one module
per OS behind it (as psutil and linkctl.net do), a typed record back.

    facts = machine_facts(runner)   # MachineFacts(hostname, os, accelerator, memory)
"""

from __future__ import annotations

import socket

from linkctl.core.runner import Runner, default_runner
from linkctl.host.facts import MachineFacts

__all__ = ["MachineFacts", "machine_facts"]


def machine_facts(os_name: str, runner: Runner | None = None) -> MachineFacts:
    """This machine's facts; ``os_name`` ("linux"/"macos"): the network backend's, so a
    replayed Mac reads its recorded sysctl outputs."""
    runner = runner or default_runner()
    hostname = socket.gethostname().split(".")[0]
    if os_name == "macos":
        from linkctl.host import macos

        return macos.facts(runner, hostname)
    from linkctl.host import linux

    return linux.facts(runner, hostname)
