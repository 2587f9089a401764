"""The kv-agent itself (`linkctl kv-agent`, and `linkctl serve` on the prefill host): the
server side of the protocol linkctl.disagg.kvxfer describes, with its bounds
(MAX_CONNECTIONS, MAX_UNPROVEN per address, AUTH_TIMEOUT_S, IDLE_TIMEOUT_S)."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import ipaddress
import os
import shutil
import socket
import socketserver
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from linkctl.core.errors import InputError
from linkctl.disagg.fingerprint import fingerprint
from linkctl.disagg.kvxfer import (
    AUTH_TIMEOUT_S,
    IDLE_TIMEOUT_S,
    MAX_CONNECTIONS,
    MAX_UNPROVEN,
    PART_KEEP_S,
    SERVICE,
    ReadAhead,
    ServerCheck,
    Sink,
    check_bind,
    check_name,
    private_file,
    sha_of,
)
from linkctl.llama.invocation import KvLayout
from linkctl.trust import session
from linkctl.trust.secret import PairSecret


class _Handler(socketserver.StreamRequestHandler):
    server: _Server
    # Until the peer proves the secret; then IDLE_TIMEOUT_S (set in handle).
    timeout = AUTH_TIMEOUT_S

    def setup(self) -> None:
        super().setup()
        self.ch: session.Channel | None = None

    def handle(self) -> None:
        peer = ipaddress.IPv4Address(self.client_address[0])
        if peer not in self.server.allowed:
            self.server.log(f"refused {peer}: not on the link subnet {self.server.allowed}")
            return
        with self.server.admitted(str(peer)) as why:
            if why:
                self.server.log(f"refused {peer}: {why}")
                return
            try:
                self.ch = session.accept(
                    self.connection, self.rfile, self.server.key, SERVICE, f"peer {peer}"
                )
            except (session.AuthError, OSError) as e:
                self.server.log(f"refused {peer}: {getattr(e, 'message', e)}")
                return
        self.connection.settimeout(IDLE_TIMEOUT_S)
        try:
            self._serve(self.ch.recv())
        except (InputError, KeyError, ValueError, OSError) as e:
            msg = e.message if isinstance(e, InputError) else f"{type(e).__name__}: {e}"
            self.server.log(f"{peer}: {msg}")
            with contextlib.suppress(OSError):
                self.ch.send({"ok": False, "error": msg})

    def _serve(self, req: dict[str, Any]) -> None:
        assert self.ch is not None
        op = req.get("op")
        if op == "model":
            fp = fingerprint(self.server.model or "", self.server.kv)
            self.ch.send({"ok": True, **fp.as_wire()})
            return
        if op == "server":
            check = self.server.server_check
            why = check() if check else "this kv-agent started no llama-server"
            self.ch.send({"ok": True, "ours": why is None, "why": why or ""})
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
            self.ch.send(
                {
                    "ok": True,
                    "size": path.stat().st_size if path.exists() else None,
                    "partial": psize,
                    "partial_sha256": sha_of(part).hexdigest() if psize else None,
                }
            )
        else:
            raise InputError(f"unknown op {op!r}")

    def _get(self, path: Path, delete: bool) -> None:
        assert self.ch is not None
        try:
            f = open(path, "rb")  # noqa: SIM115 (closed below)
        except FileNotFoundError:
            raise InputError(f"no file {path.name} in {path.parent}") from None
        with f:
            before = os.fstat(f.fileno())
            size = before.st_size
            self.ch.send({"ok": True, "size": size})
            with ReadAhead(f, size, str(path)) as chunks:
                for chunk in chunks:
                    self.ch.send_bytes(chunk)
            after = os.fstat(f.fileno())
        if (after.st_size, after.st_mtime_ns) != (size, before.st_mtime_ns):
            # Rewritten while it was read: the bytes sent are neither version, and the
            # closing line says so, so the receiver keeps nothing.
            raise InputError(f"{path.name} changed while it was sent; run the copy again")
        self.ch.send({"ok": True})
        if delete:
            path.unlink(missing_ok=True)
        self.server.log(f"sent {path.name}: {size} bytes")

    def _put(self, path: Path, size: int, offset: int) -> None:
        with self.server.writing(path):
            self._put_one(path, size, offset)

    def _put_one(self, path: Path, size: int, offset: int) -> None:
        assert self.ch is not None
        part = path.with_name(path.name + ".part")
        have = part.stat().st_size if part.exists() else 0
        if size < 0 or offset not in (0, have) or offset > size:
            raise InputError(f"offset {offset} does not match the partial file ({have} bytes)")
        free = shutil.disk_usage(path.parent).free
        if size - offset > free:
            raise InputError(
                f"no space left on {socket.gethostname()} for {path.name}: "
                f"need {size - offset} bytes, have {free}",
                f"free space in {path.parent}, then run the copy again",
            )
        h = sha_of(part, offset) if offset else hashlib.sha256()
        self.ch.send({"ok": True})
        with private_file(part, append=bool(offset)) as f:
            f.seek(offset)
            f.truncate()
            sk = Sink(f, h)
            try:
                with sk:
                    sk.receive(self.ch, size - offset)
                    sk.finish()
                got = h.hexdigest()
                f.flush()
                os.fsync(f.fileno())
            except OSError as e:
                if e.errno != errno.ENOSPC:
                    raise
                part.unlink(missing_ok=True)  # its space back; a resume could not finish
                raise InputError(
                    f"no space left on {socket.gethostname()} for {path.name}: "
                    f"need {size - offset} bytes, ran out at {offset + sk.received}",
                    f"free space in {path.parent}, then run the copy again",
                ) from None
        want = self.ch.recv().get("sha256")
        # The checksum of the bytes on disk, read back: what the stream carried is not
        # proof of what was stored.
        stored = sha_of(part).hexdigest()
        if not want == got == stored:
            part.unlink(missing_ok=True)
            raise InputError(
                f"checksum mismatch for {path.name}: sent {want}, received {got}, stored {stored}"
            )
        part.replace(path)
        self.ch.send({"ok": True, "sha256": got})
        self.server.log(f"received {path.name}: {size} bytes (from offset {offset})")


class _Server(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True
    # The listen backlog: a burst of connections waits here instead of in SYN retries.
    request_queue_size = 64

    def __init__(
        self,
        addr: tuple[str, int],
        areas: dict[str, Path],
        allowed: ipaddress.IPv4Network,
        log: Callable[[str], None],
        key: bytes,
        model: str | None,
        kv: KvLayout | None,
        server_check: ServerCheck | None,
    ):
        self.areas, self.allowed, self.log, self.model = areas, allowed, log, model
        self.key, self.kv, self.server_check = key, kv, server_check
        self._writing: set[Path] = set()
        self._writing_lock = threading.Lock()
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        self._unproven: dict[str, int] = {}
        super().__init__(addr, _Handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        # At most MAX_CONNECTIONS handler threads: one more is closed at once, not queued.
        if not self._slots.acquire(blocking=False):
            self.log(f"refused {client_address[0]}: {MAX_CONNECTIONS} connections already")
            self.shutdown_request(request)
            return
        super().process_request(request, client_address)

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()

    def get_request(self) -> tuple[socket.socket, Any]:
        try:
            return super().get_request()
        except OSError as e:
            # Out of descriptors: the listening socket stays readable, so without a
            # pause serve_forever would spin a core retrying accept().
            if e.errno in (errno.EMFILE, errno.ENFILE):
                time.sleep(0.1)
            raise

    @contextlib.contextmanager
    def admitted(self, peer: str) -> Iterator[str | None]:
        """Whether ``peer`` may start one more handshake (None) or why not: a host
        that cannot prove the secret cannot hold every slot."""
        with self._writing_lock:
            n = self._unproven.get(peer, 0)
            if n >= MAX_UNPROVEN:
                yield f"{n} connections from it have not proved the pair secret yet"
                return
            self._unproven[peer] = n + 1
        try:
            yield None
        finally:
            with self._writing_lock:
                self._unproven[peer] -= 1
                if not self._unproven[peer]:
                    del self._unproven[peer]

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
        secret: PairSecret,
        log: Callable[[str], None] | None = None,
        model: str | None = None,
        kv: KvLayout | None = None,
        server_check: ServerCheck | None = None,
    ):
        check_bind(bind, subnet)
        for name, d in areas.items():
            if not Path(d).is_dir():
                raise InputError(f"kv-agent area {name}: {d} is not a directory", "create it")
        dirs = {k: Path(v) for k, v in areas.items()}
        try:
            self.server = _Server(
                (bind, port),
                dirs,
                subnet,
                log or (lambda _m: None),
                secret.key,
                model,
                kv,
                server_check,
            )
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
