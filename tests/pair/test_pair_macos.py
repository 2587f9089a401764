"""The Mac side of `linkctl pair` on recorded macOS outputs (tests/fixtures/macos,
SOURCES.md): which port is the cable, and what the Mac announces of itself."""

from __future__ import annotations

import pytest

from linkctl.core.errors import InputError
from linkctl.host import machine_facts
from linkctl.host.macos import parse_memsize
from linkctl.net.macos_parse import parse_hardware_ports, port_kind
from linkctl.pair import iface
from linkctl.pair.run import catalog_key
from support.macos_replay import argv, backend, fx, mac_studio, out


def test_the_mac_pairs_on_its_ethernet_never_on_its_wifi():
    b = backend(mac_studio())
    judged = {c.ifname: c for c in iface.survey(b)}
    # The recorded Mac already has a manual address on en0 (its owner's direct link):
    # not chosen by itself, chosen when named.
    assert judged["en0"].why == "has 10.254.100.2/16 (another network's)", judged["en0"]
    assert judged["en1"].why.startswith("holds the default route"), judged["en1"]
    assert judged["lo0"].why == judged["bridge0"].why == "is not a network port"
    assert not any(c.usable for c in judged.values())
    with pytest.raises(InputError, match=r"no interface here can be the cable: .*en0 has"):
        iface.choose(b)
    f = iface.choose(b, "en0")
    assert f.ifname == "en0" and f.kind == "wired" and f.carrier
    assert f.speed_mbps == 10000 and f.max_mtu == 16334  # listvalidMTUrange: 1280-16334
    # Named, WiFi (the default route's) is still refused; a port that is not there is
    # the backend's error, naming the ports there are.
    with pytest.raises(InputError, match="--interface en1 holds the default route"):
        iface.choose(b, "en1")
    with pytest.raises(InputError, match=r"en0 \(Ethernet\)"):
        iface.choose(b, "en9")
    assert b.runner.unexpected == [] and b.runner.changes() == []


def test_an_unplugged_port_is_not_the_cable():
    b = backend(mac_studio(ifconfig="ifconfig-en0-inactive-constructed.txt"))
    with pytest.raises(InputError, match="--interface en0 has no carrier"):
        iface.choose(b, "en0")


def test_the_networks_the_mac_uses_come_from_its_routing_table():
    nets = iface.used_networks(backend(mac_studio()), "en0")
    # Its WiFi LAN and the VPN's CGNAT range (a Tailscale route): no subnet over them.
    assert "192.168.68.0/22" in nets and "100.64.0.0/10" in nets
    assert "0.0.0.0/0" not in nets


def test_the_mac_announces_its_chip_and_memory():
    """One Mac Studio M3 Ultra (512 GB) as its owner's transcripts recorded it."""
    r = mac_studio()
    r.tools.add("sysctl")
    r.answers[argv("sysctl -n machdep.cpu.brand_string")] = out(
        "sysctl-n-machdep.cpu.brand_string-m3-ultra.txt"
    )
    r.answers[argv("sysctl hw.memsize")] = out("sysctl-hw.memsize-512gb-mac-studio-m3-ultra.txt")
    m = machine_facts("macos", r)
    assert m.os == "macos" and m.accelerator == "Apple M3 Ultra"
    assert m.memory_gb == 512.0 and m.accelerator_memory_gb is None and m.usable_gb == 512.0
    assert catalog_key(m.accelerator) == "m3-ultra"
    assert r.unexpected == []
    # The bare number of `sysctl -n hw.memsize` (a 48 GB MacBook Pro's) reads alike.
    assert parse_memsize(fx("sysctl-n-hw.memsize-48gb.txt")) == 48.0
    assert parse_memsize(fx("sysctl-hw.memsize-192gb-m2-ultra.txt")) == 192.0


def test_a_mac_studio_with_many_ports_has_one_wifi_and_one_bridge():
    ports = parse_hardware_ports(fx("networksetup-listallhardwareports-mac-studio-m4-max.txt"))
    kinds = {p.device: port_kind(p.name) for p in ports}
    assert kinds["en1"] == "wifi" and kinds["bridge0"] == "other"
    assert kinds["en0"] == kinds["en10"] == "wired"  # Ethernet, Thunderbolt Ethernet Slot 1
    assert [d for d, k in kinds.items() if k == "wifi"] == ["en1"]
