"""macOS backend: networksetup owns the configuration, ifconfig/route/netstat report it.

Every command goes through the one Runner as an argv list, so dry-run and
JSON show the exact commands, and tests replay recorded real outputs through
the same code path (tests/fixtures/macos/).

What setup does on the Mac end (service "Ethernet" on en0 as an example):

1. map the profile interface to its hardware port (``-listallhardwareports``)
   and to its network service (``-listnetworkserviceorder``, which names the
   device of every service); never assume a service name;
2. save the service's IPv4 configuration (``-getinfo``) and MTU setting
   (``-getMTU``) as the undo of each change, so teardown restores them exactly;
3. ``-setMTU en0 9000`` (the MTU commands take a hardware port or device name,
   not a service) and ``-setmanual Ethernet 192.168.100.1 255.255.255.0`` with
   no router, so no default route is installed;
4. after apply: wait for the address and MTU to show in ``ifconfig``, check that
   ``route -n get PEER`` leaves through en0 (a manual configuration with a blank
   router can come up without the subnet route; then ``route -n add -net SUBNET
   -interface en0`` is applied and recorded, and teardown deletes it), and warn
   when the media line shows less than the profile's speed.

The service order is never changed, and need not be: the link's service gets no
router, and configd neither installs a default route for a routerless service nor
lets it become primary, wherever it sits in the order (``_note_service_order``).
The post-apply check proves it (the default route is the same as before, else the
transaction rolls back).
"""

from __future__ import annotations

import os
import shlex
import time
from collections.abc import Callable

from linkctl.core.errors import ApplyError, CheckFailed, InputError, NeedsRoot
from linkctl.core.profile import HostSpec, LinkSpec
from linkctl.core.runner import CommandFailed, Runner
from linkctl.net.macos_parse import (
    HardwarePort,
    IfconfigInterface,
    MtuRange,
    NetworkService,
    RouteGet,
    ServiceInfo,
    networksetup_error,
    parse_get_mtu,
    parse_getinfo,
    parse_hardware_ports,
    parse_ifconfig,
    parse_mtu_range,
    parse_netstat_inet,
    parse_route_get,
    parse_service_order,
    port_kind,
)
from linkctl.net.netstate import LinkFacts, Route, TcpConn
from linkctl.net.plan import Change, Effect, Kind, Plan

NETWORKSETUP = "networksetup"
SETTLE_TIMEOUT_S = 10.0  # configd applies networksetup's changes asynchronously
SETTLE_POLL_S = 0.5
_NOT_IN_TABLE = "not in table"
# networksetup refusing a change to a user who is not root prints, with exit status 0,
# ``** Error: Command requires admin privileges.`` (recorded in
# tests/fixtures/macos/networksetup-error-admin-privileges-constructed.txt; source in
# tests/fixtures/macos/SOURCES.md). Translated here into NeedsRoot, the one place that
# reads networksetup's output.
_NEEDS_ADMIN = "requires admin privileges"


# What each networksetup/route change alters: a service's IPv4 configuration is its
# address and, with it, the subnet route.
SERVICE_CONFIG = frozenset({Effect.ADDRESS, Effect.ROUTE})
MTU = frozenset({Effect.MTU})
ROUTE = frozenset({Effect.ROUTE})


def _run_change(
    argv: list[str],
    target: str,
    summary: str,
    *,
    effects: frozenset[Effect],
    undo: Change | None = None,
) -> Change:
    return Change(Kind.RUN, target, summary, {"argv": argv}, undo=undo, effects=effects)


class MacBackend:
    os_name = "macos"

    def __init__(
        self,
        runner: Runner,
        *,
        euid: Callable[[], int] = os.geteuid,
        sleep: Callable[[float], None] = time.sleep,
        settle_timeout: float = SETTLE_TIMEOUT_S,
    ):
        self.runner = runner
        self._euid = euid
        self._sleep = sleep
        self._settle_timeout = settle_timeout
        # Hardware ports, services and MTU ranges do not change while linkctl runs.
        self._ports: list[HardwarePort] | None = None
        self._services: list[NetworkService] | None = None
        self._ranges: dict[str, MtuRange | None] = {}

    # ---- running commands ----------------------------------------------------

    def _networksetup(self, *args: str) -> str:
        if not self.runner.which(NETWORKSETUP):
            raise InputError(
                "networksetup not found: the macOS backend drives networksetup (/usr/sbin)",
                "run linkctl on macOS with /usr/sbin on PATH",
            )
        res = self.runner.run([NETWORKSETUP, *args], check=False, timeout=30)
        err = networksetup_error(res.stdout + "\n" + res.stderr)
        if err and _NEEDS_ADMIN in err:
            raise NeedsRoot(
                f"`networksetup {shlex.join(args)}` failed: {err}", "run linkctl with sudo"
            )
        if err or not res.ok:
            raise InputError(
                f"`networksetup {shlex.join(args)}` failed: "
                f"{err or (res.stderr or res.stdout).strip() or f'exit {res.returncode}'}",
                "check the service and device names with `networksetup -listnetworkserviceorder`",
            )
        return res.stdout

    def _route_get(self, target: str) -> RouteGet | None:
        res = self.runner.run(["route", "-n", "get", target], check=False, timeout=10)
        if not res.ok and _NOT_IN_TABLE not in res.stderr + res.stdout:
            raise CommandFailed(res)
        return parse_route_get(res.stdout) if res.ok else None

    # ---- hardware ports and services ----------------------------------------

    def hardware_ports(self, *, fresh: bool = False) -> list[HardwarePort]:
        if self._ports is None or fresh:
            self._ports = parse_hardware_ports(self._networksetup("-listallhardwareports"))
        return self._ports

    def services(self, *, fresh: bool = False) -> list[NetworkService]:
        if self._services is None or fresh:
            self._services = parse_service_order(self._networksetup("-listnetworkserviceorder"))
        return self._services

    def _port(self, ifname: str) -> HardwarePort:
        # A miss in a list read earlier reads it again: an adapter can register late (boot).
        stale = self._ports is not None
        ports = self.hardware_ports()
        if stale and not any(p.device == ifname for p in ports):
            ports = self.hardware_ports(fresh=True)
        for p in ports:
            if p.device == ifname:
                return p
        listed = ", ".join(f"{p.device} ({p.name})" for p in ports) or "none"
        raise InputError(
            f"interface {ifname!r} is not a hardware port here; "
            f"`networksetup -listallhardwareports` lists: {listed}",
            f"set hosts.interface to one of: {', '.join(p.device for p in ports)}",
        )

    def service_of(self, ifname: str) -> NetworkService | None:
        """The network service on ``ifname``: the first enabled one in service order,
        else the first disabled one; None if the device has no service."""
        stale = self._services is not None
        mine = [s for s in self.services() if s.device == ifname]
        if stale and not mine:
            mine = [s for s in self.services(fresh=True) if s.device == ifname]
        return next((s for s in mine if s.enabled), mine[0] if mine else None)

    def _mtu_range(self, ifname: str) -> MtuRange | None:
        if ifname not in self._ranges:
            try:
                self._ranges[ifname] = parse_mtu_range(
                    self._networksetup("-listvalidMTUrange", ifname)
                )
            except InputError:
                self._ranges[ifname] = None  # not every device reports a range
        return self._ranges[ifname]

    # ---- facts ------------------------------------------------------------------

    def tcp_connections(self, ends: list[str]) -> list[TcpConn]:
        # macOS keeps per-connection RTT (struct tcp_connection_info, TCP_CONNECTION_INFO)
        # but gives it only to the socket's owner, and no recorded output of a tool that
        # prints it for another process is at hand to parse: the watch's ping sample and
        # decode rate stand in there (not verified on a real Mac).
        return []

    def ping_argv(self, address: str, **kw: object) -> list[str]:
        """argv for macOS ping (see linkctl.net.ping: size, count, timeout_s, interval_s,
        dont_fragment)."""
        from linkctl.net.ping import macos_ping_argv

        return macos_ping_argv(address, **kw)  # type: ignore[arg-type]

    def icmp_socket_groups(self) -> tuple[int, int] | None:
        """Any user may open one (icmp(4): SOCK_DGRAM needs no privilege)."""
        return None

    def interfaces(self) -> list[str]:
        return sorted(parse_ifconfig(self.runner.run(["ifconfig", "-a"], timeout=10).stdout))

    def _ifconfig(self, ifname: str) -> IfconfigInterface:
        res = self.runner.run(["ifconfig", ifname], check=False, timeout=10)
        info = parse_ifconfig(res.stdout).get(ifname) if res.ok else None
        if info is None:
            raise InputError(
                f"`ifconfig {ifname}` shows no interface {ifname!r}: "
                f"{(res.stderr or res.stdout).strip() or 'no output'}",
                "check that the adapter is connected and recognised",
            )
        return info

    def link_facts(self, ifname: str) -> LinkFacts:
        self._port(ifname)  # not a hardware port -> InputError listing them
        svc = self.service_of(ifname)
        info = self._ifconfig(ifname)
        rng = self._mtu_range(ifname)
        media = info.media
        carrier = info.carrier
        return LinkFacts(
            ifname=ifname,
            up=info.up,
            carrier=carrier,
            mtu=info.mtu,
            mac=info.ether,
            addresses=info.inet,
            speed_mbps=media.speed_mbps if media and carrier else None,
            duplex=media.duplex if media and carrier else None,
            min_mtu=rng.min if rng else None,
            max_mtu=rng.max if rng else None,
            owner="networksetup" if svc else "none",
            owner_detail=svc.name if svc else "",
            media=media.raw if media else "",
            kind=port_kind(self._port(ifname).name),
        )

    def routes(self) -> list[Route]:
        out = []
        text = self.runner.run(["netstat", "-rn", "-f", "inet"], timeout=10).stdout
        for r in parse_netstat_inet(text):
            # Cloned entries (W: ARP/neighbour cache, L: link-layer) are not routes anyone set.
            if "W" in r.flags or "L" in r.flags:
                continue
            on_link = r.gateway.startswith("link#") or ":" in r.gateway
            detail = {"flags": r.flags, "gateway": r.gateway}
            out.append(
                Route(
                    dst=r.dst,
                    gateway=None if on_link else r.gateway,
                    ifname=r.netif,
                    detail=tuple(sorted(detail.items())),
                )
            )
        return out

    def default_route(self) -> Route | None:
        rg = self._route_get("default")
        if rg is None or rg.destination != "default":
            return None
        return Route(
            dst="0.0.0.0/0",
            gateway=rg.gateway,
            ifname=rg.interface,
            detail=(("flags", ",".join(rg.flags)),),
        )

    # ---- plans --------------------------------------------------------------------

    def _require_service(self, ifname: str) -> NetworkService:
        port = self._port(ifname)
        svc = self.service_of(ifname)
        if svc is None:
            raise InputError(
                f"{ifname} ({port.name}) has no network service",
                f"create one: sudo networksetup -createnetworkservice {shlex.quote(port.name)} "
                f"{shlex.quote(port.name)}",
            )
        if not svc.enabled:
            raise InputError(
                f"network service {svc.name!r} on {ifname} is disabled",
                "enable it: sudo networksetup -setnetworkserviceenabled "
                f"{shlex.quote(svc.name)} on",
            )
        return svc

    def _note_service_order(self, svc: NetworkService, plan: Plan) -> None:
        """Say so when the link's service ranks ahead of the default route's service
        (the Mac Studio's usual order: built-in Ethernet first). It does not move the
        default route: configd (apple-oss-distributions/configd, configd-1405.100.8,
        Plugins/IPMonitor/ip_plugin.c) adds a service's default route only when it has
        a router (IPv4RouteListCreateWithDictionary: ``add_default`` needs
        ``router.s_addr != 0``; without one the rank is demoted to RankLast), and
        elect_ip() marks a service with no default route "ineligible to become
        primary". setup configures the link with no router."""
        default = self.default_route()
        if default is None or default.ifname == svc.device:
            return
        primary = self.service_of(default.ifname or "")
        if primary is not None and svc.position < primary.position:
            plan.notes.append(
                f"network service {svc.name!r} ({svc.device}) is ahead of {primary.name!r} "
                f"({primary.device}), which carries the default route, in the service order; "
                "with no router macOS installs no default route for it and never makes it "
                "primary, and setup checks after applying that the default route is unchanged"
            )

    def _restore_argv(self, svc: str, info: ServiceInfo) -> list[str]:
        """The networksetup argv that puts the service's IPv4 configuration back as
        ``info`` shows it."""
        ns = NETWORKSETUP
        if info.method == "dhcp":
            return [ns, "-setdhcp", svc, *([info.client_id] if info.client_id else [])]
        if info.method == "bootp":
            return [ns, "-setbootp", svc]
        if info.method == "manual" and info.ip and info.mask:
            return [
                ns,
                "-setmanual",
                svc,
                info.ip,
                info.mask,
                *([info.router] if info.router else []),
            ]
        if info.method == "manual-dhcp-router" and info.ip:
            return [ns, "-setmanualwithdhcprouter", svc, info.ip]
        if info.method is None and info.header is None and info.ip is None:
            return [ns, "-setv4off", svc]  # no IPv4 configuration at all: IPv4 is off
        raise InputError(
            f"cannot record how to restore service {svc!r}: `networksetup -getinfo` shows "
            f"{info.header or 'no IPv4 method'} with address {info.ip or 'none'}",
            "set the service to DHCP or a complete manual configuration first, then re-run",
        )

    def plan_setup(self, profile: str, host: HostSpec, link: LinkSpec, facts: LinkFacts) -> Plan:
        ifname = host.interface
        svc = self._require_service(ifname)
        plan = Plan(notes=[f"{ifname} is network service {svc.name!r} (networksetup)"])
        mask = str(host.address.netmask)
        info = parse_getinfo(self._networksetup("-getinfo", svc.name))
        mtu = parse_get_mtu(self._networksetup("-getMTU", ifname))
        configured_mtu = (mtu.configured or mtu.active) if mtu else facts.mtu
        config_ok = (
            info.method == "manual" and info.ip == host.ip and info.mask == mask and not info.router
        )
        if (
            config_ok
            and facts.has_address(str(host.address))
            and configured_mtu == link.mtu
            and facts.mtu == link.mtu
        ):
            return plan
        if not facts.carrier:
            raise InputError(
                f"{ifname} has no link (ifconfig status: inactive, media {facts.media or 'none'}); "
                "macOS assigns a service's address only while its link is active, so setup "
                "could not be verified",
                "connect the cable and power on the peer, then re-run",
            )
        if configured_mtu != link.mtu or facts.mtu != link.mtu:
            old = configured_mtu
            plan.changes.append(
                _run_change(
                    [NETWORKSETUP, "-setMTU", ifname, str(link.mtu)],
                    ifname,
                    f"{ifname}: MTU {old} -> {link.mtu} (networksetup -setMTU)",
                    effects=MTU,
                    undo=_run_change(
                        [NETWORKSETUP, "-setMTU", ifname, str(old)],
                        ifname,
                        f"{ifname}: MTU {link.mtu} -> {old}",
                        effects=MTU,
                    ),
                )
            )
        if not config_ok or not facts.has_address(str(host.address)):
            self._note_service_order(svc, plan)
            before = self._restore_argv(svc.name, info)
            was = info.header or "IPv4 off"
            if info.ip:
                was += f" {info.ip}/{info.mask}" + (f" router {info.router}" if info.router else "")
            plan.changes.append(
                _run_change(
                    [NETWORKSETUP, "-setmanual", svc.name, host.ip, mask],
                    svc.name,
                    f"{svc.name}: manual {host.address} on {ifname}, no router (no default route)",
                    effects=SERVICE_CONFIG,
                    undo=_run_change(
                        before, svc.name, f"{svc.name}: restore {was}", effects=SERVICE_CONFIG
                    ),
                )
            )
        plan.notes.append(
            f"after applying, linkctl waits for {host.address} on {ifname}, checks "
            "`route -n get PEER` for each peer and, only if macOS left the subnet route out, adds "
            f"`route -n add -net {host.address.network} -interface {ifname}` (undone on teardown)"
        )
        return plan

    def plan_teardown(self, profile: str, host: HostSpec, facts: LinkFacts) -> Plan:
        plan = Plan()
        svc = self.service_of(host.interface)
        if svc is None:
            return plan
        info = parse_getinfo(self._networksetup("-getinfo", svc.name))
        if info.method == "manual" and info.ip == host.ip:
            back = self._restore_argv(svc.name, info)
            plan.changes.append(
                _run_change(
                    [NETWORKSETUP, "-setdhcp", svc.name],
                    svc.name,
                    f"{svc.name}: back to DHCP (removes {host.address})",
                    effects=SERVICE_CONFIG,
                    undo=_run_change(
                        back,
                        svc.name,
                        f"{svc.name}: manual {host.address} again",
                        effects=SERVICE_CONFIG,
                    ),
                )
            )
            plan.notes.append(
                "no setup record found: setting the service back to DHCP (the macOS default); "
                "the previous configuration and MTU are unknown and the MTU is left as it is"
            )
        return plan

    def plan_follow_up(self, host: HostSpec, link: LinkSpec, peers: list[HostSpec]) -> Plan:
        """After setup's changes (or when none were needed): wait for configd to apply
        them, then plan what macOS left undone, i.e. the subnet route when traffic
        to a peer does not leave through the link. Read-only."""
        ifname, want = host.interface, str(host.address)
        deadline = time.monotonic() + self._settle_timeout
        info = self._ifconfig(ifname)
        while not (want in info.inet and info.mtu == link.mtu) and time.monotonic() < deadline:
            self._sleep(SETTLE_POLL_S)
            info = self._ifconfig(ifname)
        if want not in info.inet or info.mtu != link.mtu:
            raise CheckFailed(
                f"{ifname} shows {list(info.inet)} MTU {info.mtu} after "
                f"{self._settle_timeout:g} s, not {want} MTU {link.mtu}",
                "check the service in System Settings > Network and `linkctl status`",
            )
        plan = Plan()
        media = info.media
        if media is None or media.speed_mbps is None:
            plan.notes.append(
                f"WARN: {ifname} media {media.raw if media else 'not shown'!r}: "
                f"link speed unknown (profile expects {link.expected_speed_mbps} Mb/s)"
            )
        elif media.speed_mbps < link.expected_speed_mbps:
            plan.notes.append(
                f"WARN: {ifname} negotiated {media.speed_mbps} Mb/s ({media.raw}), "
                f"the profile expects {link.expected_speed_mbps} Mb/s: check the cable (CAT6A) "
                "and the peer's port"
            )
        subnet = host.address.network
        astray = []
        for peer in peers:
            rg = self._route_get(peer.ip)
            if rg is None or rg.interface != ifname:
                astray.append(f"{peer.name} {peer.ip} -> {rg.interface if rg else 'no route'}")
        if astray:
            delete = ["route", "-n", "delete", "-net", str(subnet), "-interface", ifname]
            plan.changes.append(
                _run_change(
                    ["route", "-n", "add", "-net", str(subnet), "-interface", ifname],
                    ifname,
                    f"route {subnet} to {ifname} (macOS left the subnet route out: "
                    f"{'; '.join(astray)})",
                    effects=ROUTE,
                    undo=_run_change(
                        delete, ifname, f"remove route {subnet} -interface {ifname}", effects=ROUTE
                    ),
                )
            )
        return plan

    # ---- execution ------------------------------------------------------------------

    def execute(self, change: Change) -> None:
        if change.action is not Kind.RUN:
            raise ApplyError(f"unknown change action {change.action!r} for the macOS backend")
        argv = [str(a) for a in change.args["argv"]]
        if self._euid() != 0:
            raise NeedsRoot(
                f"{change.summary}: `{argv[0]}` changes the network configuration and needs root",
                "run linkctl with sudo",
            )
        if not self.runner.which(argv[0]):
            raise InputError(f"command not found: {argv[0]}", "run linkctl on macOS")
        if argv[0] == NETWORKSETUP:
            try:
                self._networksetup(*argv[1:])
            except NeedsRoot as e:
                raise NeedsRoot(
                    f"{change.summary}: networksetup says it needs admin privileges", e.fix
                ) from None
            except InputError as e:
                if argv[1] == "-setMTU":
                    raise InputError(
                        f"{change.target} refused MTU {argv[-1]}: {e.message}",
                        f"set link.mtu inside `networksetup -listvalidMTUrange {change.target}`",
                    ) from None
                raise ApplyError(f"{change.summary}: {e.message}") from None
            return
        res = self.runner.run(argv, check=False, timeout=30)
        if res.ok:
            return
        out = (res.stderr + res.stdout).strip()
        # Deleting a route that is already gone (e.g. dropped at reboot) is done.
        if argv[:3] == ["route", "-n", "delete"] and _NOT_IN_TABLE in out:
            return
        raise ApplyError(f"{change.summary}: `{shlex.join(argv)}` exited {res.returncode}: {out}")
