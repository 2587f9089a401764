"""Step 1: local NIC facts (carrier, speed/duplex, MTU, address) against the profile.

Facts come from the OS backend (``link_facts``) plus psutil's per-NIC error
and drop counters.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from linkctl.core.checks import Verdict
from linkctl.core.profile import HostSpec, Profile
from linkctl.core.records import NicPart
from linkctl.net.nic_checks import nic_checks
from linkctl.probe.report import ProbeReport


def counters(ifname: str) -> dict[str, int] | None:
    import psutil

    c = psutil.net_io_counters(pernic=True).get(ifname)
    if c is None:
        return None
    return {"errin": c.errin, "errout": c.errout, "dropin": c.dropin, "dropout": c.dropout}


def check_nic(report: ProbeReport, profile: Profile, host: HostSpec, backend: Any) -> bool:
    """Add the NIC checks (linkctl.core.checks, the ones status and doctor apply); False when
    the link cannot carry anything (stop the probe)."""
    facts = backend.link_facts(host.interface)  # missing interface: InputError naming others
    report.nic = NicPart(**facts.as_dict(), counters=counters(host.interface))
    checks = nic_checks(facts, host, profile.link)
    ifname = host.interface

    # The probe has always called the interface check "carrier".
    iface = dataclasses.replace(checks["interface"], name="carrier")
    report.checks.append(iface)
    if iface.verdict is Verdict.FAIL:
        report.stop(f"{iface.detail}; run `linkctl setup` and check the cable", 1)
        return False
    report.checks.append(checks["address"])
    if checks["address"].verdict is Verdict.FAIL:
        have = ", ".join(facts.addresses) or "none"
        report.stop(f"{ifname} does not have {host.address} (has: {have}); run `linkctl setup`", 1)
        return False
    report.checks.extend(checks[n] for n in ("speed", "duplex", "mtu"))
    return True
