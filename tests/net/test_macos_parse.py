"""The macOS output parsers against recorded real outputs (tests/fixtures/macos/SOURCES.md)."""

from __future__ import annotations

import pytest

from linkctl.net.macos_parse import (
    HardwarePort,
    MtuRange,
    MtuSetting,
    NetworkService,
    media_speed,
    netstat_dst,
    networksetup_error,
    parse_get_mtu,
    parse_getinfo,
    parse_hardware_ports,
    parse_ifconfig,
    parse_media,
    parse_mtu_range,
    parse_netstat_inet,
    parse_route_get,
    parse_service_order,
)
from support.macos_replay import fx

# ---- networksetup ------------------------------------------------------------------


def test_hardware_ports_ethernet_and_wifi():
    assert parse_hardware_ports(fx("networksetup-listallhardwareports-ethernet-en0.txt")) == [
        HardwarePort("Ethernet", "en0", "c4:2c:03:0c:5f:e9"),
        HardwarePort("Wi-Fi", "en1", "f8:1e:df:e8:46:66"),
    ]


def test_hardware_ports_with_spaces_redacted_macs_leading_blank_and_vlan_trailer():
    ports = parse_hardware_ports(fx("networksetup-listallhardwareports.txt"))
    assert [(p.name, p.device) for p in ports] == [
        ("Wi-Fi", "en0"),
        ("Thunderbolt 1", "en1"),
        ("Thunderbolt 2", "en2"),
        ("Bluetooth PAN", "en3"),
        ("iPhone USB", "en4"),
        ("Thunderbolt Ethernet", "en5"),
        ("Thunderbolt Bridge", "bridge0"),
    ]
    assert all(p.mac is None for p in ports)  # "Redacted" is not a MAC


def test_service_order_names_with_spaces_parentheses_and_an_empty_device():
    services = parse_service_order(fx("networksetup-listnetworkserviceorder.txt"))
    assert services == [
        NetworkService("Belkin USB-C LAN", "Belkin USB-C LAN", "en7", True, 1),
        NetworkService("Wi-Fi", "Wi-Fi", "en0", True, 2),
        NetworkService("iPhone USB", "iPhone USB", "en6", True, 3),
        NetworkService("Thunderbolt Bridge", "Thunderbolt Bridge", "bridge0", True, 4),
        NetworkService("VPN (L2TP)", "L2TP", "", True, 5),
    ]


def test_service_order_wifi_first():
    services = parse_service_order(fx("networksetup-listnetworkserviceorder-wifi-first.txt"))
    assert [(s.name, s.device, s.position) for s in services] == [
        ("Wi-Fi", "en1", 1),
        ("Ethernet", "en0", 2),
        ("FireWire", "fw0", 3),
    ]


def test_service_order_disabled_service():
    # constructed: "(*) Ethernet", the marker as a real listing prints it
    text = fx("networksetup-listnetworkserviceorder-ethernet-disabled-constructed.txt")
    eth = [s for s in parse_service_order(text) if s.device == "en0"]
    assert eth == [NetworkService("Ethernet", "Ethernet", "en0", False, 2)]


def test_service_order_renamed_service_with_parentheses_and_comma_in_port():
    text = (
        "An asterisk (*) denotes that a network service is disabled.\n"
        "(1) Ethernet (10G) direct\n"
        "(Hardware Port: Ethernet Slot 1, Port 1, Device: en8)\n"
    )
    assert parse_service_order(text) == [
        NetworkService("Ethernet (10G) direct", "Ethernet Slot 1, Port 1", "en8", True, 1)
    ]


def test_getinfo_dhcp():
    info = parse_getinfo(fx("networksetup-getinfo-dhcp.txt"))
    assert (info.method, info.ip, info.mask, info.router) == (
        "dhcp",
        "10.0.1.140",
        "255.255.255.0",
        "10.0.1.1",
    )
    assert info.client_id is None and info.ipv6 == "Off"


def test_getinfo_dhcp_without_a_lease_inactive_service():
    info = parse_getinfo(fx("networksetup-getinfo-dhcp-no-address.txt"))
    assert (info.method, info.ip, info.mask, info.router, info.client_id) == (
        "dhcp",
        None,
        None,
        None,
        None,  # "Client ID: " with a trailing space
    )
    assert info.ipv6 == "Automatic" and info.ipv6_address is None


def test_getinfo_manual_with_router():
    info = parse_getinfo(fx("networksetup-getinfo-ethernet-manual.txt"))
    assert (info.method, info.header, info.ip, info.mask, info.router, info.ether) == (
        "manual",
        "Manual Configuration",
        "192.168.1.103",
        "255.255.255.0",
        "192.168.1.1",
        "d0:11:e5:32:84:ce",
    )


def test_getinfo_ipv6_only_service_has_no_ipv4_method():
    info = parse_getinfo(fx("networksetup-getinfo-ipv6-only-constructed.txt"))
    assert (info.method, info.header, info.ip) == (None, None, None)
    assert info.ipv6 == "Automatic"


@pytest.mark.parametrize("router_line", ["", "Router: none\n", "Router: (null)\n", "Router: \n"])
def test_getinfo_blank_router_spellings(router_line):
    text = "Manual Configuration\nIP address: 192.168.100.1\nSubnet mask: 255.255.255.0\n"
    text += router_line
    info = parse_getinfo(text)
    assert (info.method, info.ip, info.router) == ("manual", "192.168.100.1", None)


def test_getinfo_other_methods():
    assert parse_getinfo("BOOTP Configuration\n").method == "bootp"
    info = parse_getinfo("Manually Using DHCP Router Configuration\nIP address: 10.0.0.5\n")
    assert (info.method, info.ip) == ("manual-dhcp-router", "10.0.0.5")
    odd = parse_getinfo("Frobnicated Configuration\nIP address: 10.0.0.5\n")
    assert (odd.method, odd.header) == (None, "Frobnicated Configuration")


def test_get_mtu_and_valid_range():
    assert parse_get_mtu(fx("networksetup-getMTU.txt")) == MtuSetting(1500, 1500)
    assert parse_mtu_range(fx("networksetup-listvalidMTUrange.txt")) == MtuRange(1280, 1500)
    assert parse_mtu_range(fx("networksetup-listvalidMTUrange-jumbo.txt")) == MtuRange(1280, 16334)
    assert parse_get_mtu("garbage") is None and parse_mtu_range("") is None


def test_networksetup_error_lines():
    assert networksetup_error(fx("networksetup-error-parameters-not-valid-constructed.txt")) == (
        "** Error: The parameters were not valid."
    )
    text = "NoSuch is not a recognized network service.\n** Error: The parameters were not valid.\n"
    assert networksetup_error(text).startswith("NoSuch is not a recognized network service.")
    assert networksetup_error(fx("networksetup-getinfo-dhcp.txt")) is None


# ---- ifconfig --------------------------------------------------------------------------


def test_ifconfig_10gbase_t_en0():
    en0 = parse_ifconfig(fx("ifconfig-10gbase-t-mac-mini-m4.txt"))["en0"]
    assert (en0.up, en0.carrier, en0.mtu, en0.ether) == (True, True, 1500, "d0:11:e5:96:31:35")
    assert en0.inet == ("10.254.100.2/16",)
    assert en0.inet6 == ("fe80::1885:6e74:1e1e:e717%en0",)
    assert en0.media.raw == "autoselect (10Gbase-T <full-duplex,flow-control>)"
    assert (en0.media.subtype, en0.media.speed_mbps, en0.media.duplex) == (
        "10Gbase-T",
        10000,
        "full",
    )
    assert en0.status == "active"


def test_ifconfig_single_block_equals_block_in_full_listing():
    one = parse_ifconfig(fx("ifconfig-en0-10gbase-t-mac-mini-m4.txt"))
    assert list(one) == ["en0"]
    assert one["en0"] == parse_ifconfig(fx("ifconfig-10gbase-t-mac-mini-m4.txt"))["en0"]


def test_ifconfig_full_listing_keeps_every_interface_and_skips_bridge_members():
    ifs = parse_ifconfig(fx("ifconfig-10gbase-t-mac-mini-m4.txt"))
    assert {"lo0", "en0", "en1", "bridge0", "anpi0", "utun3"} <= set(ifs)
    assert ifs["bridge0"].media.raw == "<unknown type>" and ifs["bridge0"].media.speed_mbps is None
    assert ifs["en5"].carrier is False and ifs["en5"].media.raw == "none"
    lo0 = ifs["lo0"]
    assert (lo0.inet, lo0.status, lo0.carrier, lo0.media) == (("127.0.0.1/8",), None, True, None)


def test_ifconfig_1000baset_tabs_and_unknown_type():
    ifs = parse_ifconfig(fx("ifconfig-a-1000baseT.txt"))
    assert ifs["en0"].media.speed_mbps == 1000
    assert ifs["en0"].inet == ("192.168.142.136/28",)
    en1 = ifs["en1"]
    assert (en1.media.raw, en1.media.speed_mbps, en1.carrier) == (
        "autoselect (<unknown type>)",
        None,
        False,
    )


def test_ifconfig_wifi_and_ipv6_only_interfaces():
    wifi = parse_ifconfig(fx("ifconfig-en0-wifi.txt"))["en0"]
    assert wifi.inet == ("10.7.23.16/19",) and wifi.media.speed_mbps is None
    ifs = parse_ifconfig(fx("ifconfig-a.txt"))
    assert ifs["en5"].inet == () and ifs["en5"].inet6  # IPv6 only
    assert len(ifs["en0"].inet6) == 4 and ifs["en0"].inet == ("192.168.1.72/24",)
    assert ifs["XHC20"].mtu == 0


@pytest.mark.parametrize(
    "raw, subtype, speed, duplex",
    [
        ("autoselect (10Gbase-T <full-duplex,flow-control>)", "10Gbase-T", 10000, "full"),
        ("10Gbase-T <full-duplex>", "10Gbase-T", 10000, "full"),
        ("autoselect (1000baseT <full-duplex,flow-control>)", "1000baseT", 1000, "full"),
        ("autoselect (100baseTX <half-duplex>)", "100baseTX", 100, "half"),
        ("autoselect (2500Base-T <full-duplex>)", "2500Base-T", 2500, "full"),
        ("autoselect (5GBase-T <full-duplex>)", "5GBase-T", 5000, "full"),
        ("autoselect", None, None, None),
        ("autoselect <full-duplex>", None, None, None),  # a setting, no active media
        ("autoselect (<unknown type>)", None, None, None),
        ("<unknown type>", None, None, None),
        ("none", None, None, None),
        ("autoselect (10G-ER-frobnicator <full-duplex>)", "10G-ER-frobnicator", None, "full"),
        ("((( <<", "((( <<", None, None),
        ("", None, None, None),
    ],
)
def test_media_spellings_never_crash(raw, subtype, speed, duplex):
    m = parse_media(raw)
    assert (m.subtype, m.speed_mbps, m.duplex) == (subtype, speed, duplex)
    assert m.raw == raw.strip()


def test_media_speed():
    assert media_speed("10Gbase-T") == 10000
    assert media_speed("1000baseT") == 1000
    assert media_speed("unknown") is None and media_speed(None) is None


# ---- route / netstat ---------------------------------------------------------------------


def test_route_get_default():
    rg = parse_route_get(fx("route-n-get-default.txt"))
    assert (rg.destination, rg.gateway, rg.interface, rg.mtu) == (
        "default",
        "10.7.0.1",
        "en0",
        1500,
    )
    assert rg.flags == ("UP", "GATEWAY", "DONE", "STATIC", "PRCLONING", "GLOBAL")


def test_route_get_default_legacy_without_trailing_newline():
    rg = parse_route_get(fx("route-n-get-default-legacy.txt"))
    assert (rg.gateway, rg.interface, rg.mtu) == ("10.160.24.1", "en0", 1500)
    assert "GLOBAL" not in rg.flags


def test_route_get_on_link_host_has_no_gateway():
    rg = parse_route_get(fx("route-get-host-llinfo.txt"))
    assert (rg.route_to, rg.destination, rg.gateway, rg.interface) == (
        "192.168.1.1",
        "192.168.1.1",
        None,
        "en0",
    )
    assert "LLINFO" in rg.flags


def test_route_get_not_in_table():
    assert parse_route_get(fx("route-not-in-table-constructed.txt")) is None
    assert parse_route_get("") is None


@pytest.mark.parametrize(
    "printed, cidr",
    [
        ("default", "0.0.0.0/0"),
        ("127", "127.0.0.0/8"),
        ("169.254", "169.254.0.0/16"),
        ("192.168.0", "192.168.0.0/24"),
        ("192.168.0.1", "192.168.0.1/32"),
        ("192.168.0.1/32", "192.168.0.1/32"),
        ("224.0.0/4", "224.0.0.0/4"),
        ("0/1", "0.0.0.0/1"),
        ("128.0/1", "128.0.0.0/1"),
        ("10.37.129/24", "10.37.129.0/24"),
        ("100.64/10", "100.64.0.0/10"),
        ("fe80::%lo0/64", None),
        ("link#5", None),
    ],
)
def test_netstat_destinations(printed, cidr):
    assert netstat_dst(printed) == cidr


def test_netstat_old_format_with_refs_use():
    routes = parse_netstat_inet(fx("netstat-rn-f-inet.txt"))
    assert len(routes) == 13
    d = routes[0]
    assert (d.dst, d.gateway, d.flags, d.netif) == ("0.0.0.0/0", "192.168.0.1", "UGSc", "en0")
    arp = next(r for r in routes if r.destination == "192.168.0.1")
    assert (arp.flags, arp.netif, arp.expire) == ("UHLWIir", "en0", "1163")


def test_netstat_vpn_split_default():
    routes = parse_netstat_inet(fx("netstat-rn-f-inet-vpn.txt"))
    assert [(r.dst, r.netif) for r in routes[:3]] == [
        ("0.0.0.0/1", "utun3"),
        ("0.0.0.0/0", "en0"),
        ("10.0.0.0/8", "utun3"),
    ]


def test_netstat_modern_format_mac_studio_wifi_on_en1():
    routes = parse_netstat_inet(fx("netstat-rn-inet-section-mac-studio.txt"))
    assert len(routes) == 47
    assert [(r.dst, r.gateway, r.netif) for r in routes if r.dst == "0.0.0.0/0"] == [
        ("0.0.0.0/0", "192.168.68.1", "en1"),
        ("0.0.0.0/0", "link#32", "utun4"),
        ("0.0.0.0/0", "link#38", "bridge100"),
        ("0.0.0.0/0", "link#40", "bridge101"),
    ]
    sub = next(r for r in routes if r.destination == "192.168.68/22")
    assert (sub.dst, sub.netif, sub.expire) == ("192.168.68.0/22", "en1", "!")


def test_netstat_rnl_with_mtu_column_stops_at_internet6():
    routes = parse_netstat_inet(fx("netstat-rnl.txt"))
    assert len(routes) == 30
    assert all(":" not in r.dst for r in routes)
    vm = next(r for r in routes if r.destination == "192.168.71")
    assert (vm.netif, vm.expire) == ("vmnet8", "!")
