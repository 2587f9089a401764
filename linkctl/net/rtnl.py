"""A small read-only rtnetlink reader: links, IPv4 addresses, IPv4 routes, route lookup;
and a link's speed/duplex through the ethtool ioctl.

Why not pyroute2 here: importing the ``pyroute2`` package costs ~200-250 ms (its
``__init__`` loads every netlink family: NDB, IPDB, conntrack, nftables, and asyncio),
more than the whole rest of a read-only ``linkctl status``. Reading state needs four
request types on one AF_NETLINK socket, so the read path speaks rtnetlink itself, as
``ip link/addr/route show`` do. Changes (set MTU, up/down, address add/del) still go
through pyroute2 in linkctl.net.linux: it is imported only when something is changed.

Message layouts are the kernel's UAPI headers: include/uapi/linux/netlink.h
(nlmsghdr, nlmsgerr), rtnetlink.h (rtmsg, rtattr, RTA_*), if_link.h (IFLA_*),
if_addr.h (ifaddrmsg, IFA_*), linux/if.h (ifinfomsg). Attributes are 4-byte aligned.
Speed and duplex are not in rtnetlink: they come from the SIOCETHTOOL ioctl
(linux/sockios.h) with ETHTOOL_GSET and struct ethtool_cmd (linux/ethtool.h), as
``ethtool IF`` and psutil.net_if_stats read them (psutil's import alone costs ~10 ms).
"""

from __future__ import annotations

import errno
import os
import socket
import struct
from dataclasses import dataclass

NETLINK_ROUTE = 0
NLMSG_ERROR, NLMSG_DONE = 2, 3
NLM_F_REQUEST, NLM_F_MULTI, NLM_F_DUMP_INTR, NLM_F_DUMP = 0x1, 0x2, 0x10, 0x300
RTM_NEWLINK, RTM_GETLINK = 16, 18
RTM_NEWADDR, RTM_GETADDR = 20, 22
RTM_NEWROUTE, RTM_GETROUTE = 24, 26

IFLA_ADDRESS, IFLA_IFNAME, IFLA_MTU, IFLA_CARRIER = 1, 3, 4, 33
IFLA_MIN_MTU, IFLA_MAX_MTU = 50, 51
IFA_ADDRESS = 1
RTA_DST, RTA_OIF, RTA_GATEWAY, RTA_PRIORITY, RTA_PREFSRC, RTA_TABLE = 1, 4, 5, 6, 7, 15
NLA_TYPE_MASK = 0x3FFF  # strips NLA_F_NESTED / NLA_F_NET_BYTEORDER

_NLMSGHDR = struct.Struct("=IHHII")  # len, type, flags, seq, pid
_IFINFOMSG = struct.Struct("=BxHiII")  # family, type, index, flags, change
_IFADDRMSG = struct.Struct("=BBBBI")  # family, prefixlen, flags, scope, index
_RTMSG = struct.Struct("=BBBBBBBBI")  # family dst_len src_len tos table proto scope type, flags
_RTATTR = struct.Struct("=HH")
_DUMP_RETRIES = 3  # a dump interrupted by a concurrent change (NLM_F_DUMP_INTR) is redone


@dataclass(frozen=True)
class Link:
    index: int
    name: str
    flags: int  # IFF_* (ifi_flags)
    mtu: int
    carrier: bool
    mac: str | None  # "aa:bb:...", None when the device has no link-layer address
    min_mtu: int | None
    max_mtu: int | None


@dataclass(frozen=True)
class Addr:
    index: int
    prefixlen: int
    address: str  # IFA_ADDRESS, as `ip addr` shows it


@dataclass(frozen=True)
class RouteEntry:
    table: int  # RTA_TABLE when present, else rtm_table
    dst: str | None  # None for the default route
    dst_len: int
    gateway: str | None
    oif: int | None
    priority: int | None
    prefsrc: str | None
    proto: int
    scope: int
    type: int
    flags: int


def _attrs(data: bytes, offset: int) -> dict[int, bytes]:
    out: dict[int, bytes] = {}
    while offset + _RTATTR.size <= len(data):
        length, kind = _RTATTR.unpack_from(data, offset)
        if length < _RTATTR.size:
            break
        out[kind & NLA_TYPE_MASK] = data[offset + _RTATTR.size : offset + length]
        offset += (length + 3) & ~3
    return out


def _u32(attrs: dict[int, bytes], kind: int) -> int | None:
    v = attrs.get(kind)
    return struct.unpack("=I", v[:4])[0] if v and len(v) >= 4 else None


def _ipv4(attrs: dict[int, bytes], kind: int) -> str | None:
    v = attrs.get(kind)
    return socket.inet_ntop(socket.AF_INET, v[:4]) if v and len(v) >= 4 else None


def _request(kind: int, flags: int, body: bytes) -> list[tuple[int, bytes]]:
    """Send one request; return the (type, payload) of every reply message up to the
    end of the answer. A netlink error reply is an OSError with its errno."""
    with socket.socket(
        socket.AF_NETLINK, socket.SOCK_RAW | socket.SOCK_CLOEXEC, NETLINK_ROUTE
    ) as s:
        s.bind((0, 0))
        seq = 1
        s.send(
            _NLMSGHDR.pack(_NLMSGHDR.size + len(body), kind, NLM_F_REQUEST | flags, seq, 0) + body
        )
        replies: list[tuple[int, bytes]] = []
        while True:
            data = s.recv(1 << 20)
            offset = 0
            while offset + _NLMSGHDR.size <= len(data):
                length, mtype, mflags, mseq, _pid = _NLMSGHDR.unpack_from(data, offset)
                if length < _NLMSGHDR.size:
                    raise OSError(errno.EPROTO, "malformed netlink message")
                payload = data[offset + _NLMSGHDR.size : offset + length]
                offset += (length + 3) & ~3
                if mseq != seq:
                    continue
                if mflags & NLM_F_DUMP_INTR:
                    raise InterruptedError(errno.EINTR, "netlink dump interrupted")
                if mtype == NLMSG_ERROR:
                    (code,) = struct.unpack_from("=i", payload)
                    if code:
                        raise OSError(-code, os.strerror(-code))
                    return replies  # an ACK
                if mtype == NLMSG_DONE:
                    return replies
                replies.append((mtype, payload))
                if not mflags & NLM_F_MULTI:
                    return replies


def _dump(kind: int, body: bytes) -> list[tuple[int, bytes]]:
    for attempt in range(_DUMP_RETRIES):
        try:
            return _request(kind, NLM_F_DUMP, body)
        except InterruptedError:
            if attempt == _DUMP_RETRIES - 1:
                raise
    raise AssertionError("unreachable")


def links() -> list[Link]:
    out = []
    for mtype, p in _dump(RTM_GETLINK, _IFINFOMSG.pack(socket.AF_UNSPEC, 0, 0, 0, 0)):
        if mtype != RTM_NEWLINK:
            continue
        _fam, _type, index, flags, _change = _IFINFOMSG.unpack_from(p)
        a = _attrs(p, _IFINFOMSG.size)
        mac = a.get(IFLA_ADDRESS)
        carrier = a.get(IFLA_CARRIER)
        out.append(
            Link(
                index=index,
                name=a.get(IFLA_IFNAME, b"").rstrip(b"\0").decode(),
                flags=flags,
                mtu=_u32(a, IFLA_MTU) or 0,
                carrier=bool(carrier and carrier[0]),
                mac=":".join(f"{b:02x}" for b in mac) if mac else None,
                min_mtu=_u32(a, IFLA_MIN_MTU) or None,
                max_mtu=_u32(a, IFLA_MAX_MTU) or None,
            )
        )
    return out


def ipv4_addrs(index: int | None = None) -> list[Addr]:
    out = []
    for mtype, p in _dump(RTM_GETADDR, _IFADDRMSG.pack(socket.AF_INET, 0, 0, 0, 0)):
        if mtype != RTM_NEWADDR:
            continue
        fam, prefixlen, _flags, _scope, idx = _IFADDRMSG.unpack_from(p)
        address = _ipv4(_attrs(p, _IFADDRMSG.size), IFA_ADDRESS)
        if fam == socket.AF_INET and address and (index is None or idx == index):
            out.append(Addr(idx, prefixlen, address))
    return out


def _route(p: bytes) -> RouteEntry:
    _fam, dst_len, _src_len, _tos, table, proto, scope, rtype, flags = _RTMSG.unpack_from(p)
    a = _attrs(p, _RTMSG.size)
    return RouteEntry(
        table=_u32(a, RTA_TABLE) or table,
        dst=_ipv4(a, RTA_DST),
        dst_len=dst_len,
        gateway=_ipv4(a, RTA_GATEWAY),
        oif=_u32(a, RTA_OIF),
        priority=_u32(a, RTA_PRIORITY),
        prefsrc=_ipv4(a, RTA_PREFSRC),
        proto=proto,
        scope=scope,
        type=rtype,
        flags=flags,
    )


def ipv4_routes() -> list[RouteEntry]:
    """Every IPv4 route the kernel dumps (all tables; callers pick one)."""
    body = _RTMSG.pack(socket.AF_INET, 0, 0, 0, 0, 0, 0, 0, 0)
    return [_route(p) for mtype, p in _dump(RTM_GETROUTE, body) if mtype == RTM_NEWROUTE]


def route_get(dst: str) -> RouteEntry | None:
    """The route the kernel would use for ``dst`` (`ip route get`); OSError (e.g.
    ENETUNREACH) when there is none."""
    addr = socket.inet_pton(socket.AF_INET, dst)
    body = _RTMSG.pack(socket.AF_INET, 32, 0, 0, 0, 0, 0, 0, 0)
    body += _RTATTR.pack(_RTATTR.size + len(addr), RTA_DST) + addr
    found = [_route(p) for mtype, p in _request(RTM_GETROUTE, 0, body) if mtype == RTM_NEWROUTE]
    return found[0] if found else None


SIOCETHTOOL, ETHTOOL_GSET = 0x8946, 0x00000001
# struct ethtool_cmd: cmd, supported, advertising, speed (u16), duplex, port, phy_address,
# transceiver, autoneg, mdio_support (u8), maxtxpkt, maxrxpkt, speed_hi (u16), eth_tp_mdix,
# eth_tp_mdix_ctrl (u8), lp_advertising, reserved[2]
_ETHTOOL_CMD = struct.Struct("=IIIHBBBBBBIIHBBIII")
_IFREQ_SIZE = 40  # sizeof(struct ifreq): char ifr_name[16] + a 24-byte union
SPEED_UNKNOWN = 0xFFFFFFFF  # (u32)-1, what a driver with no link speed reports
DUPLEX = {0: "half", 1: "full"}  # DUPLEX_HALF, DUPLEX_FULL; 0xff is DUPLEX_UNKNOWN


def link_speed(ifname: str) -> tuple[int | None, str | None]:
    """(Mb/s, "full" or "half") of ``ifname`` as its driver reports them; None for what it
    does not report (no ethtool support, unknown speed, or the device is gone)."""
    import array
    import fcntl

    cmd = array.array("B", _ETHTOOL_CMD.pack(ETHTOOL_GSET, *[0] * 17))
    ifr = struct.pack("16sP", ifname.encode(), cmd.buffer_info()[0])
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            fcntl.ioctl(s.fileno(), SIOCETHTOOL, ifr.ljust(_IFREQ_SIZE, b"\0"))
        except OSError as e:
            if e.errno in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENODEV):
                return None, None
            raise
    f = _ETHTOOL_CMD.unpack(cmd.tobytes())
    speed = f[12] << 16 | f[3]
    return (speed if 0 < speed < SPEED_UNKNOWN else None), DUPLEX.get(f[4])
