"""The pairing channel: UDP over IPv6 link-local on one interface, nothing else.

Announcements go to ff02::1 (all nodes on the link; RFC 4291 2.7.1) with a hop
limit of 1, replies to the sender's fe80:: address; the socket is bound to the
interface (SO_BINDTODEVICE on Linux, IPV6_BOUND_IF on macOS: xnu
bsd/netinet6/in6.h), so no packet leaves by another interface and none is read from
one. A datagram from a non-link-local source or another interface is dropped; one
from the link that is oversized or malformed is a refusal (the peer is untrusted).
"""

from __future__ import annotations

import contextlib
import json
import socket
import struct
import sys
import time
from dataclasses import dataclass
from typing import Any, Literal

from linkctl.core.errors import InputError, NeedsRoot
from linkctl.pair.announce import MAX_BYTES, Announcement, parse

PORT = 50071
GROUP = "ff02::1"
IPV6_BOUND_IF = 125  # macOS (xnu bsd/netinet6/in6.h); Linux uses SO_BINDTODEVICE
Kind = Literal["hello", "confirm", "decline", "done"]


@dataclass(frozen=True)
class Message:
    kind: Kind
    ann: Announcement  # the sender's announcement, with every message
    digest: str = ""  # confirm: sha256 of the profile the sender agreed to
    seen: bool = False  # confirm: the sender has the receiver's confirm
    reason: str = ""  # decline: why, for the other screen
    source: str = ""  # filled on receipt: fe80::...%IF
    sent: float = 0.0  # the sender's clock when it sent this (set by encode)

    def encode(self) -> bytes:
        d: dict[str, Any] = {
            "linkctl_pair": self.kind,
            "sent": time.time(),
            "ann": self.ann.model_dump(mode="json"),
        }
        if self.kind == "confirm":
            d.update(digest=self.digest, seen=self.seen)
        if self.kind == "decline":
            d["reason"] = self.reason[:200]
        return json.dumps(d, separators=(",", ":")).encode()


def decode(data: bytes, source: str) -> Message:
    """A datagram from the link -> Message; InputError naming what is wrong."""
    if len(data) > MAX_BYTES:
        raise InputError(
            f"oversized announcement from {source}: {len(data)} bytes (at most {MAX_BYTES})",
            "only linkctl pair may answer on the cable; unplug the host that sends it",
        )
    try:
        d = json.loads(data)
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise InputError(
            f"malformed announcement from {source}: not JSON",
            "only linkctl pair may answer on the cable; unplug the host that sends it",
        ) from None
    kind = d.get("linkctl_pair") if isinstance(d, dict) else None
    if kind not in ("hello", "confirm", "decline", "done"):
        raise InputError(
            f"malformed announcement from {source}: linkctl_pair: {str(kind)[:20]!r}",
            "install the same linkctl on both hosts",
        )
    extra = set(d) - {"linkctl_pair", "sent", "ann", "digest", "seen", "reason"}
    digest, seen, reason = d.get("digest", ""), d.get("seen", False), d.get("reason", "")
    sent = d.get("sent")
    if (
        extra
        or not isinstance(sent, int | float)
        or isinstance(sent, bool)
        or not 0 < sent < 1e11
        or not isinstance(digest, str)
        or len(digest) > 64
        or not isinstance(seen, bool)
        or not isinstance(reason, str)
        or len(reason) > 200
    ):
        raise InputError(
            f"malformed announcement from {source}: {sorted(extra) or 'sent/digest/seen/reason'}",
            "install the same linkctl on both hosts",
        )
    reason = "".join(c for c in reason if c.isprintable())
    return Message(kind, parse(d.get("ann"), source), digest, seen, reason, source, float(sent))


class Channel:
    """One UDP socket on ``ifname``'s link-local scope (a context manager)."""

    def __init__(self, ifname: str, port: int = PORT):
        self.ifname, self.port = ifname, port
        try:
            self.index = socket.if_nametoindex(ifname)
        except OSError:
            raise InputError(f"no interface {ifname!r}", "name an interface that exists") from None
        s = socket.socket(socket.AF_INET6, socket.SOCK_DGRAM)
        try:
            self._bind(s)
        except BaseException:
            s.close()
            raise
        self.sock = s

    def _bind(self, s: socket.socket) -> None:
        try:
            if sys.platform == "darwin":
                s.setsockopt(socket.IPPROTO_IPV6, IPV6_BOUND_IF, self.index)
            else:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_BINDTODEVICE, self.ifname.encode())
        except PermissionError:
            raise NeedsRoot(
                f"binding to {self.ifname} needs root", "run it with sudo: sudo linkctl pair"
            ) from None
        s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_MULTICAST_IF, self.index)
        s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_MULTICAST_HOPS, 1)
        s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_UNICAST_HOPS, 1)
        s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_MULTICAST_LOOP, 0)
        # All nodes: joined by every IPv6 interface already. BSD delivers multicast only
        # to a socket with its own membership; Linux delivers it without one (and may
        # answer the join with EADDRINUSE), so only there is a failed join harmless.
        mreq = socket.inet_pton(socket.AF_INET6, GROUP) + struct.pack("@I", self.index)
        try:
            s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_JOIN_GROUP, mreq)
        except OSError as e:
            if sys.platform == "darwin":
                raise InputError(
                    f"cannot join {GROUP} on {self.ifname}: {e.strerror}",
                    "check that IPv6 is on for the port (networksetup -setv6automatic)",
                ) from None
        try:
            s.bind(("::", self.port, 0, 0))
        except OSError as e:
            raise InputError(
                f"cannot listen on UDP port {self.port} of {self.ifname}: {e.strerror}",
                "is another `linkctl pair` running here? stop it and run this one again",
            ) from None

    def __enter__(self) -> Channel:
        return self

    def __exit__(self, *exc: object) -> None:
        self.sock.close()

    def send(self, msg: Message, to: str | None = None) -> None:
        """To ``to`` (a fe80:: address) or to every node on the link."""
        dest = (to.split("%")[0] if to else GROUP, self.port, 0, self.index)
        # No link-local address yet (DAD) or no carrier: the next round resends.
        with contextlib.suppress(OSError):
            self.sock.sendto(msg.encode(), dest)

    def receive(self, until: float) -> Message | None:
        """The next message from the link before ``until`` (monotonic), else None."""
        while True:
            left = until - time.monotonic()
            if left <= 0:
                return None
            self.sock.settimeout(left)
            try:
                data, addr = self.sock.recvfrom(MAX_BYTES + 1)
            except TimeoutError:
                return None
            host, _port, _flow, scope = addr[:4]
            if not host.lower().startswith("fe80:") or scope not in (0, self.index):
                continue  # not from this link: never ours to read
            return decode(data, f"{host.split('%')[0]}%{self.ifname}")
