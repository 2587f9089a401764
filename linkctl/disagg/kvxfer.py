"""File transfer over the link: KV slot files (prefill host -> head) and model files
(head -> prefill host), bound to link addresses only, every byte sealed and checked.

The agent (`linkctl kv-agent`, on the prefill host; linkctl.disagg.kvagent) serves named
areas (directories):
``kv`` is the prefill llama-server's --slot-save-path, ``models`` where `model sync`
puts GGUF files. It binds only to its own link address, answers only peers inside
the link subnet, and only those that prove the pair secret
(linkctl.trust.session: a mutual challenge-response, then every JSON line below
authenticated) before any request is read. One request per connection:

    {"op": "get", "area": A, "name": N, "delete": bool}
        <- {"ok": true, "size": S}\n, S bytes in sealed records, {"ok": true}\n
    {"op": "put", "area": A, "name": N, "size": S, "offset": O}
        <- {"ok": true}\n; -> S-O bytes in sealed records, {"sha256": HEX of the whole
        file}\n <- {"ok": true, "sha256": HEX}\n   (the file appears under N only then)
    {"op": "stat", "area": A, "name": N}
        <- {"ok": true, "size": S|null, "partial": P, "partial_sha256": HEX}
    {"op": "model"}
        <- {"ok": true, "path": P, "size": S, "sha256": HEX, "kv_layout": {...}}
           (linkctl.disagg.fingerprint.ModelFingerprint.as_wire)
    {"op": "server"}
        <- {"ok": true, "ours": bool, "why": "..."}: whether what listens on this
           host's prefill port is the llama-server this serve started (route asks
           before it sends the prefill server a key or a prompt)

A failure is {"ok": false, "error": "..."}. The file bytes cross in records sealed
with AES-128-GCM under a key of that connection (linkctl.trust.session.Channel
.send_bytes): a changed, dropped or reordered record fails its tag, and the size in
the authenticated first line says where the file ends, so a get needs no checksum
of its own: what is kept is, byte for byte, what the agent read. The closing line
says whether the file held still while it was read. A put (a model: large, resumed
after a break) is also hashed whole on both ends: it writes N.part, and renames it
only after the SHA-256 of what was sent, what arrived and what is on disk agree, so
a broken transfer leaves N.part to resume from (offset = its size) and never a
wrong N.

What one peer can make the agent do is bounded: MAX_CONNECTIONS at once (threads and
descriptors), MAX_UNPROVEN per address still in the handshake, AUTH_TIMEOUT_S to
prove the secret, and IDLE_TIMEOUT_S of silence mid-request.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import ipaddress
import os
import queue
import re
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, BinaryIO

from linkctl.core.errors import InputError
from linkctl.disagg.fingerprint import ModelFingerprint
from linkctl.trust import session
from linkctl.trust.secret import PairSecret

CHUNK = 4 * 1024 * 1024
PART_KEEP_S = 24 * 3600  # a partial copy not resumed within this is removed
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,200}$")
DEFAULT_PORT = 50053
SERVICE = "kv-agent"
MAX_CONNECTIONS = 32  # connections served at once; more are closed at accept
MAX_UNPROVEN = 4  # per address, connections that have not yet proved the secret
AUTH_TIMEOUT_S = 5.0
IDLE_TIMEOUT_S = 120.0

Progress = Callable[[int, int], None]  # (bytes done, bytes total)
# None when the prefill server listening is the one this serve started, else why not.
ServerCheck = Callable[[], str | None]


class TransferError(InputError):
    """The transfer failed (peer gone, refused, checksum mismatch); nothing was kept."""


@dataclass
class TransferResult:
    name: str
    bytes: int  # bytes moved over the wire
    size: int  # file size
    seconds: float
    sha256: str | None  # a put's whole-file SHA-256; None for a get (its records are checked)
    resumed_from: int = 0

    @property
    def gbps(self) -> float:
        return self.bytes * 8 / self.seconds / 1e9 if self.seconds > 0 else 0.0

    def as_dict(self) -> dict[str, Any]:
        return asdict(self) | {"gbps": round(self.gbps, 3)}


def private_file(path: Path, append: bool = False) -> BinaryIO:
    """``path`` for writing, 0600 whatever the umask (a slot file holds a user's prompt;
    only this host's serve reads it back): truncated, or kept to resume (``append``)."""
    flags = os.O_RDWR | os.O_CREAT | (0 if append else os.O_TRUNC)
    fd = os.open(path, flags, 0o600)
    os.fchmod(fd, 0o600)  # a partial file from before keeps its mode otherwise
    return os.fdopen(fd, "r+b")


class Sink:
    """Writes the chunks handed to ``add`` to ``out`` and/or hashes them into ``h``, in a
    thread of its own: file writes and hashlib release the GIL on large buffers, so the
    socket is read while the chunk before is stored (in line, the store held a 10
    Gbit/s copy back; bench/kv_line_rate.py). Chunks live in BUFFERS buffers of CHUNK
    bytes that the thread hands back once stored, reused for the whole copy: a fresh
    object per chunk costs page faults. ``with Sink(...) as sk: sk.receive(ch, n);
    sk.finish()``; an error of the thread (ENOSPC) is raised in the caller's, at the
    next chunk or at finish."""

    BUFFERS = 6

    def __init__(self, out: BinaryIO | None = None, h: hashlib._Hash | None = None):
        self.out, self.h = out, h
        self.received = 0  # bytes taken from the channel so far
        self._q: queue.Queue[tuple[bytearray, int] | None] = queue.Queue()
        self._free: queue.Queue[bytearray] = queue.Queue()
        for _ in range(self.BUFFERS):
            self._free.put(bytearray(CHUNK))
        self._err: BaseException | None = None
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _run(self) -> None:
        while (item := self._q.get()) is not None:
            buf, n = item
            if self._err is None:  # after an error, only drained: add() never blocks
                try:
                    b = memoryview(buf)[:n]
                    if self.h is not None:
                        self.h.update(b)
                    if self.out is not None:
                        self.out.write(b)
                except BaseException as e:  # re-raised in the caller's thread
                    self._err = e
            self._free.put(buf)

    def receive(self, ch: session.Channel, size: int, progress: Progress | None = None) -> None:
        """``size`` bytes of sealed records from ``ch``, each stored (hashed) by the
        thread while the next is received."""
        while self.received < size:
            if self._err is not None:
                raise self._err
            buf = self._free.get()  # once the thread has stored one
            n = ch.recv_into(memoryview(buf)[: min(CHUNK, size - self.received)])
            self._q.put((buf, n))
            self.received += n
            if progress:
                progress(self.received, size)

    def finish(self) -> None:
        """Wait for every chunk; raise the thread's error, if any."""
        self._q.put(None)
        self._t.join()
        if self._err is not None:
            raise self._err

    def __enter__(self) -> Sink:
        return self

    def __exit__(self, *exc: object) -> None:
        if self._t.is_alive():
            self._q.put(None)
            self._t.join()


class ReadAhead:
    """``size`` bytes of ``f`` from where it stands, in chunks that a thread of its own
    reads (and hashes into ``h``) while the caller seals and sends the chunk before:
    the read and the send overlap, as Sink's receive and write do. ``with ReadAhead(f,
    n, name) as ra: for chunk in ra: ...`` (a chunk stays valid until the next is
    asked for). A file that ends early raises TransferError in the caller."""

    BUFFERS = 3

    def __init__(self, f: io.BufferedReader, size: int, name: str, h: hashlib._Hash | None = None):
        self._f, self._size, self._name, self.h = f, size, name, h
        self._full: queue.Queue[tuple[bytearray, int] | BaseException | None] = queue.Queue()
        self._free: queue.Queue[bytearray | None] = queue.Queue()
        for _ in range(self.BUFFERS):
            self._free.put(bytearray(CHUNK))
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _run(self) -> None:
        left = self._size
        try:
            while left > 0:
                if (buf := self._free.get()) is None:
                    return  # the caller stopped early
                n = self._f.readinto(memoryview(buf)[: min(CHUNK, left)])
                if not n:
                    raise TransferError(f"{self._name} shrank while it was sent")
                if self.h is not None:
                    self.h.update(memoryview(buf)[:n])
                self._full.put((buf, n))
                left -= n
        except BaseException as e:  # raised in the caller's thread
            self._full.put(e)
            return
        self._full.put(None)

    def __iter__(self) -> Iterator[memoryview]:
        held: bytearray | None = None
        while True:
            item = self._full.get()
            if held is not None:
                self._free.put(held)
            if item is None:
                return
            if isinstance(item, BaseException):
                raise item
            held, n = item
            yield memoryview(held)[:n]

    def __enter__(self) -> ReadAhead:
        return self

    def __exit__(self, *exc: object) -> None:
        self._free.put(None)  # wakes a reader waiting for a buffer
        self._t.join()


def check_name(name: str) -> str:
    if not NAME_RE.fullmatch(name) or name.endswith(".part"):
        raise InputError(
            f"file name {name!r} is not allowed",
            "use letters, digits, '.', '_' and '-' only (no path, no .part)",
        )
    return name


def check_bind(bind: str, subnet: ipaddress.IPv4Network) -> None:
    """The agent binds to one link address, never a wildcard or another network."""
    ip = ipaddress.IPv4Address(bind)
    if ip.is_unspecified or ip not in subnet:
        raise InputError(
            f"kv-agent bind {bind} is {'a wildcard' if ip.is_unspecified else 'not on'} "
            f"the link subnet {subnet}",
            "bind it to this host's link address",
        )


def sha_of(path: Path, upto: int | None = None) -> hashlib._Hash:
    h = hashlib.sha256()
    left = path.stat().st_size if upto is None else upto
    with open(path, "rb") as f:
        while left > 0:
            b = f.read(min(CHUNK, left))
            if not b:
                break
            h.update(b)
            left -= len(b)
    return h


# ---- the client -------------------------------------------------------------------


@contextlib.contextmanager
def _channel(
    host: str, port: int, secret: PairSecret, source: str | None, timeout: float
) -> Iterator[session.Channel]:
    """A connection to the agent that has proved the pair secret both ways."""
    try:
        s = socket.create_connection(
            (host, port), timeout=timeout, source_address=(source, 0) if source else None
        )
    except OSError as e:
        raise TransferError(
            f"kv-agent {host}:{port}: {e}", "is `linkctl kv-agent` running there?"
        ) from None
    with s, s.makefile("rb") as f:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            ch = session.connect(s, f, secret.key, SERVICE, f"kv-agent {host}:{port}")
        except session.AuthError as e:
            raise TransferError(
                e.message, "both hosts need one pair secret: compare `linkctl key show` on each"
            ) from None
        yield ch


def _request(ch: session.Channel, req: dict[str, Any]) -> dict[str, Any]:
    ch.send(req)
    msg = ch.recv()
    if not msg.get("ok"):
        raise TransferError(f"kv-agent refused {req['op']} {req.get('name')}: {msg.get('error')}")
    return msg


def fetch(
    host: str,
    port: int,
    area: str,
    name: str,
    dest: Path,
    *,
    secret: PairSecret,
    source: str | None = None,
    delete: bool = False,
    timeout: float = 30.0,
    progress: Progress | None = None,
) -> TransferResult:
    """Copy ``area/name`` from the agent to ``dest``. ``dest`` appears only when every
    record passed its tag, all ``size`` bytes came, and the agent says the file held
    still while it read it."""
    check_name(name)
    part = dest.with_name(dest.name + ".part")
    t0 = time.monotonic()
    try:
        with _channel(host, port, secret, source, timeout) as ch:
            head = _request(ch, {"op": "get", "area": area, "name": name, "delete": delete})
            size = int(head["size"])
            with private_file(part) as out, Sink(out) as sk:
                sk.receive(ch, size, progress)
                sk.finish()
            tail = ch.recv()
        if tail.get("ok") is not True:  # the agent's own refusal, after the bytes
            raise TransferError(f"kv-agent {host}:{port}: {tail.get('error')}")
        part.replace(dest)
    except (OSError, ValueError) as e:
        part.unlink(missing_ok=True)
        raise TransferError(f"fetch {name} from {host}:{port}: {e}") from None
    except BaseException:
        part.unlink(missing_ok=True)
        raise
    return TransferResult(name, size, size, time.monotonic() - t0, None)


def stat(
    host: str,
    port: int,
    area: str,
    name: str,
    *,
    secret: PairSecret,
    source: str | None = None,
    timeout: float = 30.0,
) -> dict[str, Any]:
    check_name(name)
    return _ask(host, port, secret, {"op": "stat", "area": area, "name": name}, source, timeout)


def remote_model(
    host: str,
    port: int,
    *,
    secret: PairSecret,
    source: str | None = None,
    timeout: float = 120.0,
) -> ModelFingerprint:
    """The fingerprint of the model the agent's host serves, with the KV layout its
    llama-server runs."""
    return ModelFingerprint.from_wire(_ask(host, port, secret, {"op": "model"}, source, timeout))


def prefill_server_is_ours(
    host: str, port: int, *, secret: PairSecret, source: str | None = None, timeout: float = 10.0
) -> str | None:
    """None when the agent vouches that its host's prefill port is held by the
    llama-server its serve started; else why not (route then keeps the prompt here)."""
    got = _ask(host, port, secret, {"op": "server"}, source, timeout)
    return None if got.get("ours") is True else str(got.get("why") or "not vouched for")


def _ask(
    host: str,
    port: int,
    secret: PairSecret,
    req: dict[str, Any],
    source: str | None,
    timeout: float,
) -> dict[str, Any]:
    try:
        with _channel(host, port, secret, source, timeout) as ch:
            return _request(ch, req)
    except OSError as e:
        raise TransferError(f"{req['op']} on kv-agent {host}:{port}: {e}") from None


def put(
    host: str,
    port: int,
    area: str,
    src: Path,
    *,
    secret: PairSecret,
    name: str | None = None,
    source: str | None = None,
    timeout: float = 30.0,
    progress: Progress | None = None,
) -> TransferResult:
    """Copy ``src`` to the agent's ``area``, resuming a partial copy whose prefix
    matches this file (its SHA-256 is compared; a different prefix starts over)."""
    name = check_name(name or src.name)
    before = src.stat()
    size = before.st_size
    st = stat(host, port, area, name, secret=secret, source=source, timeout=timeout)
    offset = int(st.get("partial") or 0)
    h = hashlib.sha256()
    if 0 < offset <= size:
        h = sha_of(src, offset)
        if h.hexdigest() != st.get("partial_sha256"):
            offset, h = 0, hashlib.sha256()
    else:
        offset = 0
    t0 = time.monotonic()
    try:
        with _channel(host, port, secret, source, timeout) as ch:
            _request(ch, {"op": "put", "area": area, "name": name, "size": size, "offset": offset})
            with open(src, "rb") as inp:
                inp.seek(offset)
                done = offset
                with ReadAhead(inp, size - offset, str(src), h) as chunks:
                    for chunk in chunks:
                        ch.send_bytes(chunk)
                        done += len(chunk)
                        if progress:
                            progress(done, size)
                after = os.fstat(inp.fileno())
                digest = h.hexdigest()
            if (after.st_size, after.st_mtime_ns) != (size, before.st_mtime_ns):
                # The bytes sent are neither version: no checksum line, so the agent
                # keeps nothing under the name (a resume compares the prefix again).
                raise TransferError(
                    f"{src} changed while it was sent; nothing was kept as {name}",
                    "run the copy again once the file is final",
                )
            ch.send({"sha256": digest})
            reply = ch.recv()
            if not reply.get("ok"):
                raise TransferError(f"kv-agent rejected {name}: {reply.get('error')}")
    except OSError as e:
        raise TransferError(f"put {name} to {host}:{port}: {e}", "rerun to resume") from None
    return TransferResult(name, size - offset, size, time.monotonic() - t0, digest, offset)
