"""The Mac side of `linkctl pair` on recorded macOS outputs (tests/fixtures/macos,
SOURCES.md): which port is the cable, and what the Mac announces of itself."""

from __future__ import annotations

import pytest

from linkctl.core.errors import InputError
from linkctl.host import machine_facts
from linkctl.pair import iface
from linkctl.pair.run import catalog_key
from support.macos_replay import argv, backend, mac_studio, out


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
    r = mac_studio()
    r.tools.add("sysctl")
    r.answers[argv("sysctl -n machdep.cpu.brand_string")] = out(
        "sysctl-n-machdep.cpu.brand_string-m2-ultra.txt"
    )
    r.answers[argv("sysctl -n hw.memsize")] = out("sysctl-n-hw.memsize-48gb.txt")
    m = machine_facts("macos", r)
    assert m.os == "macos" and m.accelerator == "Apple M2 Ultra"
    # (the memory output is another Mac's: no 128 GB `sysctl -n hw.memsize` was found)
    assert m.memory_gb == 48.0 and m.accelerator_memory_gb is None and m.usable_gb == 48.0
    assert catalog_key(m.accelerator) == "m2-ultra"
    assert r.unexpected == []
