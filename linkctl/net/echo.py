"""ICMP echo through an unprivileged datagram socket: no `ping` process, no capability.

The serve unit runs with no capabilities and a seccomp filter that refuses setuid and
capset (linkctl-serve.service.in), so iputils `ping` cannot start there ("cap_set_proc:
Operation not permitted"). A datagram ICMP socket needs neither: Linux allows it to a
process whose group is in ``net.ipv4.ping_group_range`` (ip-sysctl.rst; systemd's
50-default.conf sets "0 2147483647" at boot on Debian and Ubuntu), macOS to any user
(icmp(4), SOCK_DGRAM). Linux hands back the ICMP message alone and picks the echo
identifier itself; macOS prepends the IP header: replies are matched by sequence number.
"""

from __future__ import annotations

import os
import select
import socket
import struct
import time

from linkctl.core.errors import InputError
from linkctl.net.ping import PingSummary

ECHO_REQUEST, ECHO_REPLY = 8, 0
PAYLOAD = b"linkctl-echo-0123456789abcdef"  # 29 bytes, a 57-byte IP packet on the wire
GROUP_RANGE = "/proc/sys/net/ipv4/ping_group_range"


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


def _not_permitted(address: str, err: OSError) -> InputError:
    try:
        with open(GROUP_RANGE) as f:
            allowed = " ".join(f.read().split())
    except OSError:
        allowed = None
    where = f"{GROUP_RANGE} is '{allowed}', " if allowed else ""
    return InputError(
        f"an ICMP socket to {address} is not permitted for group {os.getgid()} "
        f"({where}{err.strerror}): allow it with "
        "`sysctl -w net.ipv4.ping_group_range='0 2147483647'` (systemd's default)"
    )


def echo(address: str, *, count: int, interval_s: float, timeout_s: float) -> PingSummary:
    """``count`` echoes ``interval_s`` apart, each waited for up to ``timeout_s`` after
    the last one is sent. InputError when the system does not permit the socket."""
    try:
        sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM, socket.IPPROTO_ICMP)
    except PermissionError as e:
        raise _not_permitted(address, e) from None
    except OSError as e:
        raise InputError(f"an ICMP socket to {address} could not be opened: {e.strerror}") from None
    ident = os.getpid() & 0xFFFF
    sent_at: dict[int, int] = {}  # sequence -> when it left, until its reply comes
    n_sent = 0
    rtts: list[float] = []
    with sock:
        sock.setblocking(False)
        start = time.monotonic()
        deadline = start + interval_s * (count - 1) + timeout_s
        while len(rtts) < count:
            now = time.monotonic()
            if n_sent < count and now >= start + interval_s * n_sent:
                n_sent += 1
                try:
                    sock.sendto(_request(ident, n_sent), (address, 0))
                except PermissionError as e:  # a firewall (or IPAddressDeny=) refused it
                    raise InputError(
                        f"an ICMP echo to {address} was refused: {e.strerror}"
                    ) from None
                except OSError:  # no route, the interface gone: an echo lost
                    pass
                sent_at[n_sent] = time.perf_counter_ns()
                continue
            if now >= deadline:
                break
            wake = start + interval_s * n_sent if n_sent < count else deadline
            ready, _, _ = select.select([sock], [], [], max(0.0, min(wake, deadline) - now))
            if ready:
                seq = _reply_seq(sock.recv(1024))
                if seq in sent_at:
                    rtts.append((time.perf_counter_ns() - sent_at.pop(seq)) / 1000)
    if not rtts:
        return PingSummary(count, 0, None, None, None, None)
    avg = sum(rtts) / len(rtts)
    dev = (sum((r - avg) ** 2 for r in rtts) / len(rtts)) ** 0.5
    return PingSummary(
        count, len(rtts), round(min(rtts), 1), round(avg, 1), round(max(rtts), 1), round(dev, 1)
    )
