"""The NIC checks `linkctl status`, `probe` and `doctor` all apply, so they cannot
disagree: ``nic_checks`` judges one interface's facts (linkctl.net.netstate.LinkFacts)
against the profile: interface (up, carrier), speed, duplex, address, mtu. status turns the
non-passing ones into drift, probe adds them to its report (stopping when the link
cannot carry anything), doctor prints them as lines.

The speed rule: a link that negotiated below ``link.expected_speed_mbps`` (or whose
OS does not say) is a WARN everywhere, never a FAIL. Negotiated speed is a cause, not
the effect that matters: what `serve` needs is measured throughput and latency, and
the probe FAILs on those against the profile's own minimums (probe.min_throughput_gbps,
8 Gbit/s in the shipped profiles, which a 1 Gbit/s link cannot reach). A link that
negotiated lower but meets every measured minimum does what the profile asks, and
status/doctor, which measure nothing, cannot know; they name the likely cause (the
cable) instead.
"""

from __future__ import annotations

from typing import Any

from linkctl.core.checks import Check, Verdict
from linkctl.core.profile import HostSpec, LinkSpec
from linkctl.net.netstate import LinkFacts

SETUP_FIX = "linkctl setup"


def speed_text(mbps: int) -> str:
    return f"{mbps / 1000:g} Gbit/s" if mbps >= 1000 else f"{mbps} Mbit/s"


def nic_checks(facts: LinkFacts, host: HostSpec, link: LinkSpec) -> dict[str, Check]:
    """The checks of one interface against the profile, by name: interface, speed,
    duplex, address, mtu (callers choose the order they show them in)."""
    ifname = facts.ifname
    out: dict[str, Check] = {}

    def add(
        name: str, verdict: Verdict, value: Any, want: Any, detail: str, fix: str | None = None
    ) -> None:
        out[name] = Check(name, verdict, value, want, detail, fix)

    if not facts.up:
        add(
            "interface", Verdict.FAIL, "down", "up", f"{ifname} is administratively down", SETUP_FIX
        )
    elif not facts.carrier:
        add(
            "interface",
            Verdict.FAIL,
            "no carrier",
            "up",
            f"{ifname} is up but has no carrier (cable unplugged or the peer's port down)",
            "check the cable, and run `linkctl setup` on the peer",
        )
    else:
        add("interface", Verdict.PASS, "up", "up", f"{ifname} up, carrier, MAC {facts.mac}")

    want = link.expected_speed_mbps
    if not facts.carrier:
        add("speed", Verdict.SKIP, None, want, "no carrier: no negotiated speed")
        add("duplex", Verdict.SKIP, None, "full", "no carrier: no negotiated duplex")
    else:
        if facts.speed_mbps is None:
            add(
                "speed",
                Verdict.WARN,
                None,
                want,
                f"the OS does not report {ifname}'s speed (profile expects {speed_text(want)})",
                "measure it instead: `linkctl probe` (throughput)",
            )
        elif facts.speed_mbps < want:
            add(
                "speed",
                Verdict.WARN,
                facts.speed_mbps,
                want,
                f"{ifname} negotiated at {speed_text(facts.speed_mbps)} instead of "
                f"{speed_text(want)}",
                "check the cable (CAT6A for 10GBASE-T) and both ports' autonegotiation",
            )
        else:
            got = f"{speed_text(facts.speed_mbps)} (want {speed_text(want)})"
            add("speed", Verdict.PASS, facts.speed_mbps, want, got)
        if facts.duplex == "half":
            add(
                "duplex",
                Verdict.FAIL,
                "half",
                "full",
                f"{ifname} is at half duplex: autonegotiation failed",
                "check the cable and set both ports to autonegotiate",
            )
        elif facts.duplex is None:
            add("duplex", Verdict.SKIP, None, "full", "the OS does not report duplex")
        else:
            add("duplex", Verdict.PASS, facts.duplex, "full", "")

    addr = str(host.address)
    have = list(facts.addresses)
    extra = [a for a in have if a != addr]
    if not facts.has_address(addr):
        add(
            "address",
            Verdict.FAIL,
            have,
            addr,
            f"{ifname} lacks {addr} (has: {', '.join(have) or 'no IPv4 address'})",
            SETUP_FIX,
        )
    elif extra:
        add(
            "address",
            Verdict.WARN,
            have,
            addr,
            f"{ifname} has {addr} and also {', '.join(extra)}",
            f"remove the other addresses from {ifname} (another profile's setup? "
            "`linkctl teardown --profile THAT`)",
        )
    else:
        add("address", Verdict.PASS, addr, addr, f"on {ifname}")

    if facts.mtu != link.mtu:
        detail = f"{ifname} MTU is {facts.mtu}, profile wants {link.mtu}"
        add("mtu", Verdict.FAIL, facts.mtu, link.mtu, detail, SETUP_FIX)
    else:
        add("mtu", Verdict.PASS, facts.mtu, link.mtu, f"as profiled ({link.mtu})")
    return out
