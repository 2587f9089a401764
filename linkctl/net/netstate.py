"""Facts about the machine's network, as both OS backends report them.

These dataclasses are the contract between the backends and everything
above them; tests/test_contracts.py holds every backend to these shapes.
"""

from __future__ import annotations

import ipaddress
from dataclasses import asdict, dataclass, field
from typing import Any

from linkctl.core.checks import Verdict


@dataclass(frozen=True)
class Route:
    """One IPv4 route. ``dst`` is a CIDR ("0.0.0.0/0" for the default route)."""

    dst: str
    gateway: str | None
    ifname: str | None
    metric: int | None = None
    # Everything else the OS says about the route; part of its identity so that
    # "the default route is the same object" compares more than dst/gateway.
    detail: tuple[tuple[str, str], ...] = ()

    @property
    def is_default(self) -> bool:
        return self.dst == "0.0.0.0/0"

    def network(self) -> ipaddress.IPv4Network:
        return ipaddress.IPv4Network(self.dst, strict=False)

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["detail"] = dict(self.detail)
        return d


@dataclass(frozen=True)
class LinkFacts:
    """The state of one interface as the OS reports it."""

    ifname: str
    up: bool
    carrier: bool
    mtu: int
    mac: str | None
    addresses: tuple[str, ...]  # IPv4 CIDRs, e.g. "198.18.100.2/24"
    speed_mbps: int | None = None  # None: the OS does not say (or no carrier)
    duplex: str | None = None  # "full", "half" or None
    min_mtu: int | None = None
    max_mtu: int | None = None
    owner: str = "none"  # "networkmanager", "systemd-networkd", "networksetup", "none"
    owner_detail: str = ""  # NM connection or macOS network service name
    media: str = ""  # raw media line where the OS gives one (macOS ifconfig)
    # "wired" (an Ethernet port, a veth), "wifi", or "other" (loopback, bridge, tunnel,
    # Bluetooth, iPhone USB): `linkctl pair` considers only wired ports.
    kind: str = "other"

    def has_address(self, cidr: str) -> bool:
        return cidr in self.addresses

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["addresses"] = list(self.addresses)
        return d


@dataclass(frozen=True)
class TcpConn:
    """One established TCP connection as the kernel keeps it (Linux: struct tcp_info
    through sock_diag, include/uapi/linux/tcp.h); times in ms. The watch reads the live
    RPC connection's figures here instead of adding traffic of its own."""

    local: str  # "ip:port"
    remote: str  # "ip:port"
    rtt_ms: float  # smoothed RTT (tcpi_rtt)
    min_rtt_ms: float  # lowest RTT seen on this connection (tcpi_min_rtt)
    retrans_total: int  # segments retransmitted over its life (tcpi_total_retrans)
    unacked: int  # segments sent and not acknowledged yet
    last_send_ms: int  # since data was last sent
    last_recv_ms: int  # since data was last received
    bytes_sent: int
    bytes_received: int

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Drift:
    field: str
    want: Any
    have: Any
    severity: Verdict = Verdict.FAIL  # FAIL or WARN

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class LinkStatus:
    profile: str
    host: str
    os: str
    facts: LinkFacts
    default_route: Route | None
    drift: list[Drift] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not any(d.severity is Verdict.FAIL for d in self.drift)

    def as_dict(self) -> dict[str, Any]:
        return {
            "profile": self.profile,
            "host": self.host,
            "os": self.os,
            "ok": self.ok,
            "facts": self.facts.as_dict(),
            "default_route": self.default_route.as_dict() if self.default_route else None,
            "drift": [d.as_dict() for d in self.drift],
        }
