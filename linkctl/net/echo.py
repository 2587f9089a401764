"""ICMP echo through an unprivileged datagram socket: no `ping` process, no capability.

The serve unit runs with no capabilities and a seccomp filter that refuses setuid and
capset (linkctl-serve.service.in), so iputils `ping` cannot start there ("cap_set_proc:
Operation not permitted"). A datagram ICMP socket needs neither: Linux allows it to a
process whose group is in ``net.ipv4.ping_group_range`` (ip-sysctl.rst; systemd's
50-default.conf sets "0 2147483647", which Debian 13 ships in linux-sysctl-defaults and
Debian 12 does not ship at all: there the range is "1 0", no group), macOS to any user
(icmp(4), SOCK_DGRAM). Linux hands back the ICMP message alone and picks the echo
identifier itself; macOS prepends the IP header and hands every reply to every such
socket: replies are matched by source and sequence number.
"""

from __future__ import annotations

import os
import socket
import struct
import time
from collections.abc import Callable

from linkctl.core.checks import Check, Verdict
from linkctl.core.errors import InputError
from linkctl.net.ping import PingSummary

ECHO_REQUEST, ECHO_REPLY = 8, 0
PAYLOAD = b"linkctl-echo-0123456789abcdef"  # 29 bytes, a 57-byte IP packet on the wire
GROUP_RANGE = "/proc/sys/net/ipv4/ping_group_range"
SET_RANGE = (
    "sysctl -w net.ipv4.ping_group_range='0 2147483647' (and a file in /etc/sysctl.d to keep it)"
)


def _checksum(data: bytes) -> int:
    """RFC 1071's one's-complement sum (the Linux kernel recomputes it; macOS does not)."""
    if len(data) % 2:
        data += b"\0"
    s = sum(struct.unpack(f"!{len(data) // 2}H", data))
    s = (s >> 16) + (s & 0xFFFF)
    s += s >> 16
    return ~s & 0xFFFF


def _request(ident: int, seq: int) -> bytes:
    head = struct.pack("!BBHHH", ECHO_REQUEST, 0, 0, ident, seq)
    return struct.pack("!BBHHH", ECHO_REQUEST, 0, _checksum(head + PAYLOAD), ident, seq) + PAYLOAD


def _reply_seq(data: bytes) -> int | None:
    """The sequence number of an echo reply carrying our payload, else None."""
    if data and data[0] >> 4 == 4:  # macOS: the IP header first (its IHL in 32-bit words)
        data = data[(data[0] & 0x0F) * 4 :]
    if len(data) < 8 or data[0] != ECHO_REPLY or data[8:] != PAYLOAD:
        return None
    return int(struct.unpack("!H", data[6:8])[0])


def group_range() -> tuple[int, int]:
    """Linux's net.ipv4.ping_group_range in this network namespace (ip-sysctl.rst)."""
    try:
        with open(GROUP_RANGE) as f:
            lo, hi = (int(x) for x in f.read().split())
    except (OSError, ValueError) as e:
        raise InputError(f"cannot read {GROUP_RANGE}: {e}") from None
    return lo, hi


def _not_permitted(address: str, err: OSError) -> InputError:
    try:
        lo, hi = group_range()
        where = f"{GROUP_RANGE} is '{lo} {hi}', "
    except InputError:
        where = ""
    return InputError(
        f"an ICMP socket to {address} is not permitted for group {os.getgid()} "
        f"({where}{err.strerror}): allow it with {SET_RANGE}"
    )


def echo(address: str, *, count: int, interval_s: float, timeout_s: float) -> PingSummary:
    """``count`` echoes ``interval_s`` apart, each waited for up to ``timeout_s`` after
    the last one is sent. InputError when the system does not permit the socket or no
    echo could be sent (no route: the address or the interface gone)."""
    try:
        sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM, socket.IPPROTO_ICMP)
    except PermissionError as e:
        raise _not_permitted(address, e) from None
    except OSError as e:
        raise InputError(f"an ICMP socket to {address} could not be opened: {e.strerror}") from None
    ident = os.getpid() & 0xFFFF
    sent_at: dict[int, int] = {}  # sequence -> when it left, until its reply comes
    tries = 0
    unsent: OSError | None = None
    rtts: list[float] = []
    with sock:
        start = time.monotonic()
        deadline = start + interval_s * (count - 1) + timeout_s
        while len(rtts) < count:
            now = time.monotonic()
            if tries < count and now >= start + interval_s * tries:
                tries += 1
                seq = tries & 0xFFFF
                t0 = time.perf_counter_ns()
                try:
                    sock.sendto(_request(ident, seq), (address, 0))
                    sent_at[seq] = t0
                except PermissionError as e:  # a firewall (or IPAddressDeny=) refused it
                    raise InputError(
                        f"an ICMP echo to {address} was refused: {e.strerror}"
                    ) from None
                except OSError as e:  # no route: this echo never left
                    unsent = e
                continue
            if now >= deadline:
                break
            wake = start + interval_s * tries if tries < count else deadline
            # A timeout on the socket itself rather than select(): no limit on the
            # descriptor's number in a long-lived process.
            sock.settimeout(max(min(wake, deadline) - now, 1e-4))
            try:
                data, (source, _) = sock.recvfrom(1024)
            except TimeoutError:
                continue
            except OSError:  # an ICMP error queued on the socket: not a reply
                continue
            got = _reply_seq(data)
            # The source too: macOS hands every echo reply to every such socket.
            if source == address and got is not None and got in sent_at:
                rtts.append((time.perf_counter_ns() - sent_at.pop(got)) / 1000)
    if unsent is not None and len(sent_at) + len(rtts) == 0:
        raise InputError(f"no ICMP echo to {address} could be sent: {unsent.strerror}")
    left = len(sent_at) + len(rtts)  # the echoes that left
    if not rtts:
        return PingSummary(left, 0, None, None, None, None)
    avg = sum(rtts) / len(rtts)
    dev = (sum((r - avg) ** 2 for r in rtts) / len(rtts)) ** 0.5
    return PingSummary(
        left, len(rtts), round(min(rtts), 1), round(avg, 1), round(max(rtts), 1), round(dev, 1)
    )


def _span(gids: tuple[int, int]) -> str:
    return str(gids[0]) if gids[0] == gids[1] else f"{gids[0]}-{gids[1]}"


def unit_echo_check(
    read_groups: Callable[[], tuple[int, int] | None], unit_gids: tuple[int, int] | None
) -> Check:
    """doctor's "watch echo": whether the serve unit's group may open the watch's
    datagram ICMP socket; ``read_groups``: the backend's icmp_socket_groups (Linux's
    net.ipv4.ping_group_range; None on macOS, where any user may); ``unit_gids``: the
    serve unit's group ids as installed (None: not known here, not judged)."""
    name = "watch echo"
    try:
        groups = read_groups()
    except InputError as e:
        return Check(name, Verdict.WARN, detail=e.message)
    if groups is None:
        return Check(name, Verdict.PASS, detail="any user may open datagram ICMP sockets")
    lo, hi = groups
    shown = f"{lo} {hi}"
    if unit_gids is None:
        return Check(name, Verdict.SKIP, shown, detail="the serve unit's group is not known here")
    if lo <= unit_gids[0] and unit_gids[1] <= hi:
        return Check(name, Verdict.PASS, shown, detail=f"net.ipv4.ping_group_range {shown}")
    return Check(
        name,
        Verdict.WARN,
        shown,
        detail=f"net.ipv4.ping_group_range is '{shown}', the serve unit runs with group(s) "
        f"{_span(unit_gids)}: its watch cannot echo the peer when idle (status says WARN ping)",
        fix=SET_RANGE,
    )
