"""`linkctl responder`: the peer side of the probe.

A TCP echo server for round-trip latency plus a supervised ``iperf3 -s`` for
throughput, both bound only to this host's link address (a wildcard is
refused: the responder answers anyone who can reach it). Threads, not
asyncio: a blocking recv/send loop per connection is the lowest-latency echo
Python can do. SIGTERM (or SIGINT) stops both cleanly.

Protocol: on connect the two ends prove the pair secret to each other
(linkctl.trust.session; a peer that does not within AUTH_TIMEOUT_S is dropped and
learns nothing), then the server sends one authenticated JSON line (the banner, so
the probe knows which iperf3 port runs, and this host's calibration terms when it
has some: how they reach the other host, unforged), then echoes every byte it
receives until the client closes. iperf3 itself is not authenticated: it measures,
and hands nothing on.
"""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import socket
import subprocess
import threading
from collections.abc import Callable
from typing import Any

from linkctl.core.errors import InputError
from linkctl.core.records import CalibrationRecord
from linkctl.core.runner import Runner, default_runner, stop_process
from linkctl.core.stopflag import stop_on_signals
from linkctl.trust import session
from linkctl.trust.secret import PairSecret

log = logging.getLogger(__name__)

SERVICE = "linkctl-responder"
PROTOCOL = 1
BUF = 256 * 1024
MAX_CLIENTS = 16
AUTH_TIMEOUT_S = 5.0
IPERF_HINT = "Debian/Ubuntu: sudo apt install iperf3; macOS: brew install iperf3"


def iperf3_path(runner: Runner) -> str:
    path = runner.which("iperf3")
    if not path:
        raise InputError("iperf3 is not installed", IPERF_HINT)
    return path


class Responder:
    def __init__(
        self,
        address: str,
        port: int,
        iperf_port: int,
        *,
        runner: Runner | None = None,
        iperf: bool = True,
        host: str | None = None,
        calibration: Callable[[], CalibrationRecord | None] | None = None,
        secret: PairSecret | None = None,
    ):
        try:
            ip = ipaddress.IPv4Address(address)
        except ValueError:
            raise InputError(
                f"responder address {address!r} is not an IPv4 address",
                "give the host's link address",
            ) from None
        if ip.is_unspecified:
            raise InputError(
                f"responder address {address} is a wildcard",
                "the responder binds only to this host's link address; fix hosts.address",
            )
        self.address, self.port, self.iperf_port = address, port, iperf_port
        self.runner = runner or default_runner()
        self.iperf = iperf
        self.host = host
        # Read at every connect, so a calibration made after the responder started is
        # what the peer gets.
        self.calibration = calibration
        self.secret = secret  # None: plan() and banner() only; start() refuses
        self._sock: socket.socket | None = None
        self._stop = threading.Event()
        self._iperf_proc: subprocess.Popen | None = None
        self._iperf_lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._clients: set[socket.socket] = set()
        self.iperf_restarts = 0

    # ---- lifecycle -----------------------------------------------------------------

    def start(self) -> None:
        if self.secret is None:
            raise InputError("the responder answers only peers holding the pair secret; none given")
        iperf_bin = iperf3_path(self.runner) if self.iperf else None
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((self.address, self.port))
        except OSError as e:
            s.close()
            if e.errno == 99:  # EADDRNOTAVAIL
                raise InputError(
                    f"{self.address} is not an address of this host",
                    "run `linkctl setup` first so the link address exists",
                ) from None
            raise InputError(
                f"cannot listen on {self.address}:{self.port}: {e.strerror}",
                "another responder running? change probe.responder_port",
            ) from None
        s.listen(8)
        s.settimeout(0.5)
        self._sock = s
        if iperf_bin:
            self._spawn_iperf(iperf_bin)
            t = threading.Thread(
                target=self._supervise, args=(iperf_bin,), daemon=True, name="iperf3-supervisor"
            )
            t.start()
            self._threads.append(t)
        t = threading.Thread(target=self._accept_loop, daemon=True, name="echo-accept")
        t.start()
        self._threads.append(t)

    def stop(self) -> None:
        self._stop.set()
        if self._sock:
            with contextlib.suppress(OSError):
                self._sock.close()
        for c in list(self._clients):
            with contextlib.suppress(OSError):
                c.shutdown(socket.SHUT_RDWR)
        with self._iperf_lock:
            p = self._iperf_proc
            if p:
                stop_process(p, 3, kill_wait=3)
        for t in self._threads:
            t.join(2)

    def serve_forever(self, ready: Any = None) -> None:
        """start(), then block until SIGTERM/SIGINT; always stop() the children."""
        with stop_on_signals() as done:
            try:
                self.start()
                if ready:
                    ready(self.info())
                done.wait()
            finally:
                self.stop()

    def plan(self) -> dict[str, Any]:
        """What start() would listen on and run (`responder --dry-run`): starts nothing,
        but refuses as start() does when iperf3 is missing."""
        iperf_bin = iperf3_path(self.runner) if self.iperf else None
        return {
            "service": SERVICE,
            "address": self.address,
            "port": self.port,
            "iperf_port": self.iperf_port if self.iperf else None,
            "iperf_argv": self._iperf_argv(iperf_bin) if iperf_bin else None,
            "dry_run": True,
        }

    def info(self) -> dict[str, Any]:
        p = self._iperf_proc
        return {
            "service": SERVICE,
            "protocol": PROTOCOL,
            "address": self.address,
            "port": self.port,
            "iperf_port": self.iperf_port if self.iperf else None,
            "iperf_running": bool(p and p.poll() is None),
            "iperf_pid": p.pid if p else None,
            "iperf_restarts": self.iperf_restarts,
        }

    # ---- iperf3 -----------------------------------------------------------------------

    def _spawn_iperf(self, iperf_bin: str) -> None:
        with self._iperf_lock:
            if self._stop.is_set():
                return
            self._iperf_proc = self.runner.spawn(self._iperf_argv(iperf_bin))

    def _iperf_argv(self, iperf_bin: str) -> list[str]:
        return [iperf_bin, "-s", "-B", self.address, "-p", str(self.iperf_port)]

    def _supervise(self, iperf_bin: str) -> None:
        backoff = 0.2
        while not self._stop.is_set():
            p = self._iperf_proc
            if p is None:
                return
            try:
                rc = p.wait(0.5)
            except subprocess.TimeoutExpired:
                backoff = 0.2
                continue
            if self._stop.is_set():
                return
            log.warning("iperf3 server exited %s; restarting in %.1f s", rc, backoff)
            if self._stop.wait(backoff):
                return
            backoff = min(backoff * 2, 5.0)
            self.iperf_restarts += 1
            self._spawn_iperf(iperf_bin)

    # ---- echo --------------------------------------------------------------------

    def _accept_loop(self) -> None:
        assert self._sock is not None
        while not self._stop.is_set():
            try:
                conn, _addr = self._sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            if len(self._clients) >= MAX_CLIENTS:
                conn.close()
                continue
            t = threading.Thread(target=self._echo, args=(conn,), daemon=True)
            t.start()

    def banner(self) -> dict[str, Any]:
        """info() plus who this is and its calibration terms (a record that cannot be
        read is left out: the echo must answer whatever the calibration file holds)."""
        out = {**self.info(), "host": self.host}
        if self.calibration is not None:
            try:
                rec = self.calibration()
            except InputError as e:
                log.warning("calibration not offered: %s", e.message)
                rec = None
            if rec is not None:
                out["calibration"] = rec.terms().model_dump(mode="json", exclude_none=True)
        return out

    def _echo(self, conn: socket.socket) -> None:
        self._clients.add(conn)
        assert self.secret is not None
        try:
            conn.settimeout(AUTH_TIMEOUT_S)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            peer = f"peer {conn.getpeername()[0]}"
            with conn.makefile("rb", buffering=0) as rfile:
                try:
                    ch = session.accept(conn, rfile, self.secret.key, SERVICE, peer)
                except session.AuthError as e:
                    log.warning("refused %s", e.message)
                    return
                conn.settimeout(None)
                ch.send(self.banner())
            buf = bytearray(BUF)
            view = memoryview(buf)
            recv_into, sendall = conn.recv_into, conn.sendall
            while True:
                n = recv_into(buf)
                if not n:
                    return
                sendall(view[:n])
        except OSError:
            return
        finally:
            self._clients.discard(conn)
            conn.close()
