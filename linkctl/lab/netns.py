"""The lab: network namespaces standing in for the profile's hosts.

One namespace per host, joined by a veth pair named like the real ports (a
bridge in a "switch" namespace when there are more than two hosts), plus a
"wifi" namespace acting as the router that gives every host its default
route over a separate interface. Addresses are remapped into 198.18.0.0/15
(RFC 2544 benchmarking space) and the remapped profile is written out, so
no lab packet can reach a real network. A macOS host is stood in for by a
Linux namespace.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import re
import shutil
import signal
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import tomli_w

from linkctl.core.errors import InputError
from linkctl.core.paths import state_dir
from linkctl.core.profile import Profile, parse_profile
from linkctl.trust import secret

WIFI_IF = "wlan0"
# Every lab host shares this machine's CPUs with everything else running: a
# 1000-sample p99 round trip lands at 0.5-2 ms from preemption alone on a busy
# 2-core machine. The lab profile holds the tail to 5 ms; the profile's own limit
# (500 us in the shipped ones) is for the real cable.
LAB_RTT_P99_US = 5000.0
# The lab's cable is a veth pair: it moves whatever the shared CPU has left (12-30
# Gbit/s on a quiet 2-core machine, ~5.6 Gbit/s for one stream with both cores busy).
# The lab's floor is 2 Gbit/s: far below that, yet far above a shaped or broken link.
LAB_MIN_THROUGHPUT_GBPS = 2.0
NAME_RE_MAX = 12  # lab names stay short: namespace and interface names derive from them


@dataclass
class LabHost:
    name: str
    netns: str
    interface: str
    address: str  # remapped link address, CIDR
    wifi_address: str
    gateway: str


@dataclass
class Lab:
    name: str
    profile: str  # the original profile's name
    profile_path: str  # the remapped profile written for --profile
    hosts: list[LabHost]
    wifi_netns: str
    switch_netns: str | None
    root: str

    def host(self, name: str) -> LabHost:
        for h in self.hosts:
            if h.name == name:
                return h
        raise InputError(
            f"lab {self.name!r} has no host {name!r}",
            f"use one of: {', '.join(h.name for h in self.hosts)}",
        )

    def host_state_dir(self, name: str) -> Path:
        return Path(self.root) / "hosts" / name

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def lab_root(name: str) -> Path:
    return state_dir() / "lab" / name


def _check_name(name: str) -> None:
    if not name.replace("-", "").isalnum() or len(name) > NAME_RE_MAX:
        raise InputError(
            f"lab name {name!r} is not usable",
            f"use up to {NAME_RE_MAX} letters, digits or dashes",
        )


def _no_unwinding_in_forks() -> None:
    """pyroute2 forks short-lived children (netns creation, netns sockets) and stops
    them with SIGTERM; a terminal's Ctrl-C reaches them too. A child that inherited a
    Python handler (KeyboardInterrupt included) would unwind its copy of the parent's
    stack and run the parent's cleanup: it once deleted a running demo's namespaces.
    In a fork, such a signal takes its default action instead: the child just dies."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        if callable(signal.getsignal(sig)):
            signal.signal(sig, signal.SIG_DFL)


os.register_at_fork(after_in_child=_no_unwinding_in_forks)


def remap_subnet(profile: Profile) -> ipaddress.IPv4Network:
    """The lab's link subnet: same prefix length, inside 198.18.0.0/15."""
    prefix = profile.link.subnet.prefixlen
    base = "198.18.100.0" if prefix >= 24 else "198.18.0.0"
    return ipaddress.IPv4Network(f"{base}/{prefix}")


def remap_profile(profile: Profile) -> Profile:
    """The same profile with every link address moved into the lab subnet (host part
    kept), every device the CPU, the RTT tail limit at LAB_RTT_P99_US and the
    throughput floor at LAB_MIN_THROUGHPUT_GBPS."""
    old, new = profile.link.subnet, remap_subnet(profile)
    data = profile.to_toml_dict()
    data["name"] = f"{profile.name}-lab"
    data["description"] = f"lab copy of {profile.name}: addresses remapped into {new}"
    data["link"]["subnet"] = str(new)
    probe = data.setdefault("probe", {})
    probe["max_rtt_p99_us"] = max(probe.get("max_rtt_p99_us", 0), LAB_RTT_P99_US)
    probe["min_throughput_gbps"] = min(
        probe.get("min_throughput_gbps", LAB_MIN_THROUGHPUT_GBPS), LAB_MIN_THROUGHPUT_GBPS
    )
    for h in data["hosts"]:
        ip = ipaddress.IPv4Interface(h["address"])
        offset = int(ip.ip) - int(old.network_address)
        h["address"] = f"{new.network_address + offset}/{new.prefixlen}"
        h.pop("mac", None)  # the namespaces have their own MACs
        # Every lab host is this machine's CPU running the CPU build of llama.cpp.
        h["device"] = "cpu"
        h["rpc"].pop("bind", None)
    return parse_profile(data, "lab profile")


def load_lab(name: str) -> Lab:
    path = lab_root(name) / "lab.json"
    if not path.is_file():
        raise InputError(f"lab {name!r} is not up", f"run `linkctl lab up --name {name}`")
    d = json.loads(path.read_text())
    d["hosts"] = [LabHost(**h) for h in d["hosts"]]
    return Lab(**d)


def plan(profile: Profile, name: str = "lab") -> Lab:
    """The lab `up` would make, changing nothing; refuses a bad name or a lab already up."""
    from pyroute2 import netns

    _check_name(name)
    root = lab_root(name)
    if (root / "lab.json").exists() or any(
        ns.startswith(f"lk-{name}-") for ns in netns.listnetns()
    ):
        raise InputError(
            f"lab {name!r} is already up", f"run `linkctl lab down --name {name}` first"
        )
    prefix = f"lk-{name}-"
    hosts = []
    for i, h in enumerate(remap_profile(profile).hosts, start=1):
        wifi_net = ipaddress.IPv4Network(f"198.19.{i}.0/24")
        hosts.append(
            LabHost(
                name=h.name,
                netns=prefix + h.name,
                interface=h.interface,
                address=str(h.address),
                wifi_address=f"{wifi_net.network_address + 2}/24",
                gateway=str(wifi_net.network_address + 1),
            )
        )
    switch_ns = prefix + "sw" if len(profile.hosts) > 2 else None
    return Lab(
        name, profile.name, str(root / "profile.toml"), hosts, prefix + "wifi", switch_ns, str(root)
    )


def namespaces(lab: Lab) -> list[str]:
    """The lab's namespaces, in the order `up` creates them."""
    return [lab.wifi_netns, *([lab.switch_netns] if lab.switch_netns else [])] + [
        h.netns for h in lab.hosts
    ]


def up(profile: Profile, name: str = "lab") -> Lab:
    """Create the namespaces, links and routes. Refuses if the lab already exists."""
    from pyroute2 import IPRoute, netns

    lab = plan(profile, name)
    lab_profile = remap_profile(profile)
    root, hosts = Path(lab.root), lab.hosts
    created: list[str] = []
    try:
        for ns in namespaces(lab):
            netns.create(ns)
            created.append(ns)
            with IPRoute(netns=ns) as ipr:
                ipr.link("set", index=ipr.link_lookup(ifname="lo")[0], state="up")
            _set_lab_sysctls(ns)
        _wire_wifi(lab)
        wire_link(lab)
        root.mkdir(parents=True, exist_ok=True)
        # One pair secret for the lab's hosts, as `linkctl pair` leaves on a real pair.
        key = secret.generate()
        for lh in hosts:
            lab.host_state_dir(lh.name).mkdir(parents=True, exist_ok=True)
            secret.store(lab_profile.name, key, lab.host_state_dir(lh.name))
        Path(lab.profile_path).write_text(
            f"# written by `linkctl lab up --name {name}` from profile {profile.name}\n"
            + tomli_w.dumps(lab_profile.to_toml_dict())
        )
        (root / "lab.json").write_text(json.dumps(lab.as_dict(), indent=2))
    except BaseException:
        for ns in created:
            _remove_netns(ns)
        shutil.rmtree(root, ignore_errors=True)
        raise
    return lab


# The lab's hosts as ones where every group may open datagram ICMP sockets (systemd's
# 50-default.conf, shipped by Debian 13's linux-sysctl-defaults; Debian 12 has "1 0"
# and the serve unit's watch then says WARN with this setting to make, see
# linkctl.net.echo). Written in the lab's own namespaces only; this machine's value
# stays (tests/net/test_echo.py, tests/support/boot_kit.host_snapshot).
LAB_SYSCTLS = {"net/ipv4/ping_group_range": "0 2147483647"}


def _set_lab_sysctls(ns: str) -> None:
    with inside(ns):
        for key, value in LAB_SYSCTLS.items():
            Path("/proc/sys", key).write_text(value)


def _wire_wifi(lab: Lab) -> None:
    from pyroute2 import IPRoute

    for i, h in enumerate(lab.hosts, start=1):
        router_if = f"wh{i}"
        with IPRoute(netns=lab.wifi_netns) as ipr:
            ipr.link(
                "add", ifname=router_if, kind="veth", peer={"ifname": WIFI_IF, "net_ns_fd": h.netns}
            )
            idx = ipr.link_lookup(ifname=router_if)[0]
            ipr.addr("add", index=idx, address=h.gateway, prefixlen=24)
            ipr.link("set", index=idx, state="up")
        with IPRoute(netns=h.netns) as ipr:
            idx = ipr.link_lookup(ifname=WIFI_IF)[0]
            wifi = ipaddress.IPv4Interface(h.wifi_address)
            ipr.addr("add", index=idx, address=str(wifi.ip), prefixlen=24)
            ipr.link("set", index=idx, state="up")
            ipr.route("add", dst="0.0.0.0/0", gateway=h.gateway, oif=idx)
    # veth operstate turns UP asynchronously; wait so the lab is settled when
    # `lab up` returns (tests compare state before/after).
    for h in lab.hosts:
        with IPRoute(netns=h.netns) as ipr:
            idx = ipr.link_lookup(ifname=WIFI_IF)[0]
            deadline = time.monotonic() + 5
            while (
                ipr.get_links(idx)[0].get("IFLA_OPERSTATE") != "UP" and time.monotonic() < deadline
            ):
                time.sleep(0.02)


def wire_link(lab: Lab) -> None:
    """The direct cable (two hosts) or a switch. Host ends start down at MTU 1500,
    like a freshly plugged port; setup is what brings them up."""
    from pyroute2 import IPRoute

    if lab.switch_netns is None:
        a, b = lab.hosts
        with IPRoute(netns=a.netns) as ipr:
            ipr.link(
                "add",
                ifname=a.interface,
                kind="veth",
                peer={"ifname": b.interface, "net_ns_fd": b.netns},
            )
        return
    with IPRoute(netns=lab.switch_netns) as ipr:
        ipr.link("add", ifname="br0", kind="bridge")
        br = ipr.link_lookup(ifname="br0")[0]
        for i, h in enumerate(lab.hosts, start=1):
            port = f"p{i}"
            ipr.link(
                "add", ifname=port, kind="veth", peer={"ifname": h.interface, "net_ns_fd": h.netns}
            )
            idx = ipr.link_lookup(ifname=port)[0]
            # A jumbo-capable switch port, so the hosts' MTUs decide.
            ipr.link("set", index=idx, mtu=9216, master=br, state="up")
        ipr.link("set", index=br, mtu=9216, state="up")


def _netns_pids(ns: str) -> list[int]:
    try:
        target = os.stat(f"/run/netns/{ns}").st_ino
    except FileNotFoundError:
        return []
    pids = []
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                if os.stat(p / "ns" / "net").st_ino == target:
                    pids.append(int(p.name))
            except OSError:
                continue
    return pids


def _remove_netns(ns: str) -> None:
    from pyroute2 import netns

    for sig in (signal.SIGTERM, signal.SIGKILL):
        pids = _netns_pids(ns)
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        deadline = time.monotonic() + 3
        while pids and time.monotonic() < deadline and _netns_pids(ns):
            time.sleep(0.05)
    if ns in netns.listnetns():
        netns.remove(ns)


@dataclass
class DownPlan:
    """What `down` removes: the lab's namespaces (and the processes in them) and its
    directory in the state dir."""

    namespaces: list[str]
    processes: dict[str, list[int]]  # by namespace: the pids that get SIGTERM, then SIGKILL
    root: str | None  # the lab's directory, when it exists

    @property
    def items(self) -> list[str]:
        return self.namespaces + ([self.root] if self.root else [])


def down_plan(name: str = "lab") -> DownPlan:
    from pyroute2 import netns

    _check_name(name)
    found = sorted(ns for ns in netns.listnetns() if ns.startswith(f"lk-{name}-"))
    root = lab_root(name)
    return DownPlan(
        found, {ns: _netns_pids(ns) for ns in found}, str(root) if root.exists() else None
    )


def down(name: str = "lab") -> list[str]:
    """Kill every process in the lab's namespaces, delete them and the lab's files.
    Idempotent: returns what it removed (empty when nothing was up)."""
    p = down_plan(name)
    for ns in p.namespaces:
        _remove_netns(ns)
    if p.root:
        shutil.rmtree(p.root)
    return p.items


@contextlib.contextmanager
def inside(netns_name: str) -> Iterator[None]:
    """Sockets this thread opens inside the block belong to ``netns_name`` (setns on
    the calling thread; restored on exit, also on an exception or Ctrl-C)."""
    from pyroute2 import netns

    netns.pushns(netns_name)
    try:
        yield
    finally:
        netns.popns()


def parse_rate(text: str) -> int:
    """``--rate`` as bits/s: a number with kbit, mbit or gbit (tc's spelling)."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([kmg]?)bit", text.strip().lower())
    bps = float(m.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[m.group(2)] if m else 0
    if not 1e6 <= bps <= 100e9:
        raise InputError(
            f"--rate {text!r} is not a rate between 1mbit and 100gbit",
            "write it as tc does, e.g. --rate 1gbit or --rate 500mbit",
        )
    return int(bps)


def shape(lab: Lab, rate_bps: int) -> None:
    """A tbf qdisc on every host's link port: each direction of the link is held to
    ``rate_bps``. The burst covers one kernel tick (250 Hz) at that rate."""
    from pyroute2 import NetNS

    burst = max(64 * 1024, rate_bps // 8 // 250)
    for h in lab.hosts:
        with NetNS(h.netns) as ns:
            idx = ns.link_lookup(ifname=h.interface)[0]
            ns.tc(
                "add",
                "tbf",
                index=idx,
                handle="1:",
                rate=rate_bps // 8,
                burst=burst,
                latency="50ms",
            )


def exec_argv(lab: Lab, host: str, argv: list[str]) -> tuple[list[str], dict[str, str]]:
    """argv and environment that run ``argv`` inside ``host``'s namespace, with
    LINKCTL_PROFILE/LINKCTL_HOST/LINKCTL_STATE_DIR set for that host."""
    h = lab.host(host)
    if not argv:
        raise InputError(
            "lab exec needs a command after --", "e.g. linkctl lab exec dgx -- linkctl status"
        )
    if argv[0] == "linkctl":
        # The same linkctl as the caller, whatever PATH says inside the namespace.
        argv = [sys.executable, "-m", "linkctl", *argv[1:]]
    env = dict(os.environ)
    env.update(
        LINKCTL_PROFILE=lab.profile_path,
        LINKCTL_HOST=h.name,
        LINKCTL_STATE_DIR=str(lab.host_state_dir(h.name)),
        LINKCTL_LAB=lab.name,
    )
    return ["ip", "netns", "exec", h.netns, *argv], env


def reset_port(lab: Lab, host: str) -> None:
    """What a reboot does to a host's NIC: no address, MTU 1500, down. (A lab host's
    port lives in its namespace, which outlives the processes that configured it.)"""
    from pyroute2 import IPRoute

    h = lab.host(host)
    with IPRoute(netns=h.netns) as ipr:
        idx = ipr.link_lookup(ifname=h.interface)
        if not idx:
            return
        ipr.flush_addr(index=idx[0])
        ipr.link("set", index=idx[0], state="down", mtu=1500)
