"""Which interface is the cable: carrier up, wired, not the default route's, not WiFi,
no IPv4 address of another network (an address linkctl's setup put there is the
link's own). The default route's interface and WiFi are never
used, even when named with --interface."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass

from linkctl.core.errors import InputError
from linkctl.net.backend import Backend
from linkctl.net.link import configured_interfaces
from linkctl.net.netstate import LinkFacts

LINK_LOCAL_V4 = ipaddress.IPv4Network("169.254.0.0/16")


@dataclass(frozen=True)
class Candidate:
    ifname: str
    usable: bool
    why: str  # what makes it the cable, or what rules it out
    facts: LinkFacts | None = None
    error: InputError | None = None  # the backend's, when it has no such port


def _global(addresses: tuple[str, ...]) -> list[str]:
    return [a for a in addresses if ipaddress.IPv4Interface(a).ip not in LINK_LOCAL_V4]


def _judge(
    backend: Backend, ifname: str, default_if: str | None, named: bool, configured: dict[str, str]
) -> Candidate:
    if ifname == default_if:
        return Candidate(ifname, False, "holds the default route (your way out: never touched)")
    try:
        f = backend.link_facts(ifname)
    except InputError as e:
        return Candidate(ifname, False, "is not a network port", error=e)
    if f.kind == "wifi":
        return Candidate(ifname, False, "is WiFi (never touched)", f)
    if f.kind != "wired" and not named:
        return Candidate(ifname, False, "not a wired port (loopback, bridge, tunnel)", f)
    if not f.up:
        return Candidate(ifname, False, "is down (it comes up when a cable is plugged in)", f)
    if not f.carrier:
        return Candidate(ifname, False, "has no carrier (no cable, or the peer is off)", f)
    taken = _global(f.addresses)
    ours = configured.get(ifname)
    if taken and not named and not ours:
        return Candidate(ifname, False, f"has {', '.join(taken)} (another network's)", f)
    speed = f"{f.speed_mbps} Mb/s" if f.speed_mbps else "speed unknown"
    why = f"wired, carrier up, {speed}, MTU up to {f.max_mtu or f.mtu}"
    return Candidate(ifname, True, why + (f", set up by linkctl ({ours})" if ours else ""), f)


def survey(backend: Backend, interface: str | None = None) -> list[Candidate]:
    """Every interface judged (only ``interface`` when one is named)."""
    d = backend.default_route()
    default_if = d.ifname if d else None
    names = [interface] if interface else backend.interfaces()
    # A port linkctl set up (a pair run again) holds the link's own address, not another's.
    configured = configured_interfaces()
    return [_judge(backend, n, default_if, bool(interface), configured) for n in names]


def choose(backend: Backend, interface: str | None = None) -> LinkFacts:
    """The one cable; InputError (exit 2) saying why each interface was ruled out."""
    judged = survey(backend, interface)
    ok = [c for c in judged if c.usable]
    if interface:
        if not ok:
            if judged[0].error:
                raise judged[0].error  # the backend's own, naming the ports there are
            raise InputError(
                f"--interface {interface} {judged[0].why}",
                "plug the cable into a wired port and name that one",
            )
    elif len(ok) != 1:
        why = "; ".join(f"{c.ifname} {c.why}" for c in judged if c.ifname != "lo")
        if not ok:
            raise InputError(
                f"no interface here can be the cable: {why}",
                "plug the cable in (both hosts on), or name the port with --interface",
            )
        names = ", ".join(c.ifname for c in ok)
        raise InputError(
            f"{len(ok)} interfaces could be the cable: {names}",
            "name the one with the cable: --interface IF",
        )
    assert ok[0].facts is not None
    return ok[0].facts


def used_networks(backend: Backend, pairing_if: str) -> list[str]:
    """IPv4 networks this host routes, the pairing interface's excepted: the agreed
    subnet must overlap none. Every address has its connected route in the table, and
    a VPN's routes are there too."""
    nets = {r.network() for r in backend.routes() if not r.is_default and r.ifname != pairing_if}
    return [str(n) for n in sorted(nets)]
