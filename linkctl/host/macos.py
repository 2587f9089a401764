"""macOS: the chip (machdep.cpu.brand_string) and unified memory (hw.memsize), from
sysctl(8); Apple silicon's GPU shares that memory."""

from __future__ import annotations

from linkctl.core.runner import Runner
from linkctl.host.facts import MachineFacts


def facts(runner: Runner, hostname: str) -> MachineFacts:
    chip = runner.run(["sysctl", "-n", "machdep.cpu.brand_string"], timeout=10).stdout.strip()
    memsize = runner.run(["sysctl", "-n", "hw.memsize"], timeout=10).stdout.strip()
    return MachineFacts(hostname, "macos", chip, round(int(memsize) / 2**30, 1))
