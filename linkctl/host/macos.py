"""macOS: the chip (machdep.cpu.brand_string) and unified memory (hw.memsize), from
sysctl(8); Apple silicon's GPU shares that memory."""

from __future__ import annotations

from linkctl.core.runner import Runner
from linkctl.host.facts import MachineFacts


def parse_memsize(text: str) -> float:
    """`sysctl hw.memsize` ("hw.memsize: 137438953472", or the bare number of
    `sysctl -n`) in GiB: a "128 GB" Mac's is 128."""
    return round(int(text.strip().rpartition(":")[2]) / 2**30, 1)


def facts(runner: Runner, hostname: str) -> MachineFacts:
    chip = runner.run(["sysctl", "-n", "machdep.cpu.brand_string"], timeout=10).stdout.strip()
    memory = parse_memsize(runner.run(["sysctl", "hw.memsize"], timeout=10).stdout)
    return MachineFacts(hostname, "macos", chip, memory)
