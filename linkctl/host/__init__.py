"""This machine's hardware, as `linkctl pair` announces it: one public API, one module
per OS behind it (as psutil and linkctl.net do), a typed record back.

    facts = machine_facts(runner)   # MachineFacts(hostname, os, accelerator, memory)
"""

from __future__ import annotations

import socket
from dataclasses import asdict, dataclass
from typing import Any

from linkctl.core.runner import Runner, default_runner


@dataclass(frozen=True)
class MachineFacts:
    hostname: str  # the short host name, as the OS gives it
    os: str  # "linux" or "macos"
    accelerator: str  # as the vendor tool prints it: "NVIDIA GB10", "Apple M2 Ultra"; "" none
    memory_gb: float  # system memory in GiB (unified on Apple silicon and GB10)
    # The accelerator's own memory when it has some apart from the system's (a discrete
    # GPU); None when unified or unknown.
    accelerator_memory_gb: float | None = None

    @property
    def usable_gb(self) -> float:
        """Memory the accelerator can hold weights in: its own, else the system's."""
        return self.accelerator_memory_gb or self.memory_gb

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


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
