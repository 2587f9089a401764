"""Step 5: throughput with the system iperf3 (-J JSON) against the responder's iperf3 -s.

Four runs: forward (we send) and reverse (-R, the peer sends), each with 1
and 4 parallel streams. Gbit/s is ``end.sum_received.bits_per_second`` (what
arrived), retransmits ``end.sum_sent.retransmits`` (the sender's count; with
-R the server reports its own). iperf3 serves one test at a time: a second
client gets "the server is busy running a test", reported as such.
"""

from __future__ import annotations

import json
import math
import os
import random
import time
from collections.abc import Callable

from linkctl.core.errors import InputError, LinkctlError
from linkctl.core.records import ThroughputRun
from linkctl.core.runner import Runner
from linkctl.probe.responder import IPERF_HINT

RUNS = (("fwd_p1", False, 1), ("rev_p1", True, 1), ("fwd_p4", False, 4), ("rev_p4", True, 4))
# Both hosts' boot gates probe each other at the same moment (after a boot or a
# re-plugged cable), and each peer's iperf3 server takes one test at a time: a busy
# server is waited for, with random backoff so the two gates fall out of step,
# for up to this long per run (the other probe's four runs take ~6 s);
# LINKCTL_IPERF_BUSY_WAIT_S overrides it (0: fail at once).
BUSY_WAIT_S = 45.0


def busy_wait_s() -> float:
    try:
        return float(os.environ.get("LINKCTL_IPERF_BUSY_WAIT_S", BUSY_WAIT_S))
    except ValueError:
        return BUSY_WAIT_S


class IperfError(LinkctlError):
    """iperf3 ran but could not measure (exit 2: the probe could not run)."""

    def __init__(self, message: str, fix: str | None = None):
        super().__init__(
            message, fix or "check iperf3 on both hosts (the peer's responder runs its server)"
        )


class IperfBusy(IperfError):
    """The peer's iperf3 server is running another client's test (exit 2)."""

    def __init__(self, message: str):
        super().__init__(message, "retry when that test has finished")


def iperf_seconds(duration_s: float) -> int:
    """iperf3 -t takes whole seconds (and -t 0 means 'forever'): round up, at least 1."""
    return max(1, math.ceil(duration_s - 1e-9))


def run_iperf(
    runner: Runner,
    peer_ip: str,
    src_ip: str,
    port: int,
    *,
    seconds: int,
    streams: int,
    reverse: bool,
    timeout_s: float,
) -> ThroughputRun:
    if not runner.which("iperf3"):
        raise InputError("iperf3 is not installed on this host", IPERF_HINT)
    argv = [
        "iperf3",
        "-c",
        peer_ip,
        "-B",
        src_ip,
        "-p",
        str(port),
        "-J",
        "-t",
        str(seconds),
        "-P",
        str(streams),
        "--connect-timeout",
        str(int(timeout_s * 1000)),
    ]
    if reverse:
        argv.append("-R")
    # iperf3 itself gives up on an unreachable server after --connect-timeout; the
    # runner's timeout is the backstop for a test that never ends.
    res = runner.run(argv, timeout=seconds + timeout_s + 10, check=False)
    try:
        data = json.loads(res.stdout)
    except ValueError:
        detail = (res.stderr or res.stdout).strip().splitlines()
        raise IperfError(
            f"iperf3 gave no JSON (exit {res.returncode}): {detail[-1] if detail else 'no output'}"
        ) from None
    err = data.get("error")
    if err:
        low = err.lower()
        where = f"{peer_ip}:{port}"
        if "busy" in low:
            raise IperfBusy(
                f"iperf3 server on {where} is busy running another test; retry when it finishes"
            )
        if "connection refused" in low:
            raise IperfError(
                f"no iperf3 server on {where} (connection refused): is the "
                "responder's iperf3 running on the peer?"
            )
        raise IperfError(f"iperf3 against {where}: {err}")
    end = data.get("end") or {}
    recv, sent = end.get("sum_received") or {}, end.get("sum_sent") or {}
    if "bits_per_second" not in recv:
        raise IperfError("iperf3 JSON lacks end.sum_received: test did not complete")
    return ThroughputRun(
        gbps=round(recv["bits_per_second"] / 1e9, 3),
        retransmits=sent.get("retransmits"),
        direction="rev" if reverse else "fwd",
        streams=streams,
        seconds=round(recv.get("seconds") or seconds, 3),
        bytes=recv.get("bytes"),
        sender_gbps=round(sent.get("bits_per_second", 0) / 1e9, 3),
    )


def measure(
    runner: Runner,
    peer_ip: str,
    src_ip: str,
    port: int,
    *,
    duration_s: float,
    timeout_s: float,
    on_run: Callable[[str, int], None] | None = None,
    runs: tuple[tuple[str, bool, int], ...] = RUNS,
) -> dict[str, ThroughputRun]:
    """All runs in order; on_run(key, seconds) is called before each (progress display)."""
    seconds = iperf_seconds(duration_s)
    out: dict[str, ThroughputRun] = {}
    for key, reverse, streams in runs:
        if on_run:
            on_run(key, seconds)
        deadline = time.monotonic() + busy_wait_s()
        while True:
            try:
                out[key] = run_iperf(
                    runner,
                    peer_ip,
                    src_ip,
                    port,
                    seconds=seconds,
                    streams=streams,
                    reverse=reverse,
                    timeout_s=timeout_s,
                )
                break
            except IperfBusy as e:
                if time.monotonic() > deadline:
                    raise IperfBusy(f"{e.message} (waited {busy_wait_s():g} s)") from None
                time.sleep(random.uniform(0.5, 2.0))
    return out
