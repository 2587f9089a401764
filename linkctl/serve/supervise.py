"""A small process supervisor for the long-running llama.cpp servers.

One child per supervisor: start it (through the runner's ``spawn``), wait
until a readiness callback says it serves, watch it with a health callback,
restart it with exponential backoff whenever it exits (exit 0 too: a server
that returns has stopped serving) or turns unhealthy, give up after too many
starts in a window, and forward SIGTERM/SIGINT to it. Every line, its own and
the child's output, goes out with a UTC timestamp. A small JSON status file
(pid, child pid, starts, last ready time) lets other processes and tests see
what it is doing.
"""

from __future__ import annotations

import collections
import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from linkctl.core.log import speaker, stamp, write_line
from linkctl.core.paths import write_atomic
from linkctl.core.records import ServeStatus, WatchRecord, dump
from linkctl.core.runner import Runner, default_runner, stop_process
from linkctl.core.stopflag import StopFlag


@dataclass
class ChildSpec:
    name: str
    argv: list[str]
    env: dict[str, str] | None = None
    # True once the child serves. Polled every ``poll_s`` until ``ready_timeout``.
    ready: Callable[[], bool] | None = None
    ready_timeout: float = 120.0
    # After ready: None while healthy, else the reason to restart it.
    healthy: Callable[[int], str | None] | None = None
    health_interval: float = 1.0
    # Before every start: block until the child can start (e.g. its rpc
    # endpoints answer). Returns None when ready, else a reason to wait/retry.
    before_start: Callable[[], str | None] | None = None
    # Once it is ready (its pid): the watch's canary runs on every start.
    on_ready: Callable[[int], None] | None = None
    # When it stopped serving by itself or turned unhealthy (the reason), not by a
    # Switch: serve.on_fail may take another mode for the next start.
    on_exit: Callable[[str], None] | None = None


class Switch(str):
    """A reason ``healthy`` gives to restart the child now, as whatever ``choose`` picks
    next (the split, or the head alone): a decision, not a failure, so no backoff.
    ``stop_s``: how long the child gets to stop (a broken split is not waited for: its
    requests cannot finish, and its clients should hear so at once)."""

    stop_s: float | None

    def __new__(cls, reason: str, stop_s: float | None = None) -> Switch:
        out = super().__new__(cls, reason)
        out.stop_s = stop_s
        return out


@dataclass
class Policy:
    backoff_initial: float = 1.0
    backoff_max: float = 30.0
    # A child that stayed ready this long resets the backoff.
    reset_after: float = 60.0
    # Give up after this many starts within ``window`` seconds.
    max_starts: int = 10
    window: float = 600.0
    stop_timeout: float = 10.0
    poll_s: float = 0.2


class Supervisor:
    def __init__(
        self,
        spec: ChildSpec,
        *,
        policy: Policy | None = None,
        runner: Runner | None = None,
        log: IO[str] | None = None,
        status_path: Path | None = None,
        choose: Callable[[], ChildSpec] | None = None,
    ):
        self.spec = spec
        self.choose = choose  # before every start: the spec to start (serve.on_fail)
        self._write_lock = threading.Lock()  # the watch's thread writes the status too
        self.policy = policy or Policy()
        self.runner = runner or default_runner()
        self.out = log or sys.stderr
        self.status_path = status_path
        self.status = ServeStatus(name=spec.name, pid=os.getpid(), argv=list(spec.argv))
        self.proc: subprocess.Popen | None = None
        self._stop = StopFlag()  # set by a signal handler: no lock (linkctl/core/stopflag.py)
        self._stop_signal: int | None = None
        self.log = speaker(spec.name, self.out)
        self.tail: collections.deque[str] = collections.deque(maxlen=50)

    # ---- logging and status ------------------------------------------------

    def event(self, kind: str, **detail: Any) -> None:
        self.status.events.append({"time": stamp(), "event": kind, **detail})
        self.status.events = self.status.events[-50:]
        self._write_status()

    def _write_status(self) -> None:
        if not self.status_path:
            return
        with self._write_lock:
            write_atomic(self.status_path, dump(self.status, exclude_unset=False))

    def set_watch(self, record: WatchRecord) -> None:
        self.status.watch = record
        self._write_status()

    def set_rpc_ends(self, ends: dict[str, list[str]]) -> None:
        self.status.rpc_ends = ends
        self._write_status()

    def _pump(self, stream: IO[bytes]) -> None:
        for raw in iter(stream.readline, b""):
            line = raw.decode(errors="replace").rstrip()
            self.tail.append(line)
            write_line(f"{stamp()} {self.spec.name}| {line}", self.out)
        stream.close()

    # ---- signals -------------------------------------------------------------

    def _on_signal(self, signum: int, _frame: Any) -> None:
        self._stop_signal = signum
        self._stop.set()
        proc = self.proc
        if proc is not None and proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signum)

    def request_stop(self) -> None:
        self._on_signal(signal.SIGTERM, None)

    # ---- the loop ------------------------------------------------------------

    def _start(self) -> subprocess.Popen:
        proc = self.runner.spawn(
            self.spec.argv,
            env=self.spec.env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            new_session=True,  # a terminal's ^C reaches the supervisor, which forwards it
            # What a server writes (llama-server's slot files: users' prompts, the RPC
            # tensor cache) is its own: 0600, read back only by this same unit.
            umask=0o077,
            die_with_parent=True,  # a SIGKILLed supervisor leaves no orphan on the port
        )
        assert proc.stdout is not None
        threading.Thread(target=self._pump, args=(proc.stdout,), daemon=True).start()
        return proc

    def _terminate(self, proc: subprocess.Popen, within: float | None = None) -> int | None:
        return stop_process(proc, within or self.policy.stop_timeout, say=self.log)

    def _sleep(self, seconds: float) -> bool:
        """Sleep unless asked to stop; True if a stop was requested."""
        return self._stop.wait(seconds)

    def _wait_prerequisites(self) -> bool:
        """Block until before_start() is happy. False if asked to stop meanwhile."""
        if not self.spec.before_start:
            return True
        delay = 0.5
        last = None
        while not self._stop.is_set():
            reason = self.spec.before_start()
            if reason is None:
                return True
            if reason != last:
                self.log(f"waiting before start: {reason}")
                last = reason
            self.status.state = "waiting"
            self.status.last_reason = reason
            self._write_status()
            if self._sleep(delay):
                return False
            delay = min(delay * 2, 2.0)
        return False

    def _wait_ready(self, proc: subprocess.Popen, t0: float) -> str | None:
        """None once ready; else why not (exited, timed out, stop requested)."""
        deadline = t0 + self.spec.ready_timeout
        while True:
            if self._stop.is_set():
                return "stop requested"
            rc = proc.poll()
            if rc is not None:
                return f"exited {rc} before it was ready"
            if self.spec.ready is None or self.spec.ready():
                return None
            if time.monotonic() > deadline:
                return f"not ready within {self.spec.ready_timeout:g} s"
            self._sleep(self.policy.poll_s)

    def run(self, install_signals: bool = True) -> int:
        """Supervise until a stop signal (returns 0) or the start limit (returns 1)."""
        if install_signals:
            for sig in (signal.SIGTERM, signal.SIGINT):
                signal.signal(sig, self._on_signal)
        pol = self.policy
        starts: collections.deque[float] = collections.deque()
        failures = 0
        switched = False  # this start follows a Switch: a decision, not counted below
        self.log(f"supervising: {' '.join(self.spec.argv)}")
        try:
            while not self._stop.is_set():
                if self.choose is not None:
                    self.spec = self.choose()
                    self.status.argv = list(self.spec.argv)
                if not self._wait_prerequisites():
                    break
                now = time.monotonic()
                while starts and now - starts[0] > pol.window:
                    starts.popleft()
                if len(starts) >= pol.max_starts:
                    self.status.state = "gave-up"
                    self.log(
                        f"gave up: {len(starts)} starts within {pol.window:g} s; "
                        f"last: {self.status.last_reason}"
                    )
                    self.event("gave-up", reason=self.status.last_reason)
                    return 1
                if not switched:  # the start limit counts failures, not decisions
                    starts.append(now)
                switched = False
                t0 = time.monotonic()
                self.proc = proc = self._start()
                self.status.starts += 1
                self.status.child_pid = proc.pid
                self.status.state = "starting"
                self.status.started_at = stamp()
                self.log(f"started pid {proc.pid} (start #{self.status.starts})")
                self.event("start", pid=proc.pid)
                why = self._wait_ready(proc, t0)
                ready_for = 0.0
                if why is None:
                    took = time.monotonic() - t0
                    self.status.state = "ready"
                    self.status.ready_at = stamp()
                    self.status.ready_after_s = round(took, 3)
                    self.log(f"ready after {took:.2f} s")
                    self.event("ready", pid=proc.pid, after_s=round(took, 3))
                    if self.spec.on_ready is not None:
                        self.spec.on_ready(proc.pid)
                    t_ready = time.monotonic()
                    why = self._watch(proc)
                    ready_for = time.monotonic() - t_ready
                if self._stop.is_set():
                    break
                rc = self._terminate(proc, why.stop_s if isinstance(why, Switch) else None)
                self.status.last_exit = rc
                self.status.last_reason = why
                tail = next((t for t in reversed(self.tail) if t.strip()), "")
                self.log(
                    f"pid {proc.pid} {why} (exit {rc}){'; last output: ' + tail if tail else ''}"
                )
                self.event("exit", pid=proc.pid, code=rc, reason=why)
                if isinstance(why, Switch):
                    switched = True
                    continue
                if self.spec.on_exit is not None:
                    self.spec.on_exit(why)
                failures = 0 if ready_for >= pol.reset_after else failures + 1
                delay = min(pol.backoff_max, pol.backoff_initial * 2 ** max(0, failures - 1))
                self.status.state = "backoff"
                self.log(f"restarting in {delay:.1f} s")
                self._write_status()
                if self._sleep(delay):
                    break
            return 0
        finally:
            if self.proc is not None:
                rc = self._terminate(self.proc)
                self.status.last_exit = rc
            self.status.state = "stopped"
            how = signal.Signals(self._stop_signal).name if self._stop_signal else "end"
            self.log(f"stopped ({how})")
            self.event("stopped", by=how)

    def _watch(self, proc: subprocess.Popen) -> str:
        """Wait while the child is ready; return why it stopped being so."""
        next_check = time.monotonic() + self.spec.health_interval
        while True:
            if self._stop.is_set():
                return "stop requested"
            rc = proc.poll()
            if rc is not None:
                return f"exited {rc}"
            if self.spec.healthy and time.monotonic() >= next_check:
                reason = self.spec.healthy(proc.pid)
                if isinstance(reason, Switch):
                    return reason
                if reason:
                    return f"unhealthy: {reason}"
                next_check = time.monotonic() + self.spec.health_interval
            self._sleep(self.policy.poll_s)
