"""The authenticated channel: a mutual HMAC-SHA256 challenge-response over the pair
secret, then every JSON line carrying an HMAC under a key of that connection alone.

The handshake is the three-pass mutual authentication of ISO/IEC 9798-4 (section 5.2.2)
with HMAC-SHA256 (RFC 2104) as the keyed function; each side's nonce is fresh, so a
recorded exchange proves nothing on another connection (no replay), and neither side
says anything about itself before the other has proved the secret:

    server -> client   {"linkctl": "auth", "v": 1, "service": S, "nonce": Ns}
    client -> server   {"nonce": Nc, "mac": HMAC(K, "client" S Ns Nc)}
    server -> client   {"ok": true, "mac": HMAC(K, "server" S Ns Nc)}
                       or {"ok": false, "error": "..."} and the server closes

Then each JSON line is {"m": MESSAGE, "mac": HMAC(K_c, direction, sequence number,
MESSAGE)} with K_c = HMAC(K, "session" S Ns Nc): a line cannot be changed, dropped,
reordered or carried to another connection without the receiver refusing it.

Bulk bytes (a KV slot file, which holds a user's prompt; a model) cross as records
sealed with AES-128-GCM (NIST SP 800-38D; TLS 1.3's mandatory cipher, RFC 8446
section 9.1) under K_b, the first 16 bytes of HMAC(K_c, "bulk records"):

    4-byte big-endian length L, then L bytes: ciphertext and its 16-byte tag

with the deterministic nonce of SP 800-38D section 8.2.1: a 4-byte field naming the
sender (client 0, server 1) and an 8-byte count of the records that sender has sent
on this connection. A record that was changed, replayed, reordered or carried from
another connection fails its tag. The key is fresh per connection, so a nonce never
repeats under it. AES-GCM runs at about 10 GB/s on one core here (AES-NI), where
SHA-256 ran at 1.1-1.7 GB/s: the seal is what lets one core keep a 10 Gbit/s link
busy (bench/kv_line_rate.py). The JSON lines are authenticated, not encrypted: they
carry names, sizes and checksums, never file contents.
"""

from __future__ import annotations

import hashlib
import hmac
import io
import json
import secrets
import socket
from typing import Any, Protocol

from linkctl.core.errors import InputError

VERSION = 1
MAX_LINE = 64 * 1024
TAG = 16  # AES-GCM's tag, at the end of every record
LOWAT = 1 << 20  # wake the reader of a record per MiB, not per packet


class Reader(Protocol):
    """A buffered socket reader (socket.makefile("rb"), a handler's rfile)."""

    def readline(self, size: int = -1, /) -> bytes: ...

    def read(self, size: int = -1, /) -> bytes | None: ...

    def readinto(self, buffer: memoryview, /) -> int | None: ...


class AuthError(InputError):
    """The other end did not prove the pair secret, or a line failed its check."""


def _mac(key: bytes, *parts: str) -> str:
    return hmac.new(key, "\n".join(parts).encode(), hashlib.sha256).hexdigest()


def read_line(rfile: Reader, where: str, limit: int = MAX_LINE) -> dict[str, Any]:
    raw = rfile.readline(limit)
    if not raw:
        raise AuthError(f"{where} closed the connection")
    if not raw.endswith(b"\n"):
        raise AuthError(f"{where} sent a line longer than {limit} bytes")
    try:
        msg = json.loads(raw)
    except ValueError:
        raise AuthError(f"{where} sent a malformed line: {raw[:80]!r}") from None
    if not isinstance(msg, dict):
        raise AuthError(f"{where} sent a malformed line: {raw[:80]!r}")
    return msg


def _write(sock: socket.socket, msg: dict[str, Any]) -> None:
    sock.sendall(json.dumps(msg, separators=(",", ":")).encode() + b"\n")


class Channel:
    """JSON lines with a MAC each, both ways, after a handshake (``accept``/``connect``).
    ``sock`` and ``rfile`` stay usable for bulk bytes between lines."""

    def __init__(self, sock: socket.socket, rfile: Reader, key: bytes, me: str, peer: str):
        self.sock, self.rfile = sock, rfile
        self._key, self._me, self._peer = key, me, peer
        self._sent = self._received = 0
        self._sealed = self._opened = 0
        self._bulk_key = hmac.new(key, b"bulk records", "sha256").digest()[:16]
        self._aead: Any = None
        self._seal_buf = self._open_buf = bytearray()
        self.where = peer

    def send(self, msg: dict[str, Any]) -> None:
        body = json.dumps(msg, separators=(",", ":"), sort_keys=True)
        mac = _mac(self._key, self._me, str(self._sent), body)
        self._sent += 1
        self.sock.sendall(json.dumps({"m": body, "mac": mac}).encode() + b"\n")

    def recv(self) -> dict[str, Any]:
        line = read_line(self.rfile, self.where)
        body, mac = line.get("m"), line.get("mac")
        want = _mac(self._key, self._peer, str(self._received), str(body))
        if not (isinstance(body, str) and isinstance(mac, str) and hmac.compare_digest(mac, want)):
            raise AuthError(f"{self.where} sent a line that fails its authentication check")
        self._received += 1
        msg = json.loads(body)
        if not isinstance(msg, dict):
            raise AuthError(f"{self.where} sent a malformed message")
        return msg

    def _cipher(self) -> Any:
        if self._aead is None:  # imported here: the CLI's read-only paths never load it
            from cryptography.hazmat.primitives.ciphers.aead import AESGCM

            self._aead = AESGCM(self._bulk_key)
        return self._aead

    def send_bytes(self, data: bytes | bytearray | memoryview) -> None:
        """One sealed record of ``data`` (the receiver's buffer bounds its size)."""
        nonce = _nonce(self._me, self._sealed)
        self._sealed += 1
        n = len(data) + TAG
        if len(self._seal_buf) < n:
            self._seal_buf = bytearray(n)
        # Sealed into one buffer kept for the connection: a fresh 4 MiB object per
        # record costs page faults that a 10 Gbit/s copy notices (bench/kv_line_rate.py).
        sealed = memoryview(self._seal_buf)[:n]
        self._cipher().encrypt_into(nonce, data, None, sealed)
        self.sock.sendall(n.to_bytes(4, "big"))
        self.sock.sendall(sealed)

    def recv_into(self, buf: bytearray | memoryview) -> int:
        """The next record's bytes into ``buf`` (a longer record is refused), checked
        against its tag; how many."""
        head = memoryview(bytearray(4))
        # Through the reader, which buffers what follows: the body's read then starts
        # from bytes already here, with no read of its own into a fresh object.
        _read_exactly(self.rfile, head, self.where)
        n = int.from_bytes(head, "big")
        # Never an empty record: a reader counting bytes towards a size would not move.
        if not TAG < n <= len(buf) + TAG:
            raise AuthError(
                f"{self.where} sent a record of {n} bytes "
                f"(a record holds 1 to {len(buf)} bytes and a {TAG}-byte tag)"
            )
        if len(self._open_buf) < n:
            self._open_buf = bytearray(n)
        sealed = memoryview(self._open_buf)[:n]
        self._read_body(sealed)
        from cryptography.exceptions import InvalidTag

        nonce = _nonce(self._peer, self._opened)
        try:
            self._cipher().decrypt_into(nonce, sealed, None, memoryview(buf)[: n - TAG])
        except InvalidTag:
            raise AuthError(f"{self.where} sent a record that fails its tag") from None
        self._opened += 1
        return n - TAG

    def _read_body(self, into: memoryview) -> None:
        """``len(into)`` bytes: those the reader holds already, then straight from the
        socket, asking the kernel (SO_RCVLOWAT, socket(7)) to wake this thread once a
        whole slice has arrived instead of at every packet."""
        # An unbuffered reader (the responder's) holds nothing ahead of the socket.
        held = self.rfile.read1(len(into)) if isinstance(self.rfile, io.BufferedReader) else b""
        got = len(held)
        into[:got] = held
        try:
            while got < len(into):
                lowat = min(len(into) - got, LOWAT)
                self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, lowat)
                k = self.sock.recv_into(into[got:])
                if not k:
                    raise AuthError(f"{self.where} closed the connection inside a record")
                got += k
        finally:
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, 1)


def _nonce(sender: str, count: int) -> bytes:
    return (0 if sender == "client" else 1).to_bytes(4, "big") + count.to_bytes(8, "big")


def _read_exactly(rfile: Reader, into: memoryview, where: str) -> None:
    got = 0
    while got < len(into):
        n = rfile.readinto(into[got:])
        if not n:
            raise AuthError(f"{where} closed the connection inside a record")
        got += n


def accept(sock: socket.socket, rfile: Reader, key: bytes, service: str, peer: str) -> Channel:
    """The server's side: challenge, check the client's proof (refusing it with a line
    and AuthError), prove the secret back. ``peer`` names the client in messages."""
    ns = secrets.token_hex(16)
    _write(sock, {"linkctl": "auth", "v": VERSION, "service": service, "nonce": ns})
    reply = read_line(rfile, peer, 1024)
    nc, mac = reply.get("nonce"), reply.get("mac")
    ok = (
        isinstance(nc, str)
        and len(nc) == 32
        and isinstance(mac, str)
        and hmac.compare_digest(mac, _mac(key, "client", service, ns, nc))
    )
    if not ok:
        _write(sock, {"ok": False, "error": "not authenticated: this host's pair secret differs"})
        raise AuthError(f"{peer} did not prove the pair secret")
    _write(sock, {"ok": True, "mac": _mac(key, "server", service, ns, str(nc))})
    return Channel(sock, rfile, _session_key(key, service, ns, str(nc)), "server", "client")


def connect(sock: socket.socket, rfile: Reader, key: bytes, service: str, peer: str) -> Channel:
    """The client's side: answer the challenge, then check the server's proof."""
    hello = read_line(rfile, peer, 1024)
    ns = hello.get("nonce")
    if hello.get("linkctl") != "auth" or not isinstance(ns, str) or len(ns) != 32:
        raise AuthError(f"{peer} is not a linkctl {service} (no authentication offered)")
    if hello.get("v") != VERSION or hello.get("service") != service:
        raise AuthError(
            f"{peer} offers {hello.get('service')} v{hello.get('v')}, not {service} v{VERSION}"
        )
    nc = secrets.token_hex(16)
    _write(sock, {"nonce": nc, "mac": _mac(key, "client", service, ns, nc)})
    reply = read_line(rfile, peer, 1024)
    if reply.get("ok") is not True:
        raise AuthError(f"{peer} refused this host: {reply.get('error')}")
    mac = reply.get("mac")
    if not (
        isinstance(mac, str) and hmac.compare_digest(mac, _mac(key, "server", service, ns, nc))
    ):
        raise AuthError(f"{peer} did not prove the pair secret")
    return Channel(sock, rfile, _session_key(key, service, ns, nc), "client", "server")


def _session_key(key: bytes, service: str, ns: str, nc: str) -> bytes:
    return hmac.new(key, "\n".join(("session", service, ns, nc)).encode(), "sha256").digest()
