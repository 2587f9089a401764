"""ICMP echo through the system `ping`, one argv builder per OS.

The backends expose these as ``backend.ping_argv(...)`` (LinuxBackend,
MacBackend), so the probe never branches on the platform: it asks the
backend for the argv and runs it through the backend's runner. The flags
differ: iputils on Linux sets don't-fragment with ``-M do`` and a per-reply
wait with ``-W``; macOS ping uses ``-D`` and a whole-run timeout ``-t``
(whole seconds), and refuses intervals under 0.1 s for non-root users.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

# Both iputils ("rtt min/avg/max/mdev = ...") and macOS ("round-trip
# min/avg/max/stddev = ...") print the summary as four numbers in ms.
_SUMMARY_RE = re.compile(r"=\s*([\d.]+)/([\d.]+)/([\d.]+)/([\d.]+)\s*ms")
_LOSS_RE = re.compile(r"(\d+) packets transmitted, (\d+) (?:packets )?received")


def linux_ping_argv(
    address: str,
    *,
    size: int | None = None,
    count: int = 1,
    timeout_s: float = 1.0,
    interval_s: float | None = None,
    dont_fragment: bool = False,
) -> list[str]:
    argv = ["ping", "-n", "-c", str(count), "-W", f"{timeout_s:g}"]
    if count > 1:
        # -w: a deadline for the whole run, so a dead peer cannot stretch it.
        deadline = (interval_s or 1.0) * count + timeout_s
        argv += ["-w", str(math.ceil(deadline))]
    if interval_s is not None:
        argv += ["-i", f"{interval_s:g}"]
    if dont_fragment:
        argv += ["-M", "do"]
    if size is not None:
        argv += ["-s", str(size)]
    return [*argv, address]


def macos_ping_argv(
    address: str,
    *,
    size: int | None = None,
    count: int = 1,
    timeout_s: float = 1.0,
    interval_s: float | None = None,
    dont_fragment: bool = False,
) -> list[str]:
    interval = max(interval_s, 0.1) if interval_s is not None else None
    total = (interval or 1.0) * (count - 1) + timeout_s
    argv = ["ping", "-n", "-c", str(count), "-t", str(max(1, math.ceil(total)))]
    if interval is not None:
        argv += ["-i", f"{interval:g}"]
    if dont_fragment:
        argv += ["-D"]
    if size is not None:
        argv += ["-s", str(size)]
    return [*argv, address]


def argv_deadline(count: int, timeout_s: float, interval_s: float | None) -> float:
    """How long a ping run built above may take, for the runner's own timeout."""
    return (max(interval_s or 1.0, 0.1)) * count + timeout_s + 2.0


@dataclass(frozen=True)
class PingSummary:
    sent: int
    received: int
    min_us: float | None
    avg_us: float | None
    max_us: float | None
    dev_us: float | None


def parse_ping(output: str) -> PingSummary:
    """Packet counts and the RTT summary (in microseconds) from either OS's ping."""
    sent = received = 0
    m = _LOSS_RE.search(output)
    if m:
        sent, received = int(m.group(1)), int(m.group(2))
    s = _SUMMARY_RE.search(output)
    if not s:
        return PingSummary(sent, received, None, None, None, None)
    mn, avg, mx, dev = (round(float(x) * 1000.0, 1) for x in s.groups())
    return PingSummary(sent, received, mn, avg, mx, dev)
