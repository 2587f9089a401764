"""A userspace TCP delay proxy: this kernel has no netem, so lab delay is injected here.

Listens on ADDR:PORT and forwards every connection to TARGET:PORT, holding each
chunk it reads for a fixed one-way delay in each direction before writing it
on. Each direction has its own FIFO queue of (release time, bytes): order is
kept, every chunk keeps its own timestamp (chunks are never merged into one
late write), and a writer thread sleeps until each release time
(time.sleep, sub-millisecond on Linux; asyncio's epoll timeouts round to whole
milliseconds, too coarse for a 0.25 ms delay).

It also counts, per direction, chunks and bytes, and the client->server
request/response turns: a server->client burst that follows client->server
data is one synchronous round trip as the client sees it. When the stream
is llama.cpp RPC (| cmd u8 | size u64 | payload |), client->server commands
are parsed and counted by name.

    python -m linkctl.delayproxy --listen 198.18.100.2:50053 \\
        --target 198.18.100.2:50052 --delay-ms 1 [--stats-file stats.json]

or, in Python, ``DelayProxy(listen, target, delay_ms).start()`` / ``.stop()``.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import signal
import socket
import struct
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

RPC_COMMANDS = (
    "ALLOC_BUFFER",
    "GET_ALIGNMENT",
    "GET_MAX_SIZE",
    "BUFFER_GET_BASE",
    "FREE_BUFFER",
    "BUFFER_CLEAR",
    "SET_TENSOR",
    "SET_TENSOR_HASH",
    "GET_TENSOR",
    "COPY_TENSOR",
    "GRAPH_COMPUTE",
    "GET_DEVICE_MEMORY",
    "INIT_TENSOR",
    "GET_ALLOC_SIZE",
    "HELLO",
    "DEVICE_COUNT",
    "GRAPH_RECOMPUTE",
    "MEMSET_TENSOR",
)
_CHUNK = 256 * 1024


def parse_addr(text: str, what: str) -> tuple[str, int]:
    from linkctl.errors import InputError

    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise InputError(f"{what} {text!r}: not ADDR:PORT", f"write e.g. {what} 198.18.100.2:50053")
    return host, int(port)


class _RpcParser:
    """Splits the client->server byte stream into llama.cpp RPC commands."""

    def __init__(self) -> None:
        self.buf = bytearray()
        self.need: int | None = None  # payload bytes still to skip for the current command
        self.ok = True

    def feed(self, data: bytes, counts: collections.Counter) -> None:
        if not self.ok:
            return
        self.buf += data
        while True:
            if self.need is not None:
                take = min(self.need, len(self.buf))
                del self.buf[:take]
                self.need -= take
                if self.need:
                    return
                self.need = None
            if len(self.buf) < 9:
                return
            cmd = self.buf[0]
            size = struct.unpack_from("<Q", self.buf, 1)[0]
            if cmd >= len(RPC_COMMANDS) or size > 1 << 40:
                self.ok = False  # not RPC: stop parsing, keep forwarding
                return
            counts[RPC_COMMANDS[cmd]] += 1
            del self.buf[:9]
            self.need = size


@dataclass
class Stats:
    connections: int = 0
    c2s_chunks: int = 0
    c2s_bytes: int = 0
    s2c_chunks: int = 0
    s2c_bytes: int = 0
    turns: int = 0  # server replies that followed client data (synchronous round trips)
    rpc_commands: collections.Counter = field(default_factory=collections.Counter)
    # How late chunks left the proxy after their release time (sleep overshoot and
    # waiting for a CPU): the proxy's own share of the lab link's latency.
    late_chunks: int = 0
    late_us_sum: float = 0.0
    late_us_max: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return {
            "connections": self.connections,
            "c2s_chunks": self.c2s_chunks,
            "c2s_bytes": self.c2s_bytes,
            "s2c_chunks": self.s2c_chunks,
            "s2c_bytes": self.s2c_bytes,
            "turns": self.turns,
            "rpc_commands": dict(self.rpc_commands),
            "late_chunks": self.late_chunks,
            "late_us_sum": self.late_us_sum,
            "late_us_max": self.late_us_max,
        }


class _Pipe:
    """One direction of one connection: reader thread -> FIFO -> delayed writer thread."""

    def __init__(
        self,
        proxy: DelayProxy,
        src: socket.socket,
        dst: socket.socket,
        c2s: bool,
        conn_state: dict[str, Any],
    ):
        self.proxy, self.src, self.dst, self.c2s = proxy, src, dst, c2s
        self.state = conn_state
        self.q: collections.deque[tuple[float, bytes]] = collections.deque()
        self.cv = threading.Condition()
        self.closed = False
        self.parser = _RpcParser() if c2s else None

    def start(self) -> None:
        threading.Thread(target=self._read, daemon=True).start()
        threading.Thread(target=self._write, daemon=True).start()

    def _read(self) -> None:
        delay = self.proxy.delay_s
        st, lock = self.proxy.stats, self.proxy.lock
        try:
            while True:
                data = self.src.recv(_CHUNK)
                if not data:
                    break
                now = time.monotonic()
                with lock:
                    if self.c2s:
                        st.c2s_chunks += 1
                        st.c2s_bytes += len(data)
                        self.state["last"] = "c"
                        self.parser.feed(data, st.rpc_commands)  # type: ignore[union-attr]
                    else:
                        st.s2c_chunks += 1
                        st.s2c_bytes += len(data)
                        if self.state.get("last") == "c":
                            st.turns += 1
                        self.state["last"] = "s"
                with self.cv:
                    self.q.append((now + delay, data))
                    self.cv.notify()
        except OSError:
            pass
        with self.cv:
            self.closed = True
            self.cv.notify()

    def _write(self) -> None:
        try:
            while True:
                with self.cv:
                    while not self.q and not self.closed:
                        self.cv.wait()
                    if not self.q:
                        break
                    release, data = self.q.popleft()
                left = release - time.monotonic()
                if left > 0:
                    time.sleep(left)
                late = (time.monotonic() - release) * 1e6
                st = self.proxy.stats
                with self.proxy.lock:
                    st.late_chunks += 1
                    st.late_us_sum += late
                    st.late_us_max = max(st.late_us_max, late)
                self.dst.sendall(data)
        except OSError:
            pass
        with contextlib.suppress(OSError):
            self.dst.shutdown(socket.SHUT_WR)


class DelayProxy:
    def __init__(self, listen: tuple[str, int], target: tuple[str, int], delay_ms: float):
        if delay_ms < 0:
            from linkctl.errors import InputError

            raise InputError(f"--delay-ms {delay_ms:g}: must be >= 0", "give a one-way delay")
        self.listen, self.target = listen, target
        self.delay_s = delay_ms / 1000.0
        self.stats = Stats()
        self.lock = threading.Lock()
        self._sock: socket.socket | None = None
        self._port = listen[1]
        self._stop = threading.Event()

    @property
    def port(self) -> int:
        """The bound port (the real one when listen asked for port 0)."""
        return self._port

    def snapshot(self) -> dict[str, Any]:
        with self.lock:
            d = self.stats.as_dict()
        d["delay_ms"] = self.delay_s * 1000
        d["listen"] = f"{self.listen[0]}:{self._port}"
        d["target"] = f"{self.target[0]}:{self.target[1]}"
        return d

    def start(self) -> DelayProxy:
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(self.listen)
        s.listen(16)
        self._sock = s
        self._port = s.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()
        return self

    def _accept(self) -> None:
        assert self._sock is not None
        while not self._stop.is_set():
            try:
                client, _ = self._sock.accept()
            except OSError:
                break
            try:
                upstream = socket.create_connection(self.target, timeout=5)
                upstream.settimeout(None)
            except OSError:
                client.close()
                continue
            for sk in (client, upstream):
                sk.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self.lock:
                self.stats.connections += 1
            state: dict[str, Any] = {}
            _Pipe(self, client, upstream, True, state).start()
            _Pipe(self, upstream, client, False, state).start()

    def stop(self) -> None:
        self._stop.set()
        if self._sock is not None:
            with contextlib.suppress(OSError):
                self._sock.close()


def main(argv: list[str] | None = None) -> int:
    from linkctl.errors import LinkctlError

    ap = argparse.ArgumentParser(
        prog="python -m linkctl.delayproxy",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--listen", required=True, help="ADDR:PORT to listen on")
    ap.add_argument("--target", required=True, help="ADDR:PORT to forward to")
    ap.add_argument("--delay-ms", type=float, default=0.0, help="one-way delay per direction")
    ap.add_argument("--stats-file", help="write the counters here as JSON every 0.2 s")
    a = ap.parse_args(argv)
    try:
        proxy = DelayProxy(
            parse_addr(a.listen, "--listen"), parse_addr(a.target, "--target"), a.delay_ms
        ).start()
    except LinkctlError as e:
        print(f"delayproxy: error: {e.line()}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"delayproxy: error: cannot listen on {a.listen}: {e.strerror}", file=sys.stderr)
        return 2
    done = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: done.set())
    print(
        f"delayproxy: {a.listen} -> {a.target}, {a.delay_ms:g} ms each way",
        file=sys.stderr,
        flush=True,
    )
    path = Path(a.stats_file) if a.stats_file else None
    last = None
    while not done.wait(0.2):
        if path:
            snap = json.dumps(proxy.snapshot())
            if snap != last:
                tmp = path.with_suffix(".tmp")
                tmp.write_text(snap)
                os.replace(tmp, path)
                last = snap
    proxy.stop()
    snap = proxy.snapshot()
    if path:
        path.write_text(json.dumps(snap))
    print(json.dumps(snap), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
