"""File transfer over the link: KV slot files (prefill host -> head) and model files
(head -> prefill host), bound to link addresses only, every byte checksummed.

The agent (`linkctl kv-agent`, on the prefill host) serves named areas (directories):
``kv`` is the prefill llama-server's --slot-save-path, ``models`` where `model sync`
puts GGUF files. It binds only to its own link address and answers only peers inside
the link subnet; it has no authentication, like rpc-server. One request per
connection, a JSON line first:

    {"op": "get", "area": A, "name": N, "delete": bool}
        <- {"ok": true, "size": S}\\n, S bytes, {"sha256": HEX}\\n
    {"op": "put", "area": A, "name": N, "size": S, "offset": O}
        <- {"ok": true}\\n; -> S-O bytes, {"sha256": HEX of the whole file}\\n
        <- {"ok": true, "sha256": HEX}\\n   (the file appears under N only then)
    {"op": "stat", "area": A, "name": N}
        <- {"ok": true, "size": S|null, "partial": P, "partial_sha256": HEX}
    {"op": "model"}
        <- {"ok": true, "path": P, "size": S, "sha256": HEX, "kv_layout": {...}}
           (linkctl.disagg.fingerprint.ModelFingerprint.as_wire)

A failure is {"ok": false, "error": "..."}. A put writes N.part and renames it only
after the whole-file SHA-256 matches, so a broken transfer leaves N.part to resume
from (offset = its size) and never a wrong N. A get hashes as it sends; the
client hashes as it receives and keeps the file only when both agree.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import ipaddress
import json
import os
import re
import socket
import socketserver
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, BinaryIO

from linkctl.core.errors import InputError
from linkctl.disagg.fingerprint import ModelFingerprint, fingerprint
from linkctl.llama.invocation import KvLayout

CHUNK = 4 * 1024 * 1024
PART_KEEP_S = 24 * 3600  # a partial copy not resumed within this is removed
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,200}$")
DEFAULT_PORT = 50053

Progress = Callable[[int, int], None]  # (bytes done, bytes total)


class TransferError(InputError):
    """The transfer failed (peer gone, refused, checksum mismatch); nothing was kept."""


@dataclass
class TransferResult:
    name: str
    bytes: int  # bytes moved over the wire
    size: int  # file size
    seconds: float
    sha256: str
    resumed_from: int = 0

    @property
    def gbps(self) -> float:
        return self.bytes * 8 / self.seconds / 1e9 if self.seconds > 0 else 0.0

    def as_dict(self) -> dict[str, Any]:
        return asdict(self) | {"gbps": round(self.gbps, 3)}


def _private(path: Path, append: bool = False) -> BinaryIO:
    """``path`` for writing, 0600 whatever the umask (a slot file holds a user's prompt;
    only this host's serve reads it back): truncated, or kept to resume (``append``)."""
    flags = os.O_RDWR | os.O_CREAT | (0 if append else os.O_TRUNC)
    fd = os.open(path, flags, 0o600)
    os.fchmod(fd, 0o600)  # a partial file from before keeps its mode otherwise
    return os.fdopen(fd, "r+b")


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
            f"the link subnet {subnet}; the agent has no authentication",
            "bind it to this host's link address",
        )


def _sha_of(path: Path, upto: int | None = None) -> hashlib._Hash:
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


def _line(sock_file) -> dict[str, Any]:
    raw = sock_file.readline(64 * 1024)
    if not raw:
        raise TransferError("peer closed the connection")
    try:
        msg = json.loads(raw)
    except ValueError:
        raise TransferError(f"peer sent a malformed line: {raw[:80]!r}") from None
    if not isinstance(msg, dict):
        raise TransferError(f"peer sent a malformed line: {raw[:80]!r}")
    return msg


def _send(sock: socket.socket, msg: dict[str, Any]) -> None:
    sock.sendall(json.dumps(msg).encode() + b"\n")


# ---- the agent (server) ---------------------------------------------------------


class _Handler(socketserver.StreamRequestHandler):
    server: _Server
    # A peer silent this long mid-request is dropped, freeing its thread and descriptor.
    timeout = 120.0

    def handle(self) -> None:
        peer = ipaddress.IPv4Address(self.client_address[0])
        if peer not in self.server.allowed:
            self.server.log(f"refused {peer}: not on the link subnet {self.server.allowed}")
            return
        try:
            req = _line(self.rfile)
            op = req.get("op")
            if op == "model":
                fp = fingerprint(self.server.model or "", self.server.kv)
                _send(self.connection, {"ok": True, **fp.as_wire()})
                return
            area = self.server.areas.get(str(req.get("area")))
            if area is None:
                raise InputError(f"unknown area {req.get('area')!r}")
            name = check_name(str(req.get("name", "")))
            path = area / name
            if op == "get":
                self._get(path, bool(req.get("delete")))
            elif op == "put":
                self._put(path, int(req["size"]), int(req.get("offset", 0)))
            elif op == "stat":
                part = path.with_name(name + ".part")
                psize = part.stat().st_size if part.exists() else 0
                _send(
                    self.connection,
                    {
                        "ok": True,
                        "size": path.stat().st_size if path.exists() else None,
                        "partial": psize,
                        "partial_sha256": _sha_of(part).hexdigest() if psize else None,
                    },
                )
            else:
                raise InputError(f"unknown op {op!r}")
        except (InputError, KeyError, ValueError, OSError) as e:
            msg = e.message if isinstance(e, InputError) else f"{type(e).__name__}: {e}"
            self.server.log(f"{peer}: {msg}")
            with contextlib.suppress(OSError):
                _send(self.connection, {"ok": False, "error": msg})

    def _get(self, path: Path, delete: bool) -> None:
        try:
            f = open(path, "rb")  # noqa: SIM115 (closed below)
        except FileNotFoundError:
            raise InputError(f"no file {path.name} in {path.parent}") from None
        with f:
            before = os.fstat(f.fileno())
            size = before.st_size
            _send(self.connection, {"ok": True, "size": size})
            h = hashlib.sha256()
            left = size
            while left > 0:
                b = f.read(min(CHUNK, left))
                if not b:
                    raise InputError(f"{path} shrank while it was sent")
                h.update(b)
                self.connection.sendall(b)
                left -= len(b)
            after = os.fstat(f.fileno())
        if (after.st_size, after.st_mtime_ns) != (size, before.st_mtime_ns):
            # Rewritten while it was read: the bytes sent are neither version. The
            # receiver gets no checksum line and keeps nothing.
            raise InputError(f"{path.name} changed while it was sent; run the copy again")
        _send(self.connection, {"sha256": h.hexdigest()})
        if delete:
            path.unlink(missing_ok=True)
        self.server.log(f"sent {path.name}: {size} bytes")

    def _put(self, path: Path, size: int, offset: int) -> None:
        with self.server.writing(path):
            self._put_one(path, size, offset)

    def _put_one(self, path: Path, size: int, offset: int) -> None:
        part = path.with_name(path.name + ".part")
        have = part.stat().st_size if part.exists() else 0
        if offset not in (0, have) or offset > size:
            raise InputError(f"offset {offset} does not match the partial file ({have} bytes)")
        h = _sha_of(part, offset) if offset else hashlib.sha256()
        _send(self.connection, {"ok": True})
        with _private(part, append=bool(offset)) as f:
            f.seek(offset)
            f.truncate()
            left = size - offset
            try:
                while left > 0:
                    b = self.rfile.read(min(CHUNK, left))
                    if not b:
                        raise InputError(f"peer closed after {size - left} of {size} bytes")
                    h.update(b)
                    f.write(b)
                    left -= len(b)
                f.flush()
                os.fsync(f.fileno())
            except OSError as e:
                if e.errno != errno.ENOSPC:
                    raise
                part.unlink(missing_ok=True)  # its space back; a resume could not finish
                raise InputError(
                    f"no space left in {path.parent} for {path.name} ({size} bytes)",
                    "free space on this host, then run the copy again",
                ) from None
        want = _line(self.rfile).get("sha256")
        got = h.hexdigest()
        # The checksum of the bytes on disk, read back: what the stream carried is not
        # proof of what was stored.
        stored = _sha_of(part).hexdigest()
        if not want == got == stored:
            part.unlink(missing_ok=True)
            raise InputError(
                f"checksum mismatch for {path.name}: sent {want}, received {got}, stored {stored}"
            )
        part.replace(path)
        _send(self.connection, {"ok": True, "sha256": got})
        self.server.log(f"received {path.name}: {size} bytes (from offset {offset})")


class _Server(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(
        self,
        addr: tuple[str, int],
        areas: dict[str, Path],
        allowed: ipaddress.IPv4Network,
        log: Callable[[str], None],
        model: str | None,
        kv: KvLayout | None,
    ):
        self.areas, self.allowed, self.log, self.model = areas, allowed, log, model
        self.kv = kv
        self._writing: set[Path] = set()
        self._writing_lock = threading.Lock()
        super().__init__(addr, _Handler)

    @contextlib.contextmanager
    def writing(self, path: Path) -> Iterator[None]:
        """One put per name at a time: a second one is refused, not interleaved."""
        with self._writing_lock:
            if path in self._writing:
                raise InputError(
                    f"{path.name} is being written by another copy",
                    "wait for it to finish, then run this one again",
                )
            self._writing.add(path)
        try:
            yield
        finally:
            with self._writing_lock:
                self._writing.discard(path)


class Agent:
    """The agent, running in a background thread: ``with Agent(...) as a: ...``."""

    def __init__(
        self,
        bind: str,
        port: int,
        areas: dict[str, Path],
        subnet: ipaddress.IPv4Network,
        log: Callable[[str], None] | None = None,
        model: str | None = None,
        kv: KvLayout | None = None,
    ):
        check_bind(bind, subnet)
        for name, d in areas.items():
            if not Path(d).is_dir():
                raise InputError(f"kv-agent area {name}: {d} is not a directory", "create it")
        dirs = {k: Path(v) for k, v in areas.items()}
        try:
            self.server = _Server((bind, port), dirs, subnet, log or (lambda _m: None), model, kv)
        except OSError as e:
            raise InputError(
                f"kv-agent cannot listen on {bind}:{port}: {e}",
                "stop the other kv-agent, or configure the link address (`linkctl setup`)",
            ) from None
        self.port = self.server.server_address[1]
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def start(self) -> Agent:
        self._sweep_parts()
        self._thread.start()
        return self

    def _sweep_parts(self) -> None:
        """Partial files older than PART_KEEP_S: a copy that was never resumed."""
        cutoff = time.time() - PART_KEEP_S
        for area in self.server.areas.values():
            for part in area.glob("*.part"):
                with contextlib.suppress(OSError):
                    if part.stat().st_mtime < cutoff:
                        part.unlink()
                        self.server.log(f"removed {part.name}: not resumed within a day")

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def __enter__(self) -> Agent:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


# ---- the client -------------------------------------------------------------------


def _connect(host: str, port: int, source: str | None, timeout: float) -> socket.socket:
    try:
        s = socket.create_connection(
            (host, port), timeout=timeout, source_address=(source, 0) if source else None
        )
    except OSError as e:
        raise TransferError(
            f"kv-agent {host}:{port}: {e}", "is `linkctl kv-agent` running there?"
        ) from None
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return s


def _request(s: socket.socket, f, req: dict[str, Any]) -> dict[str, Any]:
    _send(s, req)
    msg = _line(f)
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
    source: str | None = None,
    delete: bool = False,
    timeout: float = 30.0,
    progress: Progress | None = None,
) -> TransferResult:
    """Copy ``area/name`` from the agent to ``dest``. ``dest`` appears only when the
    SHA-256 the agent computed while sending matches the one computed here."""
    check_name(name)
    part = dest.with_name(dest.name + ".part")
    t0 = time.monotonic()
    try:
        with _connect(host, port, source, timeout) as s, s.makefile("rb") as f:
            head = _request(s, f, {"op": "get", "area": area, "name": name, "delete": delete})
            size = int(head["size"])
            h = hashlib.sha256()
            with _private(part) as out:
                left = size
                while left > 0:
                    b = f.read1(min(CHUNK, left))
                    if not b:
                        raise TransferError(f"kv-agent closed after {size - left} of {size} bytes")
                    h.update(b)
                    out.write(b)
                    left -= len(b)
                    if progress:
                        progress(size - left, size)
            tail = _line(f)
        if tail.get("ok") is False:  # the agent's own refusal, after the bytes
            raise TransferError(f"kv-agent {host}:{port}: {tail.get('error')}")
        want = tail.get("sha256")
        got = h.hexdigest()
        if want != got:
            raise TransferError(f"checksum mismatch for {name}: agent sent {want}, received {got}")
        part.replace(dest)
    except (OSError, ValueError) as e:
        part.unlink(missing_ok=True)
        raise TransferError(f"fetch {name} from {host}:{port}: {e}") from None
    except BaseException:
        part.unlink(missing_ok=True)
        raise
    return TransferResult(name, size, size, time.monotonic() - t0, got)


def stat(
    host: str, port: int, area: str, name: str, *, source: str | None = None, timeout: float = 30.0
) -> dict[str, Any]:
    check_name(name)
    return _ask(host, port, {"op": "stat", "area": area, "name": name}, source, timeout)


def remote_model(
    host: str, port: int, *, source: str | None = None, timeout: float = 120.0
) -> ModelFingerprint:
    """The fingerprint of the model the agent's host serves, with the KV layout its
    llama-server runs."""
    return ModelFingerprint.from_wire(_ask(host, port, {"op": "model"}, source, timeout))


def _ask(host: str, port: int, req: dict[str, Any], source: str | None, timeout: float):
    try:
        with _connect(host, port, source, timeout) as s, s.makefile("rb") as f:
            return _request(s, f, req)
    except OSError as e:
        raise TransferError(f"{req['op']} on kv-agent {host}:{port}: {e}") from None


def put(
    host: str,
    port: int,
    area: str,
    src: Path,
    *,
    name: str | None = None,
    source: str | None = None,
    timeout: float = 30.0,
    progress: Progress | None = None,
) -> TransferResult:
    """Copy ``src`` to the agent's ``area``, resuming a partial copy whose prefix
    matches this file (its SHA-256 is compared; a different prefix starts over)."""
    name = check_name(name or src.name)
    size = src.stat().st_size
    st = stat(host, port, area, name, source=source, timeout=timeout)
    offset = int(st.get("partial") or 0)
    h = hashlib.sha256()
    if 0 < offset <= size:
        h = _sha_of(src, offset)
        if h.hexdigest() != st.get("partial_sha256"):
            offset, h = 0, hashlib.sha256()
    else:
        offset = 0
    t0 = time.monotonic()
    try:
        with _connect(host, port, source, timeout) as s, s.makefile("rb") as f:
            _request(
                s, f, {"op": "put", "area": area, "name": name, "size": size, "offset": offset}
            )
            with open(src, "rb") as inp:
                inp.seek(offset)
                done = offset
                while done < size:
                    b = inp.read(min(CHUNK, size - done))
                    if not b:
                        raise TransferError(f"{src} shrank while it was sent")
                    h.update(b)
                    s.sendall(b)
                    done += len(b)
                    if progress:
                        progress(done, size)
            digest = h.hexdigest()
            _send(s, {"sha256": digest})
            reply = _line(f)
            if not reply.get("ok"):
                raise TransferError(f"kv-agent rejected {name}: {reply.get('error')}")
    except OSError as e:
        raise TransferError(f"put {name} to {host}:{port}: {e}", "rerun to resume") from None
    return TransferResult(name, size - offset, size, time.monotonic() - t0, digest, offset)
