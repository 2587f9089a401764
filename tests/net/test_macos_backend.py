"""The macOS backend driven through its runner against recorded macOS outputs.

No Mac is involved: a ReplayRunner answers every argv from tests/fixtures/macos/
(SOURCES.md there says which outputs are real and which are constructed) and
records the argv sequence, which these tests assert exactly. The orchestration
is the real one (linkctl.net.link.setup/teardown/status), so the transaction,
rollback and setup record are exercised as they run on a Mac.
"""

from __future__ import annotations

import json

import pytest

from linkctl.core.errors import ApplyError, CheckFailed, InputError, NeedsRoot
from linkctl.core.profile import load_profile, parse_profile
from linkctl.net import link
from linkctl.net.plan import Change
from support.macos_replay import (
    CONFIGURED,
    MTU_BACK,
    PEER,
    ROUTE_ADD,
    ROUTE_DEL,
    SETDHCP,
    SETMANUAL,
    SETMTU,
    ReplayRunner,
    Reply,
    UnexpectedCommand,
    argv,
    backend,
    configured,
    err,
    mac_studio,
    out,
)

# What link_facts(en0) runs on a fresh backend (ports, services and MTU range are
# then kept for the process); later link_facts calls run `ifconfig en0` only.
FACTS = [
    "networksetup -listallhardwareports",
    "networksetup -listnetworkserviceorder",
    "ifconfig en0",
    "networksetup -listvalidMTUrange en0",
]
PREFLIGHT = [*FACTS, "netstat -rn -f inet", "route -n get default"]
PLAN = ["networksetup -getinfo Ethernet", "networksetup -getMTU en0", "route -n get default"]
VERIFY = ["ifconfig en0", f"route -n get {PEER}", "route -n get default", "ifconfig en0"]
SETUP = [*PREFLIGHT, *PLAN, SETMTU, SETMANUAL, *VERIFY]
TEARDOWN = [*FACTS, "route -n get default", SETDHCP, MTU_BACK, "route -n get default"]
WIFI_FIRST = "networksetup-listnetworkserviceorder-wifi-first.txt"
ETHERNET_FIRST = "networksetup-listnetworkserviceorder-ethernet-first-constructed.txt"


@pytest.fixture
def prof():
    return load_profile("dgx-mac")[0]


@pytest.fixture
def mac(prof):
    return prof.host("mac")


@pytest.fixture(autouse=True)
def _isolated(tmp_path, monkeypatch):
    """Own setup records per test; the duplicate-address ARP probe (scapy on a real
    Mac) answers "nobody" and is recorded."""
    monkeypatch.setenv("LINKCTL_STATE_DIR", str(tmp_path))
    probes: list[tuple[str, str]] = []
    monkeypatch.setattr(
        link.arp, "who_has", lambda ifname, ip, **_: probes.append((ifname, ip)) or []
    )
    return probes


def cmds(runner: ReplayRunner) -> list[str]:
    assert runner.unexpected == [], f"commands with no recorded answer: {runner.unexpected}"
    return runner.commands()


def variant(prof, **mac_fields):
    data = prof.to_toml_dict()
    for h in data["hosts"]:
        if h["name"] == "mac":
            h.update(mac_fields)
    return parse_profile(data)


# ---- setup, teardown, rollback: the exact argv sequences ------------------------------


def test_setup_from_dhcp_exact_argv(prof, mac, _isolated):
    r = mac_studio()
    res = link.setup(prof, mac, backend(r))
    assert r.history == [argv(c) for c in SETUP]
    assert cmds(r) == SETUP
    assert _isolated == [("en0", "192.168.100.1")]  # duplicate-address probe before any change
    assert [c.args["argv"] for c in res.applied] == [
        ["networksetup", "-setMTU", "en0", "9000"],
        ["networksetup", "-setmanual", "Ethernet", "192.168.100.1", "255.255.255.0"],
    ]
    assert [c.undo.args["argv"] for c in res.applied] == [
        ["networksetup", "-setMTU", "en0", "1500"],
        ["networksetup", "-setdhcp", "Ethernet"],
    ]
    assert res.default_route.ifname == "en1" and res.default_route.gateway == "192.168.68.1"
    assert any("network service 'Ethernet'" in n for n in res.plan.notes)
    record = json.loads(link.record_path(prof, mac).read_text())
    assert [c["args"]["argv"][1] for c in record["applied"]] == ["-setMTU", "-setmanual"]


def test_teardown_restores_dhcp_and_mtu_from_the_record(prof, mac):
    r = mac_studio()
    link.setup(prof, mac, backend(r))
    r.history.clear()
    res = link.teardown(prof, mac, backend(r))  # a new process: a fresh backend
    assert cmds(r) == TEARDOWN
    assert [c.args["argv"] for c in res.applied] == [
        ["networksetup", "-setdhcp", "Ethernet"],
        ["networksetup", "-setMTU", "en0", "1500"],
    ]
    assert not link.record_path(prof, mac).exists()


def test_setup_from_manual_restores_the_old_manual_config_with_its_router(prof, mac):
    back = "networksetup -setmanual Ethernet 192.168.1.103 255.255.255.0 192.168.1.1"
    r = mac_studio(before="networksetup-getinfo-ethernet-manual.txt", restore=back)
    link.setup(prof, mac, backend(r))
    assert cmds(r) == SETUP
    r.history.clear()
    link.teardown(prof, mac, backend(r))
    assert cmds(r) == [*FACTS, "route -n get default", back, MTU_BACK, "route -n get default"]


def test_setup_from_ipv4_off_restores_with_setv4off(prof, mac):
    r = mac_studio(
        before="networksetup-getinfo-ipv6-only-constructed.txt",
        restore="networksetup -setv4off Ethernet",
    )
    res = link.setup(prof, mac, backend(r))
    assert res.applied[1].undo.args["argv"] == ["networksetup", "-setv4off", "Ethernet"]


def test_rollback_when_a_change_fails(prof, mac):
    r = mac_studio()
    r.answers[argv(SETMANUAL)] = Reply(
        stdout=out("networksetup-error-parameters-not-valid-constructed.txt").stdout, returncode=4
    )
    with pytest.raises(ApplyError) as e:
        link.setup(prof, mac, backend(r))
    assert e.value.exit_code == 1
    assert "rolled back" in e.value.message and "parameters were not valid" in e.value.message
    assert cmds(r) == [*PREFLIGHT, *PLAN, SETMTU, SETMANUAL, MTU_BACK]
    assert r.changes() == [SETMTU, SETMANUAL, MTU_BACK]
    assert not link.record_path(prof, mac).exists()


def test_networksetup_error_with_exit_status_0_is_still_a_failure(prof, mac):
    r = mac_studio()
    r.answers[argv(SETMANUAL)] = out("networksetup-error-parameters-not-valid-constructed.txt")
    with pytest.raises(ApplyError):
        link.setup(prof, mac, backend(r))
    assert r.changes() == [SETMTU, SETMANUAL, MTU_BACK]


@pytest.mark.parametrize("order", [WIFI_FIRST, ETHERNET_FIRST])
def test_rollback_when_the_default_route_moves(prof, mac, order):
    """The post-apply proof, also what guards an Ethernet-first service order."""
    r = mac_studio(order=order)
    # After -setmanual the default route shows up on en0 (a real output with en0).
    r.after[argv(SETMANUAL)] = {
        **CONFIGURED,
        argv("route -n get default"): out("route-n-get-default.txt"),
    }
    r.after[argv(SETDHCP)][argv("route -n get default")] = out(
        "route-n-get-default-en1-constructed.txt"
    )
    with pytest.raises(CheckFailed) as e:
        link.setup(prof, mac, backend(r))
    assert "default route changed" in e.value.message and "rolled back" in e.value.message
    assert cmds(r) == [
        *PREFLIGHT, *PLAN, SETMTU, SETMANUAL,
        "ifconfig en0", f"route -n get {PEER}", "route -n get default",
        SETDHCP, MTU_BACK,
    ]  # fmt: skip


def test_rollback_when_the_address_never_shows(prof, mac):
    r = mac_studio()
    r.after[argv(SETMANUAL)] = {}  # configd never applies it
    with pytest.raises(CheckFailed) as e:
        link.setup(prof, mac, backend(r, settle=0))
    assert "not 192.168.100.1/24 MTU 9000" in e.value.message
    assert r.changes() == [SETMTU, SETMANUAL, SETDHCP, MTU_BACK]


def test_missing_subnet_route_is_added_recorded_and_removed_on_teardown(prof, mac):
    r = mac_studio(peer_route="route-n-get-peer-via-wifi-constructed.txt")
    res = link.setup(prof, mac, backend(r))
    assert cmds(r) == [
        *PREFLIGHT, *PLAN, SETMTU, SETMANUAL,
        "ifconfig en0", f"route -n get {PEER}", ROUTE_ADD,
        "route -n get default", "ifconfig en0",
        "ifconfig en0", f"route -n get {PEER}",  # the follow-up is checked again
    ]  # fmt: skip
    assert [c.args["argv"][0] for c in res.applied] == ["networksetup", "networksetup", "route"]
    assert res.applied[-1].undo.args["argv"] == ROUTE_DEL.split()
    assert res.plan.changes[-1] == res.applied[-1]  # shown with the plan
    r.history.clear()
    link.teardown(prof, mac, backend(r))
    assert r.changes() == [ROUTE_DEL, SETDHCP, MTU_BACK]


def test_route_already_gone_at_teardown_is_not_an_error(prof, mac):
    r = mac_studio(peer_route="route-n-get-peer-via-wifi-constructed.txt")
    link.setup(prof, mac, backend(r))
    r.answers[argv(ROUTE_DEL)] = err("route-not-in-table-constructed.txt")
    link.teardown(prof, mac, backend(r))
    assert r.changes()[-3:] == [ROUTE_DEL, SETDHCP, MTU_BACK]


def test_second_setup_does_nothing(prof, mac):
    r = mac_studio()
    link.setup(prof, mac, backend(r))
    r.history.clear()
    res = link.setup(prof, mac, backend(r))
    assert res.nothing_to_do and res.applied == []
    assert r.changes() == []
    assert cmds(r) == [
        *PREFLIGHT, "networksetup -getinfo Ethernet", "networksetup -getMTU en0",
        "ifconfig en0", f"route -n get {PEER}",
    ]  # fmt: skip


def test_setup_after_a_reboot_that_dropped_the_subnet_route_repairs_it(prof, mac):
    r = configured(mac_studio(peer_route="route-n-get-peer-via-wifi-constructed.txt"))
    res = link.setup(prof, mac, backend(r))
    assert r.changes() == [ROUTE_ADD]
    assert [c.args["argv"] for c in res.applied] == [ROUTE_ADD.split()]
    record = json.loads(link.record_path(prof, mac).read_text())
    assert record["applied"][0]["undo"]["args"]["argv"] == ROUTE_DEL.split()


def test_dry_run_changes_nothing_and_shows_exact_argv(prof, mac):
    r = mac_studio()
    res = link.setup(prof, mac, backend(r, root=False), dry_run=True)
    assert r.changes() == []
    assert cmds(r) == [*PREFLIGHT, *PLAN]
    d = json.loads(json.dumps(res.as_dict()))
    assert [c["args"]["argv"] for c in d["plan"]["changes"]] == [SETMTU.split(), SETMANUAL.split()]
    assert [c["undo"]["args"]["argv"] for c in d["plan"]["changes"]] == [
        MTU_BACK.split(),
        SETDHCP.split(),
    ]
    assert any(ROUTE_ADD in n for n in d["plan"]["notes"])
    assert [Change.from_dict(c) for c in d["plan"]["changes"]] == res.plan.changes


def test_teardown_without_a_record_sets_dhcp_and_leaves_the_mtu(prof, mac):
    r = configured(mac_studio())
    res = link.teardown(prof, mac, backend(r))
    assert r.changes() == [SETDHCP]
    assert any("no setup record" in n for n in res.plan.notes)


def test_service_name_with_spaces_and_parentheses_is_one_argument(prof):
    """A renamed service ("Thunderbolt Ethernet (10G)" on the real hardware-port list
    where en0 is Wi-Fi): the name comes from the service order, never assumed."""
    svc = "Thunderbolt Ethernet (10G)"
    order = (
        "An asterisk (*) denotes that a network service is disabled.\n"
        "(1) Wi-Fi\n(Hardware Port: Wi-Fi, Device: en0)\n\n"
        f"(2) {svc}\n(Hardware Port: Thunderbolt Ethernet, Device: en5)\n"
    )
    r = ReplayRunner(answers={
        argv("networksetup -listallhardwareports"): out("networksetup-listallhardwareports.txt"),
        argv("networksetup -listnetworkserviceorder"): Reply(order),
        # en5 of this listing: active, IPv6 only
        argv("ifconfig en5"): out("ifconfig-a.txt"),
        argv("networksetup -listvalidMTUrange en5"): out(
            "networksetup-listvalidMTUrange-jumbo.txt"
        ),
        argv("netstat -rn -f inet"): out("netstat-rn-f-inet.txt"),
        argv("route -n get default"): out("route-n-get-default.txt"),
        ("networksetup", "-getinfo", svc): out("networksetup-getinfo-dhcp.txt"),
        argv("networksetup -getMTU en5"): out("networksetup-getMTU.txt"),
    })  # fmt: skip
    p = variant(prof, interface="en5")
    res = link.setup(p, p.host("mac"), backend(r), dry_run=True)
    assert [c.args["argv"] for c in res.plan.changes] == [
        ["networksetup", "-setMTU", "en5", "9000"],
        ["networksetup", "-setmanual", svc, "192.168.100.1", "255.255.255.0"],
    ]
    assert res.plan.changes[1].undo.args["argv"] == ["networksetup", "-setdhcp", svc]
    assert r.unexpected == []


# ---- verification warnings and status ------------------------------------------------------


def test_link_below_the_profile_speed_is_a_warning(prof, mac):
    r = mac_studio()
    r.after[argv(SETMANUAL)] = {
        **CONFIGURED,
        argv("ifconfig en0"): out("ifconfig-en0-linkctl-1000baseT-constructed.txt"),
    }
    res = link.setup(prof, mac, backend(r))
    assert any(n.startswith("WARN: en0 negotiated 1000 Mb/s") for n in res.plan.notes)
    st = link.status(prof, mac, backend(r))
    assert st.ok and [(d.field, d.have, d.severity) for d in st.drift] == [
        ("speed_mbps", 1000, "WARN")
    ]


def test_status_reports_the_same_fields_as_on_linux(prof, mac):
    r = configured(mac_studio())
    st = link.status(prof, mac, backend(r))
    f = st.facts
    assert (st.os, f.owner, f.owner_detail) == ("macos", "networksetup", "Ethernet")
    assert (f.addresses, f.mtu, f.speed_mbps, f.duplex) == (
        ("192.168.100.1/24",),
        9000,
        10000,
        "full",
    )
    assert f.media == "autoselect (10Gbase-T <full-duplex,flow-control>)"
    assert (f.min_mtu, f.max_mtu, f.mac) == (1280, 16334, "d0:11:e5:96:31:35")
    assert st.default_route.ifname == "en1" and st.drift == [] and st.ok
    assert cmds(r) == [*FACTS, "route -n get default"]
    json.dumps(st.as_dict())


def test_status_shows_drift_before_setup(prof, mac):
    st = link.status(prof, mac, backend(mac_studio()))
    assert {d.field for d in st.drift} == {"mtu", "address", "other_addresses"}
    assert not st.ok


def test_interfaces_and_routes(mac):
    b = backend(mac_studio())
    assert {"en0", "en1", "lo0", "bridge0"} <= set(b.interfaces())
    routes = b.routes()
    assert all("W" not in dict(r.detail)["flags"] for r in routes)  # no ARP entries
    assert next((r.dst, r.gateway, r.ifname) for r in routes if r.is_default) == (
        "0.0.0.0/0", "192.168.68.1", "en1",
    )  # fmt: skip
    sub = next(r for r in routes if r.dst == "192.168.68.0/22")
    assert (sub.gateway, sub.ifname) == (None, "en1")


def test_no_default_route(mac):
    r = mac_studio()
    r.answers[argv("route -n get default")] = err("route-not-in-table-constructed.txt")
    assert backend(r).default_route() is None


# ---- error paths: exit 2 with the fix, nothing changed ----------------------------------------


def expect_input_error(prof, host, runner, **kw) -> InputError:
    with pytest.raises(InputError) as e:
        link.setup(prof, host, backend(runner, **kw))
    assert e.value.exit_code == 2 and e.value.fix
    assert runner.changes() == [], "nothing may change"
    assert runner.unexpected == []
    return e.value


def test_interface_not_a_hardware_port_lists_them(prof):
    p = variant(prof, interface="en7")
    e = expect_input_error(p, p.host("mac"), mac_studio())
    assert "'en7' is not a hardware port" in e.message
    assert "en0 (Ethernet), en1 (Wi-Fi)" in e.message and "en0, en1" in e.fix
    # A miss reads the list again (an adapter can register late), once.
    r = mac_studio()
    b = backend(r)
    b.hardware_ports()
    with pytest.raises(InputError):
        b.link_facts("en7")
    assert cmds(r).count("networksetup -listallhardwareports") == 2


def test_service_disabled(prof, mac):
    r = mac_studio(order="networksetup-listnetworkserviceorder-ethernet-disabled-constructed.txt")
    e = expect_input_error(prof, mac, r)
    assert "'Ethernet' on en0 is disabled" in e.message
    assert "networksetup -setnetworkserviceenabled Ethernet on" in e.fix


def test_mtu_outside_the_valid_range(prof, mac):
    e = expect_input_error(prof, mac, mac_studio(mtu_range="networksetup-listvalidMTUrange.txt"))
    assert "link.mtu 9000 is outside what en0 accepts (1280-1500)" in e.message
    assert "between 1280 and 1500" in e.fix


def test_mtu_refused_by_networksetup_at_apply(prof, mac):
    r = mac_studio()
    r.answers[argv(SETMTU)] = out("networksetup-error-parameters-not-valid-constructed.txt")
    with pytest.raises(InputError) as e:
        link.setup(prof, mac, backend(r))
    assert e.value.exit_code == 2 and "en0 refused MTU 9000" in e.value.message
    assert "-listvalidMTUrange en0" in e.value.fix
    assert r.changes() == [SETMTU]  # the refused one; nothing else ran, nothing to undo


def test_networksetup_missing(prof, mac):
    r = mac_studio()
    r.tools.discard("networksetup")
    e = expect_input_error(prof, mac, r)
    assert "networksetup not found" in e.message
    assert cmds(r) == []


def test_not_root(prof, mac, _isolated):
    r = mac_studio()
    e = expect_input_error(prof, mac, r, root=False)
    assert isinstance(e, NeedsRoot)
    assert "needs root" in e.message and "sudo" in e.fix
    assert "rolled back" in e.message  # the transaction stopped at its first change


def test_link_service_ahead_of_the_default_routes_service_sets_up(prof, mac):
    """Ethernet above Wi-Fi (the Mac Studio's usual order): the link's service gets no
    router, so configd gives it no default route (ip_plugin.c); setup goes ahead, says
    why in a note, never reorders, and the default route is the same after apply."""
    r = mac_studio(order=ETHERNET_FIRST)
    res = link.setup(prof, mac, backend(r))
    assert cmds(r) == SETUP
    assert not any("-ordernetworkservices" in c for c in cmds(r))
    (note,) = [n for n in res.plan.notes if "service order" in n]
    assert "'Ethernet' (en0) is ahead of 'Wi-Fi' (en1)" in note and "no router" in note
    assert (res.default_route.ifname, res.default_route.gateway) == ("en1", "192.168.68.1")


def test_no_carrier(prof, mac):
    e = expect_input_error(prof, mac, mac_studio(ifconfig="ifconfig-en0-inactive-constructed.txt"))
    assert "en0 has no link" in e.message and "cable" in e.fix


def test_interface_with_no_network_service(prof, mac):
    r = mac_studio()
    r.answers[argv("networksetup -listnetworkserviceorder")] = Reply(
        "An asterisk (*) denotes that a network service is disabled.\n"
        "(1) Wi-Fi\n(Hardware Port: Wi-Fi, Device: en1)\n"
    )
    e = expect_input_error(prof, mac, r)
    assert "en0 (Ethernet) has no network service" in e.message
    assert "-createnetworkservice Ethernet Ethernet" in e.fix


def test_replay_runner_fails_loudly_on_an_unexpected_command():
    r = mac_studio()
    with pytest.raises(UnexpectedCommand):
        r.run(["networksetup", "-getinfo", "Wi-Fi"])
    assert r.unexpected == [("networksetup", "-getinfo", "Wi-Fi")]


def test_networksetup_refusing_for_want_of_admin_privileges(prof, mac):
    r = mac_studio()
    r.answers[argv(SETMTU)] = out("networksetup-error-admin-privileges-constructed.txt")
    with pytest.raises(NeedsRoot) as e:
        link.setup(prof, mac, backend(r))
    assert e.value.exit_code == 2 and "admin privileges" in e.value.message
    assert "sudo" in e.value.fix and r.changes() == [SETMTU]


def test_admin_privileges_output_is_needs_root_at_the_networksetup_boundary():
    """The recorded networksetup line (exit status 0) becomes NeedsRoot where
    networksetup's output is read, for any networksetup call."""
    r = mac_studio()
    r.answers[argv("networksetup -listallhardwareports")] = out(
        "networksetup-error-admin-privileges-constructed.txt"
    )
    with pytest.raises(NeedsRoot) as e:
        backend(r).hardware_ports()
    assert e.value.line() == (
        "`networksetup -listallhardwareports` failed: ** Error: Command requires admin "
        "privileges. (fix: run linkctl with sudo)"
    )
    # Any other networksetup error stays a plain InputError naming the command.
    r.answers[argv("networksetup -listallhardwareports")] = out(
        "networksetup-error-parameters-not-valid-constructed.txt"
    )
    with pytest.raises(InputError) as e2:
        backend(r).hardware_ports()
    assert not isinstance(e2.value, NeedsRoot)
    assert "The parameters were not valid" in e2.value.message
