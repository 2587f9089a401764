"""Step 1: local NIC facts (carrier, speed/duplex, MTU, address) against the profile.

Facts come from the OS backend (``link_facts``) plus psutil's per-NIC error
and drop counters.
"""

from __future__ import annotations

from typing import Any

from linkctl.probe.report import ProbeReport
from linkctl.profile import HostSpec, Profile


def counters(ifname: str) -> dict[str, int] | None:
    import psutil

    c = psutil.net_io_counters(pernic=True).get(ifname)
    if c is None:
        return None
    return {"errin": c.errin, "errout": c.errout, "dropin": c.dropin, "dropout": c.dropout}


def check_nic(report: ProbeReport, profile: Profile, host: HostSpec, backend: Any) -> bool:
    """Add the NIC checks; False when the link cannot carry anything (stop the probe)."""
    facts = backend.link_facts(host.interface)  # missing interface: InputError naming others
    nic = facts.as_dict()
    nic["counters"] = counters(host.interface)
    report.nic = nic
    link = profile.link
    ifname = host.interface

    if not facts.up or not facts.carrier:
        what = "is down" if not facts.up else "has no carrier (cable unplugged or peer port down)"
        report.add("carrier", "FAIL", facts.carrier, True, f"{ifname} {what}")
        report.stop(f"{ifname} {what}; run `linkctl setup` and check the cable", 1)
        return False
    report.add("carrier", "PASS", True, True, f"{ifname} up, carrier")

    if not facts.has_address(str(host.address)):
        have = ", ".join(facts.addresses) or "none"
        report.add("address", "FAIL", have, str(host.address), f"{ifname} lacks {host.address}")
        report.stop(f"{ifname} does not have {host.address} (has: {have}); run `linkctl setup`", 1)
        return False
    report.add("address", "PASS", str(host.address), str(host.address))

    want = link.expected_speed_mbps
    if facts.speed_mbps is None:
        report.add("speed", "WARN", None, want, f"{ifname}: the OS does not report a speed")
    elif facts.speed_mbps < want:
        report.add(
            "speed",
            "FAIL",
            facts.speed_mbps,
            want,
            f"link negotiated at {_speed(facts.speed_mbps)} instead of {_speed(want)}: "
            "check the cable (CAT6A) and both ports' autonegotiation",
        )
    else:
        report.add("speed", "PASS", facts.speed_mbps, want, _speed(facts.speed_mbps))

    if facts.duplex == "half":
        report.add("duplex", "FAIL", "half", "full", "half duplex: autonegotiation failed")
    elif facts.duplex is None:
        report.add("duplex", "SKIP", None, "full", "the OS does not report duplex")
    else:
        report.add("duplex", "PASS", facts.duplex, "full")

    if facts.mtu != link.mtu:
        report.add(
            "mtu",
            "FAIL",
            facts.mtu,
            link.mtu,
            f"{ifname} MTU is {facts.mtu}, profile wants {link.mtu}: run `linkctl setup`",
        )
    else:
        report.add("mtu", "PASS", facts.mtu, link.mtu)
    return True


def _speed(mbps: int) -> str:
    return f"{mbps / 1000:g} Gbit/s" if mbps >= 1000 else f"{mbps} Mbit/s"
