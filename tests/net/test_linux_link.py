"""The Linux backend on real namespaces: setup, idempotence, teardown, rollback,
and every safety check refusing with exit 2 and no change."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest
import tomli_w

from support.cli import error_lines
from support.lab import ns_snapshot


def ipn(lab, host, *args):
    """`ip` inside a lab host's namespace: the test's own hands, independent of linkctl."""
    return subprocess.run(
        ["ip", "-n", lab.netns(host), *args], capture_output=True, text=True, check=True
    )


def setup_json(lab, host, *extra):
    r = lab.run(host, "setup", "--json", *extra)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def variant(lab, tmp_path, name, fn):
    data = tomllib.loads(Path(lab.profile_path).read_text())
    fn(data)
    path = tmp_path / f"{name}.toml"
    path.write_text(tomli_w.dumps(data))
    return str(path)


def default_route(lab, host):
    return json.loads(ipn(lab, host, "-j", "-4", "route", "show", "default").stdout)


def test_setup_both_ends_then_traffic_passes(lab):
    routes_before = {h: default_route(lab, h) for h in ("dgx", "mac")}
    for host in ("mac", "dgx"):
        res = setup_json(lab, host)
        assert not res["nothing_to_do"]
        assert [c["action"] for c in res["applied"]] == ["set_mtu", "link_up", "addr_add"]
    for host in ("dgx", "mac"):
        st = lab.run(host, "status", "--json")
        assert st.returncode == 0, st.stdout
        facts = json.loads(st.stdout)["facts"]
        assert facts["mtu"] == 9000 and facts["up"] and facts["carrier"]
        assert facts["addresses"] == [lab.host(host)["address"]]
        assert facts["speed_mbps"] == 10000  # veth reports 10G through ethtool
        # The default route is still wifi's, the same object as before.
        assert default_route(lab, host) == routes_before[host]
        # No route through the link other than the connected subnet.
        link_routes = json.loads(
            ipn(lab, host, "-j", "-4", "route", "show", "dev", lab.host(host)["interface"]).stdout
        )
        assert [r["dst"] for r in link_routes] == ["198.18.100.0/24"]
        assert all("gateway" not in r for r in link_routes)
    # A real TCP connection across the link, inside the namespaces.
    server = subprocess.Popen(
        [
            "ip",
            "netns",
            "exec",
            lab.netns("dgx"),
            "python3",
            "-c",
            "import socket; s=socket.socket();"
            " s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1);"
            "s.bind(('198.18.100.2', 50999)); s.listen(1); print('ready', flush=True);"
            "c,_=s.accept(); c.sendall(c.recv(100).upper()); c.close()",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert server.stdout.readline().strip() == "ready"
        out = subprocess.run(
            [
                "ip",
                "netns",
                "exec",
                lab.netns("mac"),
                "python3",
                "-c",
                "import socket; c=socket.create_connection(('198.18.100.2', 50999), timeout=5);"
                "c.sendall(b'over the link'); print(c.recv(100).decode())",
            ],
            capture_output=True,
            text=True,
            timeout=20,
        )
        assert out.stdout.strip() == "OVER THE LINK", out.stderr
    finally:
        server.kill()
        server.wait()


def test_second_setup_changes_nothing(lab):
    setup_json(lab, "dgx")
    before = ns_snapshot(lab.netns("dgx"))
    again = setup_json(lab, "dgx")
    assert again["nothing_to_do"] and again["applied"] == []
    assert ns_snapshot(lab.netns("dgx")) == before
    text = lab.run("dgx", "setup")
    assert "nothing to do" in text.stdout


def test_dry_run_prints_plan_and_changes_nothing(lab):
    before = ns_snapshot(lab.netns("dgx"))
    res = setup_json(lab, "dgx", "--dry-run")
    assert res["dry_run"] and len(res["plan"]["changes"]) == 3
    assert all(c["undo"] for c in res["plan"]["changes"])
    assert ns_snapshot(lab.netns("dgx")) == before


def test_teardown_restores_exact_prior_state(lab):
    before = {h: ns_snapshot(lab.netns(h)) for h in ("dgx", "mac")}
    for h in ("dgx", "mac"):
        setup_json(lab, h)
    assert ns_snapshot(lab.netns("dgx")) != before["dgx"]
    for h in ("dgx", "mac"):
        r = lab.run(h, "teardown", "--json")
        assert r.returncode == 0, r.stderr
        assert [c["action"] for c in json.loads(r.stdout)["applied"]] == [
            "addr_del",
            "link_down",
            "set_mtu",
        ]
    for h in ("dgx", "mac"):
        assert ns_snapshot(lab.netns(h)) == before[h]
    # Teardown again: nothing recorded, nothing of ours present.
    r = lab.run("dgx", "teardown", "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["nothing_to_do"]


def test_teardown_without_record_removes_only_our_address(lab):
    setup_json(lab, "dgx")
    ipn(lab, "dgx", "addr", "add", "198.18.100.77/24", "dev", "enP7s7")  # not ours
    import os
    import pathlib

    state = pathlib.Path(os.environ["LINKCTL_STATE_DIR"]) / "lab" / lab.name / "hosts" / "dgx"
    for rec in (state / "links").glob("*.json"):
        rec.unlink()
    r = lab.run("dgx", "teardown", "--json")
    assert r.returncode == 0, r.stderr
    snap = ns_snapshot(lab.netns("dgx"))
    assert ("enP7s7", "198.18.100.77", 24) in snap["addrs"]
    assert ("enP7s7", "198.18.100.2", 24) not in snap["addrs"]


@pytest.mark.parametrize("fault", ["set_mtu", "link_up", "addr_add"])
def test_rollback_after_injected_fault_restores_prior_state(lab, fault):
    before = ns_snapshot(lab.netns("dgx"))
    r = lab.exec(
        "dgx", "env", f"LINKCTL_INJECT_FAULT={fault}", sys.executable, "-m", "linkctl", "setup"
    )
    assert r.returncode == 1, r.stdout + r.stderr
    assert "injected fault" in r.stderr and "rolled back" in r.stderr
    assert ns_snapshot(lab.netns("dgx")) == before
    # No record was written: a later teardown has nothing to undo.
    t = lab.run("dgx", "teardown", "--json")
    assert json.loads(t.stdout)["nothing_to_do"]


def refused(lab, host, profile_path, must_say):
    before = {h: ns_snapshot(lab.netns(h)) for h in ("dgx", "mac")}
    r = lab.exec(host, "linkctl", "setup", "--profile", profile_path)
    assert r.returncode == 2, r.stdout + r.stderr
    lines = error_lines(r.stderr)
    assert len(lines) == 1 and must_say in lines[0], r.stderr
    assert "Traceback" not in r.stderr
    for h in ("dgx", "mac"):
        assert settled_snapshot(lab.netns(h), before[h]) == before[h], h
    return lines[0]


def settled_snapshot(netns, expected, within_s=3.0):
    # The kernel applies carrier changes to the *peer's* routes (the `linkdown` flag)
    # from its linkwatch work queue, up to a second after our own link goes back down;
    # poll briefly so the comparison sees the settled state, not the in-flight one.
    deadline = time.monotonic() + within_s
    snap = ns_snapshot(netns)
    while snap != expected and time.monotonic() < deadline:
        time.sleep(0.1)
        snap = ns_snapshot(netns)
    return snap


def test_refuses_missing_interface(lab, tmp_path):
    p = variant(lab, tmp_path, "missing", lambda d: d["hosts"][0].update(interface="enP9s9"))
    line = refused(lab, "dgx", p, "'enP9s9' does not exist")
    assert "enP7s7" in line and "wlan0" in line  # lists the ones that exist


def test_refuses_default_route_interface(lab, tmp_path):
    p = variant(lab, tmp_path, "uplink", lambda d: d["hosts"][0].update(interface="wlan0"))
    refused(lab, "dgx", p, "carries the default route")


def test_refuses_overlapping_subnet(lab, tmp_path):
    # The host's "wifi LAN" is itself the link subnet: 198.19.1.0/24 here.
    def overlap(d):
        d["link"]["subnet"] = "198.19.1.0/24"
        d["hosts"][0]["address"] = "198.19.1.20/24"
        d["hosts"][1]["address"] = "198.19.1.21/24"

    p = variant(lab, tmp_path, "overlap", overlap)
    refused(lab, "dgx", p, "overlaps 198.19.1.0/24 already routed through wlan0")


def test_refuses_address_in_use_on_segment(lab):
    # Someone on the segment (the mac end) already answers for the dgx's address.
    ipn(lab, "mac", "link", "set", "en0", "up")
    ipn(lab, "mac", "addr", "add", "198.18.100.2/24", "dev", "en0")
    refused(lab, "dgx", lab.profile_path, "already answered on the segment")


def test_refuses_address_in_use_when_link_already_up(lab):
    ipn(lab, "dgx", "link", "set", "enP7s7", "up")
    ipn(lab, "mac", "link", "set", "en0", "up")
    ipn(lab, "mac", "addr", "add", "198.18.100.2/24", "dev", "en0")
    refused(lab, "dgx", lab.profile_path, "already answered on the segment")


def test_refuses_mtu_the_device_rejects(lab, tmp_path):
    # A macvlan cannot exceed its lower device's MTU (1500 here): the kernel refuses 9000.
    ipn(
        lab,
        "dgx",
        "link",
        "add",
        "link",
        "enP7s7",
        "name",
        "mv5",
        "type",
        "macvlan",
        "mode",
        "bridge",
    )
    p = variant(lab, tmp_path, "macvlan", lambda d: d["hosts"][0].update(interface="mv5"))
    line = refused(lab, "dgx", p, "MTU 9000")
    assert "refused" in line or "outside what mv5 accepts" in line
