"""Step 3: path MTU. A don't-fragment echo of MTU-28 bytes (IP 20 + ICMP 8 headers)
must get through and one byte more must not, so jumbo frames work end to end,
not just on this side. Also the ICMP RTT cross-check used by the latency step.

The argv comes from ``backend.ping_argv`` (one builder per OS, next to the
backends); the probe never branches on the platform.
"""

from __future__ import annotations

from typing import Any

from linkctl.core.checks import Verdict
from linkctl.core.profile import HostSpec
from linkctl.core.records import IcmpStats, MtuPart
from linkctl.net.ping import PingSummary, argv_deadline, parse_ping
from linkctl.probe.report import ProbeReport

IP_ICMP_HEADERS = 28
FALLBACK_MTUS = (1500,)  # what a mismatched end most likely runs at


def ping(
    backend: Any,
    address: str,
    *,
    size: int | None = None,
    count: int = 1,
    timeout_s: float = 1.0,
    interval_s: float | None = None,
    dont_fragment: bool = False,
) -> tuple[bool, PingSummary, str]:
    """(all replies came back, summary, last line of output)."""
    argv = backend.ping_argv(
        address,
        size=size,
        count=count,
        timeout_s=timeout_s,
        interval_s=interval_s,
        dont_fragment=dont_fragment,
    )
    res = backend.runner.run(argv, timeout=argv_deadline(count, timeout_s, interval_s), check=False)
    out = res.stdout + res.stderr
    summary = parse_ping(out)
    lines = [ln.strip() for ln in out.splitlines() if ln.strip()]
    errors = [ln for ln in lines if "error" in ln.lower() or "too long" in ln.lower()]
    note = errors[0] if errors else (lines[-1] if lines else "")
    return res.ok and summary.received == count, summary, note


def check_path_mtu(
    report: ProbeReport, backend: Any, peer: HostSpec, mtu: int, timeout_s: float
) -> bool:
    size = mtu - IP_ICMP_HEADERS
    ok, _s, note = ping(backend, peer.ip, size=size, timeout_s=timeout_s, dont_fragment=True)
    over_ok, _s2, over_note = ping(
        backend, peer.ip, size=size + 1, timeout_s=min(timeout_s, 1.0), dont_fragment=True
    )
    report.mtu = MtuPart(
        mtu=mtu,
        payload=size,
        df_ok=ok,
        df_over_blocked=not over_ok,
        detail=note if not ok else "",
        path_mtu_at_least=mtu if ok else None,
    )
    if not ok:
        works = None
        for m in FALLBACK_MTUS:
            if m < mtu:
                w, _, _ = ping(
                    backend,
                    peer.ip,
                    size=m - IP_ICMP_HEADERS,
                    timeout_s=min(timeout_s, 1.0),
                    dont_fragment=True,
                )
                if w:
                    works = m
                    break
        report.mtu.path_mtu_at_least = works
        why = (
            f"a {works}-byte DF echo does: one end (or a switch) runs MTU {works}, "
            f"set MTU {mtu} on both ends"
            if works
            else "no smaller size tried passes either"
        )
        report.add(
            "path mtu",
            Verdict.FAIL,
            works,
            mtu,
            f"MTU mismatch: DF echo of {size} bytes (MTU {mtu}) to {peer.ip} got no reply"
            f" ({note or 'lost'}); {why}",
        )
        return True  # TCP still works (MSS adapts): keep measuring, the FAIL stands
    if over_ok:
        report.add(
            "path mtu",
            Verdict.WARN,
            f">{mtu}",
            mtu,
            f"DF echo of {size + 1} bytes also got through: the path MTU exceeds the "
            f"profile's {mtu} (an interface MTU set higher than profiled?)",
        )
    else:
        report.add(
            "path mtu",
            Verdict.PASS,
            mtu,
            mtu,
            f"DF {size} B echoed; {size + 1} B "
            + ("refused locally (message too long)" if "too long" in over_note else "got no reply"),
        )
    return True


def check_icmp_rtt(
    report: ProbeReport,
    backend: Any,
    peer: HostSpec,
    timeout_s: float,
    max_rtt_us: float,
    count: int = 20,
) -> IcmpStats:
    ok, s, note = ping(
        backend, peer.ip, count=count, timeout_s=min(timeout_s, 1.0), interval_s=0.01
    )
    icmp = IcmpStats(
        sent=s.sent,
        received=s.received,
        min_us=s.min_us,
        avg_us=s.avg_us,
        max_us=s.max_us,
        stddev_us=s.dev_us,
    )
    report.latency.icmp = icmp
    if s.received == 0:
        report.add(
            "icmp rtt",
            Verdict.WARN,
            None,
            max_rtt_us,
            f"no ICMP echo replies from {peer.ip} ({note}); firewall dropping ICMP?",
        )
    elif s.received < s.sent or not ok:
        report.add(
            "icmp rtt",
            Verdict.WARN,
            s.avg_us,
            max_rtt_us,
            f"{s.sent - s.received} of {s.sent} echoes lost",
        )
    elif s.avg_us is not None and s.avg_us > max_rtt_us:
        report.add(
            "icmp rtt", Verdict.WARN, s.avg_us, max_rtt_us, "ICMP average above the RTT limit"
        )
    else:
        report.add(
            "icmp rtt",
            Verdict.PASS,
            s.avg_us,
            max_rtt_us,
            f"{s.received}/{s.sent} echoes, min/avg/max {s.min_us}/{s.avg_us}/{s.max_us} us",
        )
    return icmp
