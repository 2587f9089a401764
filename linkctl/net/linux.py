"""Linux backend: runtime state through netlink, persistence through NetworkManager.

No shelling out to ``ip``: state is read with linkctl.net.rtnl (a small rtnetlink reader,
so read-only commands never import pyroute2) and changed with pyroute2, imported
only when a change is executed. NetworkManager (which owns the device on DGX
OS/Ubuntu) is driven with ``nmcli`` through the command runner, because a
bare netlink address on an NM-managed device is flushed by NM and lost at
reboot.
"""

from __future__ import annotations

import errno
import ipaddress
import os
import socket
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from linkctl.core.errors import ApplyError, CheckFailed, InputError
from linkctl.core.profile import HostSpec, LinkSpec
from linkctl.core.runner import CommandFailed, Runner
from linkctl.net import rtnl
from linkctl.net.netstate import LinkFacts, Route, TcpConn
from linkctl.net.plan import ALL_EFFECTS, Change, Kind, Plan

if TYPE_CHECKING:
    from pyroute2 import IPRoute
    from pyroute2.netlink.exceptions import NetlinkError

MAIN_TABLE = 254
IFF_UP = 0x1
_PROTO = {2: "kernel", 3: "boot", 4: "static", 16: "dhcp", 186: "bgp", 196: "ra"}
_SCOPE = {0: "universe", 200: "site", 253: "link", 254: "host", 255: "nowhere"}
# What an NM activation does to the device (and deleting an active connection, or
# adding one with autoconnect, which NM may activate at once): all of it.
NM_ACTIVATION = ALL_EFFECTS
NMCLI_NOT_FOUND = 10  # nmcli(1) exit status: connection, device or access point does not exist
# The system bus's default socket (dbus-daemon(1)); /var/run is a link to /run on Debian.
DBUS_SYSTEM_SOCKETS = ("/run/dbus/system_bus_socket", "/var/run/dbus/system_bus_socket")


def _system_bus_present() -> bool:
    """Whether nmcli could reach any NetworkManager: nmcli talks to NM over the D-Bus
    system bus only (DBUS_SYSTEM_BUS_ADDRESS, else the default socket), so without
    that socket NM manages nothing here and spawning nmcli is skipped."""
    addr = os.environ.get("DBUS_SYSTEM_BUS_ADDRESS")
    if not addr:
        return any(os.path.exists(p) for p in DBUS_SYSTEM_SOCKETS)
    paths = [
        part.split("=", 1)[1]
        for entry in addr.split(";")
        for part in entry.split(":", 1)[-1].split(",")
        if entry.startswith("unix:") and part.startswith("path=")
    ]
    # Other transports (abstract sockets, tcp) cannot be checked cheaply: ask nmcli.
    return not paths or any(os.path.exists(p) for p in paths)


@contextmanager
def _ipr():
    from pyroute2 import IPRoute

    ipr = IPRoute()
    try:
        yield ipr
    finally:
        ipr.close()


def nm_connection_name(profile: str) -> str:
    return f"linkctl-{profile}"


def link_kind(ifname: str, sys_net: Path = Path("/sys/class/net")) -> str:
    """wired/wifi/other from sysfs (read only; `ip netns exec` mounts the namespace's
    own): ``wireless``/``phy80211`` mark a WiFi device (cfg80211), ``type`` 1 is
    ARPHRD_ETHER (include/uapi/linux/if_arp.h); bridges, bonds and tunnels are other."""
    d = sys_net / ifname
    if (d / "wireless").exists() or (d / "phy80211").exists():
        return "wifi"
    if any((d / sub).exists() for sub in ("bridge", "bonding", "tun_flags")):
        return "other"
    try:
        arphrd = int((d / "type").read_text().strip())
    except (OSError, ValueError):
        return "other"
    return "wired" if arphrd == 1 else "other"


# linux/tcp_states.h TCP_ESTABLISHED = 1, as a state bitmask; linux/inet_diag.h
# INET_DIAG_INFO = 2, requested as bit (2 - 1).
_TCP_ESTABLISHED = 1 << 1
_INET_DIAG_INFO = 1 << 1


def _sock_diag(states: int, extensions: int) -> tuple[Any, ...]:
    """This network namespace's IPv4 TCP sockets in ``states`` (sock_diag, as `ss`
    reads them). pyroute2 is imported here only: serve's watch asks, the read-only
    commands never do."""
    from pyroute2 import DiagSocket

    with DiagSocket() as ds:
        ds.bind()
        return tuple(ds.get_sock_stats(family=socket.AF_INET, states=states, extensions=extensions))


class LinuxBackend:
    os_name = "linux"

    def __init__(self, runner: Runner):
        self.runner = runner
        # Who manages each interface (nmcli costs a process): asked once per interface
        # and forgotten whenever a change is executed, so carrier polls spawn nothing.
        self._owners: dict[str, tuple[str, str]] = {}

    # ---- facts -------------------------------------------------------------

    def interfaces(self) -> list[str]:
        return sorted(link.name for link in rtnl.links())

    @staticmethod
    def _link(ifname: str) -> rtnl.Link:
        all_links = rtnl.links()
        for link in all_links:
            if link.name == ifname:
                return link
        raise InputError(
            f"interface {ifname!r} does not exist here",
            f"set hosts.interface to one of: {', '.join(sorted(lk.name for lk in all_links))}",
        )

    def link_facts(self, ifname: str) -> LinkFacts:
        link = self._link(ifname)
        addrs = tuple(f"{a.address}/{a.prefixlen}" for a in rtnl.ipv4_addrs(link.index))
        carrier = link.carrier
        # Speed and duplex mean something only with a carrier (ethtool ioctl, this netns).
        speed, duplex = rtnl.link_speed(ifname) if carrier else (None, None)
        if ifname not in self._owners:
            self._owners[ifname] = self._owner(ifname, link.index)
        owner, detail = self._owners[ifname]
        return LinkFacts(
            ifname=ifname,
            up=bool(link.flags & IFF_UP),
            carrier=carrier,
            mtu=link.mtu,
            mac=link.mac,
            addresses=addrs,
            speed_mbps=speed,
            duplex=duplex,
            min_mtu=link.min_mtu,
            max_mtu=link.max_mtu,
            owner=owner,
            owner_detail=detail,
            kind=link_kind(ifname),
        )

    def routes(self) -> list[Route]:
        names = {link.index: link.name for link in rtnl.links()}
        out = []
        for r in rtnl.ipv4_routes():
            if r.table != MAIN_TABLE:
                continue
            detail = {
                "proto": _PROTO.get(r.proto, str(r.proto)),
                "scope": _SCOPE.get(r.scope, str(r.scope)),
                "type": str(r.type),
                "prefsrc": r.prefsrc or "",
                "flags": str(r.flags),
            }
            out.append(
                Route(
                    dst=f"{r.dst or '0.0.0.0'}/{r.dst_len}",
                    gateway=r.gateway,
                    ifname=names.get(r.oif) if r.oif is not None else None,
                    metric=r.priority,
                    detail=tuple(sorted(detail.items())),
                )
            )
        return out

    def tcp_connections(self, ends: list[str]) -> list[TcpConn]:
        # linux/inet_diag.h: INET_DIAG_INFO carries struct tcp_info.
        want = set(ends)
        out = []
        for m in _sock_diag(_TCP_ESTABLISHED, _INET_DIAG_INFO):
            local = f"{m['idiag_src']}:{m['idiag_sport']}"
            remote = f"{m['idiag_dst']}:{m['idiag_dport']}"
            info = m.get_attr("INET_DIAG_INFO")
            if not {local, remote} & want or info is None:
                continue
            out.append(
                TcpConn(
                    local=local,
                    remote=remote,
                    rtt_ms=info["tcpi_rtt"] / 1000,
                    min_rtt_ms=info["tcpi_min_rtt"] / 1000,
                    retrans_total=info["tcpi_total_retrans"],
                    unacked=info["tcpi_unacked"],
                    last_send_ms=info["tcpi_last_data_sent"],
                    last_recv_ms=info["tcpi_last_data_recv"],
                    bytes_sent=info["tcpi_bytes_acked"],
                    bytes_received=info["tcpi_bytes_received"],
                )
            )
        return sorted(out, key=lambda c: (c.remote, c.local))

    def ping_argv(self, address: str, **kw: Any) -> list[str]:
        """argv for iputils ping (see linkctl.net.ping: size, count, timeout_s, interval_s,
        dont_fragment)."""
        from linkctl.net.ping import linux_ping_argv

        return linux_ping_argv(address, **kw)

    def icmp_socket_groups(self) -> tuple[int, int] | None:
        """net.ipv4.ping_group_range as this network namespace has it (ip-sysctl.rst)."""
        from linkctl.net.echo import group_range

        return group_range()

    def default_route(self) -> Route | None:
        defaults = [r for r in self.routes() if r.is_default]
        # Lowest metric wins, as the kernel picks it.
        return min(defaults, key=lambda r: r.metric or 0) if defaults else None

    def _owner(self, ifname: str, index: int) -> tuple[str, str]:
        if self.runner.which("nmcli") and _system_bus_present():
            res = self.runner.run(
                ["nmcli", "-t", "-g", "GENERAL.STATE,GENERAL.CONNECTION", "device", "show", ifname],
                check=False,
                timeout=10,
            )
            if res.ok:
                lines = [*res.stdout.splitlines(), "", ""]
                state, conn = lines[0], lines[1]
                if "unmanaged" not in state:
                    return "networkmanager", conn
        netif = Path(f"/run/systemd/netif/links/{index}")
        if netif.is_file() and "NETWORK_FILE=" in netif.read_text():
            return "systemd-networkd", ""
        return "none", ""

    # ---- plans -------------------------------------------------------------

    def plan_setup(self, profile: str, host: HostSpec, link: LinkSpec, facts: LinkFacts) -> Plan:
        if facts.owner == "networkmanager":
            return self._plan_nm(profile, host, link, facts)
        return self._plan_netlink(host, link, facts)

    def _plan_netlink(self, host: HostSpec, link: LinkSpec, facts: LinkFacts) -> Plan:
        ifname = host.interface
        plan = Plan()
        if facts.owner == "systemd-networkd":
            plan.notes.append(
                f"{ifname} is managed by systemd-networkd: runtime state only; "
                "install the boot service (`linkctl service install`) so it survives a reboot"
            )
        if facts.mtu != link.mtu:
            plan.changes.append(self._mtu_change(ifname, facts.mtu, link.mtu))
        if not facts.up:
            plan.changes.append(
                Change(
                    Kind.LINK_UP,
                    ifname,
                    f"{ifname}: bring up",
                    undo=Change(Kind.LINK_DOWN, ifname, f"{ifname}: bring down"),
                )
            )
        addr = str(host.address)
        if not facts.has_address(addr):
            args = {"address": host.ip, "prefixlen": host.address.network.prefixlen}
            plan.changes.append(
                Change(
                    Kind.ADDR_ADD,
                    ifname,
                    f"{ifname}: add {addr} (no gateway, no default route)",
                    args,
                    undo=Change(Kind.ADDR_DEL, ifname, f"{ifname}: remove {addr}", args),
                )
            )
        return plan

    @staticmethod
    def _mtu_change(ifname: str, old: int, new: int) -> Change:
        return Change(
            Kind.SET_MTU,
            ifname,
            f"{ifname}: MTU {old} -> {new}",
            {"mtu": new},
            undo=Change(Kind.SET_MTU, ifname, f"{ifname}: MTU {new} -> {old}", {"mtu": old}),
        )

    def _plan_nm(self, profile: str, host: HostSpec, link: LinkSpec, facts: LinkFacts) -> Plan:
        ifname, con = host.interface, nm_connection_name(profile)
        plan = Plan(
            notes=[f"{ifname} is managed by NetworkManager: persisting as connection {con}"]
        )
        want = {
            "ipv4.method": "manual",
            "ipv4.addresses": str(host.address),
            "ipv4.gateway": "",
            "ipv4.never-default": "yes",
            "ipv6.method": "disabled",
            # The canonical name: `nmcli -g` rejects the `ethernet.` alias that `add` accepts.
            "802-3-ethernet.mtu": str(link.mtu),
            "connection.autoconnect": "yes",
        }
        settings = [x for kv in want.items() for x in kv]
        have = self._nm_settings(con, list(want))
        if have is None:
            plan.changes.append(
                Change(
                    Kind.RUN,
                    con,
                    f"NetworkManager: add connection {con} on {ifname} "
                    f"({host.address}, MTU {link.mtu}, never-default)",
                    {
                        "argv": [
                            "nmcli",
                            "connection",
                            "add",
                            "type",
                            "ethernet",
                            "ifname",
                            ifname,
                            "con-name",
                            con,
                            *settings,
                        ]
                    },
                    undo=Change(
                        Kind.RUN,
                        con,
                        f"NetworkManager: delete connection {con}",
                        {"argv": ["nmcli", "connection", "delete", con]},
                        effects=NM_ACTIVATION,
                    ),
                    effects=NM_ACTIVATION,
                )
            )
        elif any(have.get(k, "") != v for k, v in want.items() if k != "ipv4.gateway"):
            old = [x for k in want for x in (k, have.get(k, ""))]
            plan.changes.append(
                # A modified profile reaches the device only at its next activation
                # (nmcli(1), connection modify): no runtime effect by itself.
                Change(
                    Kind.RUN,
                    con,
                    f"NetworkManager: update connection {con} to the profile",
                    {"argv": ["nmcli", "connection", "modify", con, *settings]},
                    undo=Change(
                        Kind.RUN,
                        con,
                        f"NetworkManager: restore connection {con}",
                        {"argv": ["nmcli", "connection", "modify", con, *old]},
                        effects=frozenset(),
                    ),
                    effects=frozenset(),
                )
            )
        runtime_ok = facts.has_address(str(host.address)) and facts.mtu == link.mtu and facts.up
        if plan.changes or facts.owner_detail != con or not runtime_ok:
            prev = facts.owner_detail
            if prev and prev != con and self._nm_volatile(prev):
                # NM's in-memory "Wired connection N" (a keyfile under /run, remade at
                # every boot, its name then perhaps another device's): after a reboot
                # `connection up NAME` fails (seen under a real systemd,
                # tests/test_boot.py), so NM chooses again, as it did before setup.
                back = ["nmcli", "device", "connect", ifname]
            elif prev and prev != con:
                back = ["nmcli", "connection", "up", prev, "ifname", ifname]
            else:
                back = ["nmcli", "device", "disconnect", ifname]
            plan.changes.append(
                Change(
                    Kind.RUN,
                    con,
                    f"NetworkManager: activate {con} on {ifname}",
                    {"argv": ["nmcli", "connection", "up", con, "ifname", ifname]},
                    undo=Change(
                        Kind.RUN,
                        con,
                        f"NetworkManager: {' '.join(back[1:3])} {back[3]}",
                        {"argv": back},
                        effects=NM_ACTIVATION,
                    ),
                    effects=NM_ACTIVATION,
                )
            )
        return plan

    def _nm_volatile(self, con: str) -> bool:
        """Whether NM keeps ``con`` only in /run (generated, gone at reboot)."""
        res = self.runner.run(
            ["nmcli", "-t", "-f", "NAME,FILENAME", "connection", "show"], check=False, timeout=15
        )
        for line in res.stdout.splitlines():
            name, _, filename = line.replace("\\:", "\0").partition(":")
            if name.replace("\0", ":") == con:
                return filename.replace("\0", ":").startswith("/run/")
        return False

    def _nm_settings(self, con: str, keys: list[str]) -> dict[str, str] | None:
        """The connection's settings, or None when NM has no connection of that name.
        Any other failure is an error: guessing "absent" would add a duplicate."""
        res = self.runner.run(
            ["nmcli", "-t", "-g", ",".join(keys), "connection", "show", con],
            check=False,
            timeout=10,
        )
        if res.returncode == NMCLI_NOT_FOUND:
            return None
        if not res.ok:
            raise CommandFailed(res)
        return dict(zip(keys, res.stdout.splitlines(), strict=False))

    def plan_teardown(self, profile: str, host: HostSpec, facts: LinkFacts) -> Plan:
        ifname, addr = host.interface, str(host.address)
        plan = Plan()
        if facts.owner == "networkmanager" and self._nm_settings(
            nm_connection_name(profile), ["connection.id"]
        ):
            con = nm_connection_name(profile)
            plan.changes.append(
                Change(
                    Kind.RUN,
                    con,
                    f"NetworkManager: delete connection {con}",
                    {"argv": ["nmcli", "connection", "delete", con]},
                    effects=NM_ACTIVATION,
                )
            )
        elif facts.has_address(addr):
            args = {"address": host.ip, "prefixlen": host.address.network.prefixlen}
            plan.changes.append(Change(Kind.ADDR_DEL, ifname, f"{ifname}: remove {addr}", args))
        if plan.changes:
            plan.notes.append(
                "no setup record found: removing the profile's address only; "
                "the previous MTU is unknown and left as it is"
            )
        return plan

    def plan_follow_up(self, host: HostSpec, link: LinkSpec, peers: list[HostSpec]) -> Plan:
        """Nothing is left undone on Linux: the kernel adds the subnet route with the
        address, and netlink/nmcli return once the change is in place. Checks that the
        kernel's route to each peer leaves through the link (no more specific route or
        policy rule elsewhere captures it)."""
        if not peers:
            return Plan()
        names = {lk.index: lk.name for lk in rtnl.links()}
        for peer in peers:
            try:
                found = rtnl.route_get(peer.ip)
            except OSError as e:
                code = errno.errorcode.get(e.errno or 0, str(e.errno))
                raise CheckFailed(
                    f"no route to {peer.name} ({peer.ip}): {code}", "see `linkctl status`"
                ) from None
            oif = names.get(found.oif) if found and found.oif is not None else None
            if oif != host.interface:
                raise CheckFailed(
                    f"traffic to {peer.name} ({peer.ip}) leaves through {oif}, "
                    f"not {host.interface}",
                    "look for a more specific route or a policy rule that captures "
                    f"{link.subnet} (`ip route get {peer.ip}`)",
                )
        return Plan()

    # ---- execution ---------------------------------------------------------

    def execute(self, change: Change) -> None:
        self._owners.clear()  # a change (an NM activation above all) may change the owner
        if change.action is Kind.RUN:
            self.runner.run(change.args["argv"], timeout=60)
            return
        from pyroute2.netlink.exceptions import NetlinkError

        index = self._link(change.target).index
        try:
            with _ipr() as ipr:
                self._netlink(ipr, index, change)
        except NetlinkError as e:
            raise self._netlink_error(change, e) from None

    @staticmethod
    def _netlink(ipr: IPRoute, index: int, change: Change) -> None:
        a: dict[str, Any] = change.args
        if change.action is Kind.SET_MTU:
            ipr.link("set", index=index, mtu=a["mtu"])
        elif change.action is Kind.LINK_UP:
            ipr.link("set", index=index, state="up")
        elif change.action is Kind.LINK_DOWN:
            ipr.link("set", index=index, state="down")
        elif change.action is Kind.ADDR_ADD:
            ipr.addr("add", index=index, address=a["address"], prefixlen=a["prefixlen"])
        elif change.action is Kind.ADDR_DEL:
            _addr_del_keeping_others(ipr, index, change.target, a["address"], a["prefixlen"])
        else:
            raise ApplyError(f"unknown change action {change.action!r}")

    @staticmethod
    def _netlink_error(change: Change, e: NetlinkError) -> Exception:
        code = e.code
        text = errno.errorcode.get(code, str(code))
        if change.action is Kind.SET_MTU and code in (errno.EINVAL, errno.ERANGE):
            return InputError(
                f"{change.target} refused MTU {change.args['mtu']} ({text})",
                "set link.mtu to a value the NIC supports (see `linkctl status`)",
            )
        if change.action is Kind.ADDR_DEL and code == errno.EADDRNOTAVAIL:
            return ApplyError(f"{change.summary}: address is already gone")
        return ApplyError(f"{change.summary}: netlink error {text}: {e}")


def _addr_del_keeping_others(
    ipr: IPRoute, index: int, ifname: str, address: str, prefixlen: int
) -> None:
    """Remove one address without taking others with it.

    Linux deletes every secondary address of a subnet together with its primary
    unless promote_secondaries is set; someone else's address in our subnet must
    survive our teardown, so promote for the duration of the delete.
    """
    net = ipaddress.IPv4Interface(f"{address}/{prefixlen}").network
    others = [
        a
        for a in ipr.get_addr(family=socket.AF_INET, index=index)
        if a.get("IFA_ADDRESS") != address and ipaddress.IPv4Address(a.get("IFA_ADDRESS")) in net
    ]
    knob = Path(f"/proc/sys/net/ipv4/conf/{ifname}/promote_secondaries")
    old = knob.read_text().strip() if others and knob.exists() else None
    if old == "0":
        knob.write_text("1")
    try:
        ipr.addr("del", index=index, address=address, prefixlen=prefixlen)
    finally:
        if old == "0":
            knob.write_text("0")
