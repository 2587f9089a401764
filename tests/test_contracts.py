"""Both OS backends held to the same contract: the types and shapes everything above
them (link, probe, CLI) relies on, so that nothing above ever branches on the OS.

Linux runs for real, read-only, in the current network namespace (interfaces,
link_facts("lo"), routes, default_route; plans are computed from given facts and
never applied). macOS runs through the replay runner on recorded outputs.
"""

from __future__ import annotations

import inspect
import ipaddress
import json
from dataclasses import fields

import pytest

from linkctl.core.profile import load_profile
from linkctl.core.runner import Runner
from linkctl.net.backend import Backend
from linkctl.net.linux import LinuxBackend
from linkctl.net.macos import MacBackend
from linkctl.net.netstate import LinkFacts, Route, TcpConn
from linkctl.net.plan import Change, Effect, Kind, Plan
from support.macos_replay import backend as mac_backend
from support.macos_replay import configured, mac_studio

OWNERS = {"networkmanager", "systemd-networkd", "networksetup", "none"}
PROF = load_profile("dgx-mac")[0]


@pytest.fixture(params=["linux", "macos"])
def case(request):
    """(backend, an interface that exists for it, the profile host it plays)."""
    if request.param == "linux":
        return LinuxBackend(Runner()), "lo", PROF.host("dgx")
    return mac_backend(mac_studio()), "en0", PROF.host("mac")


def test_backend_classes_implement_the_whole_protocol_with_the_same_signatures():
    methods = [n for n, v in vars(Backend).items() if callable(v) and not n.startswith("_")]
    assert {"interfaces", "link_facts", "routes", "default_route", "plan_setup",
            "plan_teardown", "plan_follow_up", "execute"} <= set(methods)  # fmt: skip
    for cls in (LinuxBackend, MacBackend):
        for name in methods:
            want = list(inspect.signature(getattr(Backend, name)).parameters)
            assert list(inspect.signature(getattr(cls, name)).parameters) == want, (cls, name)
    assert (LinuxBackend.os_name, MacBackend.os_name) == ("linux", "macos")


def check_facts(f: LinkFacts, ifname: str) -> None:
    assert type(f) is LinkFacts and f.ifname == ifname
    assert {x.name for x in fields(f)} == {x.name for x in fields(LinkFacts)}
    assert type(f.up) is bool and type(f.carrier) is bool
    assert type(f.mtu) is int and f.mtu > 0
    assert f.mac is None or (type(f.mac) is str and f.mac == f.mac.lower())
    assert type(f.addresses) is tuple
    for a in f.addresses:
        assert type(a) is str and "/" in a
        ipaddress.IPv4Interface(a)
    assert f.speed_mbps is None or (type(f.speed_mbps) is int and f.speed_mbps > 0)
    assert f.duplex in (None, "full", "half")
    for m in (f.min_mtu, f.max_mtu):
        assert m is None or type(m) is int
    assert f.owner in OWNERS and type(f.owner_detail) is str and type(f.media) is str
    assert f.kind in ("wired", "wifi", "other")
    json.dumps(f.as_dict())


def check_route(r: Route) -> None:
    assert type(r) is Route
    ipaddress.IPv4Network(r.dst)  # a CIDR
    assert r.gateway is None or ipaddress.IPv4Address(r.gateway)
    assert r.ifname is None or type(r.ifname) is str
    assert r.metric is None or type(r.metric) is int
    assert type(r.detail) is tuple
    assert all(type(k) is str and type(v) is str for k, v in r.detail)
    json.dumps(r.as_dict())


def check_plan(plan: Plan, *, undo_required: bool) -> None:
    assert type(plan) is Plan and type(plan.changes) is list and type(plan.notes) is list
    assert all(type(n) is str for n in plan.notes)
    d = json.loads(json.dumps(plan.as_dict()))
    assert [Change.from_dict(c) for c in d["changes"]] == plan.changes
    for c in plan.changes:
        assert type(c) is Change and c.action and c.target and c.summary
        if undo_required:
            assert type(c.undo) is Change and c.undo.summary, f"no undo: {c.summary}"
        for x in (c, c.undo) if c.undo else (c,):
            # Typed: a kind the backend executes, and the effects it declares.
            assert type(x.action) is Kind
            assert type(x.effects) is frozenset and all(type(e) is Effect for e in x.effects)
            if x.action is Kind.RUN:
                assert type(x.args["argv"]) is list and all(type(a) is str for a in x.args["argv"])


def test_interfaces(case):
    b, ifname, _ = case
    names = b.interfaces()
    assert type(names) is list and ifname in names and names == sorted(names)


def test_link_facts(case):
    b, ifname, _ = case
    check_facts(b.link_facts(ifname), ifname)


def test_routes_and_default_route(case):
    b, _, _ = case
    routes = b.routes()
    assert type(routes) is list
    for r in routes:
        check_route(r)
    d = b.default_route()
    if d is not None:
        check_route(d)
        assert d.is_default


def test_missing_interface_is_an_input_error_naming_the_others(case):
    from linkctl.core.errors import InputError

    b, _, _ = case
    with pytest.raises(InputError) as e:
        b.link_facts("nosuch9")
    assert e.value.exit_code == 2 and e.value.fix and "one of" in e.value.fix


def _before_setup(b, host) -> LinkFacts:
    if isinstance(b, LinuxBackend):
        # Given facts of an unmanaged port that is down: planning is pure, nothing runs.
        return LinkFacts(host.interface, False, False, 1500, None, ())
    return b.link_facts(host.interface)


def test_setup_plan_shape_every_change_has_its_undo(case):
    b, _, host = case
    plan = b.plan_setup(PROF.name, host, PROF.link, _before_setup(b, host))
    assert plan.changes
    check_plan(plan, undo_required=True)
    # From a 1500-MTU port without the address, the plan declares that it sets the
    # MTU and puts the address on (what link.setup's duplicate-address probe asks).
    assert plan.touches(Effect.MTU) and plan.touches(Effect.ADDRESS)


def test_a_command_change_must_declare_its_effects():
    with pytest.raises(ValueError, match="declares no effects"):
        Change(Kind.RUN, "x", "run something", {"argv": ["true"]})
    with pytest.raises(ValueError):
        Change("frobnicate", "x", "not a kind")
    # A setup record written before effects were declared still loads: netlink kinds
    # get their own effects, a command none.
    old = {"action": "addr_add", "target": "e", "summary": "s", "args": {}, "undo": None}
    assert Change.from_dict(old).effects == {Effect.ADDRESS, Effect.ROUTE}
    assert Change.from_dict({**old, "action": "run"}).effects == frozenset()


def test_teardown_and_follow_up_plans(case):
    b, _, host = case
    if isinstance(b, MacBackend):
        b = mac_backend(configured(mac_studio()))
        facts = b.link_facts(host.interface)
        check_plan(b.plan_teardown(PROF.name, host, facts), undo_required=False)
        follow = b.plan_follow_up(host, PROF.link, PROF.peers_of(host.name))
        assert all(c.effects == {Effect.ROUTE} for c in follow.changes)
    else:
        # No peers: nothing is looked up, only the shape is checked.
        follow = b.plan_follow_up(host, PROF.link, [])
    check_plan(follow, undo_required=True)


def check_conn(c: TcpConn) -> None:
    assert type(c) is TcpConn
    for a in (c.local, c.remote):
        ip, port = a.rsplit(":", 1)
        ipaddress.IPv4Address(ip)
        assert 0 < int(port) < 65536
    for x in (c.rtt_ms, c.min_rtt_ms):
        assert type(x) is float and x >= 0
    for n in (c.retrans_total, c.unacked, c.last_send_ms, c.last_recv_ms):
        assert type(n) is int and n >= 0
    json.dumps(c.as_dict())


def test_icmp_socket_groups_is_a_range_or_none(case):
    b, _, _ = case
    groups = b.icmp_socket_groups()
    if isinstance(b, MacBackend):
        assert groups is None  # any user (icmp(4))
    else:
        assert groups is not None and all(type(g) is int for g in groups), groups


def test_tcp_connections_to_nothing_is_an_empty_list(case):
    b, _, _ = case
    assert b.tcp_connections(["198.18.255.254:9"]) == []


CONN_IN_NETNS = r"""
import json, socket, sys
from linkctl.core.runner import Runner
from linkctl.net.linux import LinuxBackend
import subprocess
subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
srv = socket.create_server(("127.0.0.1", 0))
port = srv.getsockname()[1]
c = socket.create_connection(("127.0.0.1", port))
a, _ = srv.accept()
c.sendall(b"x" * 5000)
a.recv(5000)
conns = LinuxBackend(Runner()).tcp_connections([f"127.0.0.1:{port}"])
print(json.dumps([x.as_dict() for x in conns]))
"""


def test_linux_reads_a_live_connection_from_the_kernel():
    """In a network namespace of the test's own (`unshare -n`): one connection, its
    kernel figures; this machine's own network sees nothing of it."""
    import subprocess
    import sys

    from support.cli import need_root_netns

    need_root_netns()
    r = subprocess.run(
        ["unshare", "-n", sys.executable, "-c", CONN_IN_NETNS],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    conns = [TcpConn(**d) for d in json.loads(r.stdout)]
    assert len(conns) == 2, conns  # the connection seen from both of its ends
    for c in conns:
        check_conn(c)
    client = next(c for c in conns if c.bytes_sent)
    server = next(c for c in conns if c is not client)
    assert client.bytes_sent == 5001  # tcpi_bytes_acked counts the SYN too
    assert server.bytes_received == 5000 and server.local == client.remote
