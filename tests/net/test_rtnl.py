"""linkctl.net.rtnl (the read-only rtnetlink reader behind the Linux backend's facts) reads
what two independent readers see: pyroute2 and `ip -j`, in a real lab namespace with
more state than linkctl itself makes (a secondary address, a gatewayed route with a
metric, a route in another table); its ethtool speed/duplex reads what psutil reads."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.netns

# Runs inside the namespace; prints what each reader sees, as JSON.
COMPARE = r"""
import json, socket
import psutil
from pyroute2 import IPRoute
from linkctl.net import rtnl

ipr = IPRoute()
def link(l):
    return [l["index"], l.get("IFLA_IFNAME"), l["flags"], l.get("IFLA_MTU"),
            bool(l.get("IFLA_CARRIER")), l.get("IFLA_ADDRESS"),
            l.get("IFLA_MIN_MTU") or None, l.get("IFLA_MAX_MTU") or None]
def route(r):
    return [r.get("RTA_TABLE", r["table"]), r.get("RTA_DST"), r["dst_len"], r.get("RTA_GATEWAY"),
            r.get("RTA_OIF"), r.get("RTA_PRIORITY"), r.get("RTA_PREFSRC"), r["proto"],
            r["scope"], r["type"], r["flags"]]
out = {
    "pyroute2": {
        "links": sorted(link(l) for l in ipr.get_links()),
        "addrs": sorted([a["index"], a["prefixlen"], a.get("IFA_ADDRESS")]
                        for a in ipr.get_addr(family=socket.AF_INET)),
        "routes": sorted(map(repr, map(route, ipr.get_routes(family=socket.AF_INET)))),
        "get": ipr.route("get", dst="198.18.200.9")[0].get("RTA_OIF"),
    },
    "rtnl": {
        "links": sorted([l.index, l.name, l.flags, l.mtu, l.carrier, l.mac, l.min_mtu, l.max_mtu]
                        for l in rtnl.links()),
        "addrs": sorted([a.index, a.prefixlen, a.address] for a in rtnl.ipv4_addrs()),
        "routes": sorted(repr([r.table, r.dst, r.dst_len, r.gateway, r.oif, r.priority, r.prefsrc,
                               r.proto, r.scope, r.type, r.flags]) for r in rtnl.ipv4_routes()),
        "get": rtnl.route_get("198.18.200.9").oif,
    },
}
duplex = {psutil.NIC_DUPLEX_FULL: "full", psutil.NIC_DUPLEX_HALF: "half"}
nics = psutil.net_if_stats()
out["speed"] = {
    "psutil": {n: [s.speed or None, duplex.get(s.duplex)] for n, s in nics.items()},
    "rtnl": {n: list(rtnl.link_speed(n)) for n in nics},
}
try:
    rtnl.route_get("203.0.113.9")
    out["unreachable"] = None
except OSError as e:
    out["unreachable"] = e.errno
print(json.dumps(out))
"""


def test_rtnl_reads_what_pyroute2_and_ip_read(make_lab):
    lab = make_lab("dgx-mac")
    for host in ("mac", "dgx"):
        assert lab.run(host, "setup").returncode == 0
    ns = lab.netns("dgx")

    def ip(*a: str) -> str:
        return subprocess.run(
            ["ip", "-n", ns, *a], capture_output=True, text=True, check=True
        ).stdout

    ip("addr", "add", "198.18.100.77/24", "dev", "enP7s7")  # a secondary address
    ip("route", "add", "198.18.200.0/24", "via", "198.18.100.1", "metric", "50")
    ip("route", "add", "198.18.201.0/24", "dev", "enP7s7", "table", "100")
    ip("route", "del", "default")  # so 203.0.113.9 (TEST-NET-3) has no route at all
    r = subprocess.run(
        ["ip", "netns", "exec", ns, sys.executable, "-c", COMPARE],
        capture_output=True,
        text=True,
        check=True,
    )
    seen = json.loads(r.stdout)
    assert seen["rtnl"] == seen["pyroute2"]
    mine = seen["rtnl"]
    # ... and what iproute2 shows.
    links = {lk["ifindex"]: lk for lk in json.loads(ip("-j", "link", "show"))}
    assert {lk[0]: (lk[1], lk[3], lk[5]) for lk in mine["links"]} == {
        i: (lk["ifname"], lk["mtu"], lk["address"]) for i, lk in links.items()
    }
    addrs = sorted(
        [links_i, a["prefixlen"], a["local"]]
        for lk in json.loads(ip("-j", "-4", "addr", "show"))
        for links_i in [lk["ifindex"]]
        for a in lk["addr_info"]
    )
    assert mine["addrs"] == addrs and [3, 24, "198.18.100.77"] in addrs
    assert len(mine["routes"]) == len(json.loads(ip("-j", "-4", "route", "show", "table", "all")))
    assert any("100, '198.18.201.0', 24" in r for r in mine["routes"])
    assert any("'198.18.200.0', 24, '198.18.100.1', 3, 50" in r for r in mine["routes"])
    assert links[mine["get"]]["ifname"] == "enP7s7"
    assert json.loads(ip("-j", "route", "get", "198.18.200.9"))[0]["dev"] == "enP7s7"
    assert seen["unreachable"] == 101  # ENETUNREACH, as `ip route get` reports it
    assert seen["speed"]["rtnl"] == seen["speed"]["psutil"]
    assert seen["speed"]["rtnl"]["enP7s7"] == [10000, "full"]  # veth reports 10G full
