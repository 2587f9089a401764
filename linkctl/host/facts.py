"""The record this package returns: what `linkctl pair` announces of the machine."""

from __future__ import annotations

from dataclasses import dataclass


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
