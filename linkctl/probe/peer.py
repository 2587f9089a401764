"""Step 2: the peer answers ARP on the link, with the MAC the profile pins (if any)."""

from __future__ import annotations

import time

from linkctl.core.checks import Verdict
from linkctl.core.errors import PermissionDenied
from linkctl.core.profile import HostSpec
from linkctl.core.records import ArpPart
from linkctl.probe.report import ProbeReport


def check_peer(report: ProbeReport, host: HostSpec, peer: HostSpec, timeout_s: float) -> bool:
    """ARP who-has the peer from our link address; False stops the probe."""
    from linkctl.net.arp import who_has

    tries = 3
    t0 = time.perf_counter()
    try:
        macs = who_has(
            host.interface, peer.ip, src_ip=host.ip, timeout=timeout_s / tries, tries=tries
        )
    except PermissionDenied as e:
        # The only stop with exit 2 here: ARP could not even be sent (doctor relies on it).
        report.arp = ArpPart(mac=None, error=e.message)
        report.add(
            "peer arp",
            Verdict.FAIL,
            None,
            peer.ip,
            "no permission for raw sockets: run as root or grant CAP_NET_RAW",
        )
        report.stop("no permission for raw sockets (ARP): run as root or grant CAP_NET_RAW", 2)
        return False
    elapsed = time.perf_counter() - t0
    report.arp = ArpPart(
        mac=macs[0] if len(macs) == 1 else None,
        macs=macs,
        pinned=peer.mac,
        elapsed_ms=round(elapsed * 1000, 1),
    )
    if not macs:
        report.add(
            "peer arp",
            Verdict.FAIL,
            None,
            peer.ip,
            f"{peer.name} ({peer.ip}) does not answer ARP on {host.interface}",
        )
        report.stop(
            f"peer {peer.name} ({peer.ip}) is down: no ARP reply on {host.interface} within "
            f"{timeout_s:g} s (peer off, cable unplugged, or its end not set up)",
            1,
        )
        return False
    if len(macs) > 1:
        report.add(
            "peer arp",
            Verdict.FAIL,
            macs,
            peer.ip,
            f"{len(macs)} machines answer for {peer.ip}: address conflict on the segment",
        )
        report.stop(f"address conflict: {', '.join(macs)} all answer for {peer.ip}", 1)
        return False
    mac = macs[0]
    if peer.mac and mac != peer.mac:
        report.add(
            "peer mac",
            Verdict.FAIL,
            mac,
            peer.mac,
            f"{peer.ip} answers from {mac}, profile pins {peer.mac}: wrong machine or "
            "swapped cable",
        )
        report.stop(f"{peer.ip} is {mac}, not the pinned {peer.mac} of {peer.name}", 1)
        return False
    pinned = "matches the pinned MAC" if peer.mac else "no MAC pinned in the profile"
    report.add("peer arp", Verdict.PASS, mac, peer.mac, f"{peer.name} answers ({pinned})")
    return True
