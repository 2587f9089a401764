"""serve.on_fail on a serving host: the watch and the canary decide, the supervisor acts.

Head: llama-server runs in one of three modes. ``split`` (the pair); on a FAIL the
policy takes it to ``alone`` (serve.on_fail = "fallback": llama-server on the head only,
the same model when it fits the head or serve.fallback_model) or ``stopped`` ("stop":
nothing serves, fail closed), or leaves it (``keep``: said in status, nothing changed).
Back to the split only when the mode has lasted serve.fallback_hold_s, the link has
passed for as long, and every rpc endpoint answers: a link that flaps does not make the
head flap with it. Every start of the split runs the canary; until it has passed, the
watch says WARN (and a FAIL takes the split out again).

rpc host: a stopped rpc-server (SIGSTOP, a debugger) answers nothing and never exits,
so the supervisor would wait forever: the watch's FAIL restarts it.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

from linkctl.core.checks import Verdict
from linkctl.core.errors import InputError
from linkctl.core.log import Say
from linkctl.core.records import (
    CanaryRecord,
    WatchFinding,
    WatchRecord,
    canary_path,
    load_canary,
    save_record,
)
from linkctl.serve.supervise import Switch
from linkctl.serve.watch import Watch, WatchConfig

if TYPE_CHECKING:
    from collections.abc import Callable

    from linkctl.core.profile import HostSpec, Profile
    from linkctl.core.records import Fingerprint
    from linkctl.llama.client import LlamaServer
    from linkctl.llama.invocation import ServerInvocation
    from linkctl.net.backend import Backend
    from linkctl.serve.sampling import Sampler

# llama-server stopped for a switch gets this long, then SIGKILL. Waiting longer helps no
# client: once SIGTERM has terminated its task queue (tools/server/server.cpp, the
# shutdown handler), a request in flight waits on a queue that is gone, and under load
# the lab's llama-server outlived SIGTERM by 10 s with its clients still waiting. A
# broken split may also be in ggml's abort, running gdb for a backtrace
# (ggml/src/ggml.c ggml_print_backtrace).
SWITCH_STOP_S = 2.0


def probe_rtt_ms(profile: Profile) -> float | None:
    """The smallest-payload RTT the latest probe measured to any rpc host, in ms."""
    from linkctl.core.records import latest_probe

    best = None
    for peer in profile.rpc_hosts:
        found = latest_probe(profile.name, peer.name, peer.ip)
        small = found[2].latency.smallest() if found and found[2].latency else None
        if small is not None:
            best = min(best or small[0], small[0])
    return round(best / 1000, 4) if best is not None else None


def watch_config(profile: Profile, host: HostSpec, backend: Backend) -> WatchConfig:
    s = profile.serve
    try:
        speed = backend.link_facts(host.interface).speed_mbps
    except InputError:
        speed = None
    return WatchConfig(
        role=host.role,
        interface=host.interface,
        interval_s=s.watch_interval_s,
        stall_s=s.watch_stall_s,
        on_fail=s.on_fail,
        probe_rtt_ms=probe_rtt_ms(profile) if host.role == "head" else None,
        speed_mbps=speed,
    )


def fallback_invocation(
    profile: Profile, split: ServerInvocation
) -> tuple[ServerInvocation | None, str]:
    """llama-server on the head alone for serve.on_fail = "fallback", or None and why
    it cannot be (the model does not fit the head, and no serve.fallback_model)."""
    from linkctl.serve.placement import head_fits

    alone = split.changed(rpc=(), tensor_split=None)
    if profile.serve.fallback_model:
        return alone.changed(model=profile.serve.fallback_model), "serve.fallback_model"
    try:
        fits, why = head_fits(profile, split.model)
    except InputError as e:
        return None, f"cannot tell whether {split.model} fits the head alone: {e.message}"
    if not fits:
        return None, f"{split.model} does not fit the head alone ({why}); set serve.fallback_model"
    return alone, f"the served model fits the head alone ({why})"


class CanaryClock:
    """When the canary runs: after every start of the split, every interval, and when
    `linkctl verify --canary` has written a result this process has not seen."""

    def __init__(
        self,
        fp: Fingerprint | None,
        interval_s: float,
        tokens: int,
        say: Say,
        on_result: Callable[[CanaryRecord], None],
    ):
        self.fp, self.interval_s, self.tokens, self.say = fp, interval_s, tokens, say
        self.on_result = on_result
        self.due: str | None = None  # why it is due: start, schedule
        self.last: CanaryRecord | None = None
        self.last_run = time.monotonic()
        self.path = canary_path()
        self._seen = self._mtime()
        self._thread: threading.Thread | None = None
        self._gen = 0  # which start of the split a running canary belongs to
        self._lock = threading.Lock()  # kicked from the watch's thread and the supervisor's

    def _mtime(self) -> int:
        try:
            return self.path.stat().st_mtime_ns
        except OSError:
            return 0

    def findings(self, server: LlamaServer, split_ready: bool) -> list[WatchFinding]:
        """Run the canary if it is due (on the split only), take in one written on
        demand, and say what the last one found."""
        if split_ready:
            self.kick(server)
        if self._mtime() != self._seen:
            self._seen = self._mtime()
            try:
                self.take(load_canary(self.path))
            except InputError as e:
                self.say(f"canary result {self.path}: {e.message}")
        if self.last is None and self.fp is not None and split_ready:
            return [WatchFinding(check="canary", verdict=Verdict.WARN, detail="not run yet")]
        if self.last is None or self.last.verdict is Verdict.PASS:
            return []
        return [WatchFinding(check="canary", verdict=self.last.verdict, detail=self.last.detail)]

    def kick(self, server: LlamaServer) -> None:
        """Start the canary if it is due (after a start, or by the schedule) and none is
        running. In a thread of its own: a split that hangs holds the canary's request,
        and the watch must go on ticking to see the stall."""
        with self._lock:
            running = self._thread is not None and self._thread.is_alive()
            if self.fp is None or running:
                return
            if self.due is None and self.interval_s and self._age() >= self.interval_s:
                self.due = "schedule"
            if self.due is None:
                return
            why, self.due = self.due, None
            self._thread = threading.Thread(
                target=self._run, args=(server, self.fp, why), daemon=True, name="canary"
            )
            self._thread.start()

    def _run(self, server: LlamaServer, fp: Fingerprint, why: str) -> None:
        from linkctl.serve.canary import run_canary

        gen = self._gen
        result = run_canary(server, fp, self.tokens, why)
        if gen != self._gen:  # of a server stopped since: says nothing of this one
            return
        save_record(result, self.path)
        self._seen = self._mtime()
        self.take(result)

    def _age(self) -> float:
        return time.monotonic() - self.last_run

    def take(self, result: CanaryRecord) -> None:
        self.last, self.last_run = result, time.monotonic()
        self.say(f"canary ({result.why}): {result.verdict} {result.detail} ({result.wall_s} s)")
        self.on_result(result)

    def forget(self) -> None:
        """A new start of the split: the last result was of the server before it."""
        self.last = None
        self._gen += 1


class HeadGuard:
    """The head's modes, the watch and the canary, as the supervisor's hooks:
    ``choose`` (which llama-server to start), ``before_start``, ``healthy``,
    ``on_ready``."""

    def __init__(
        self,
        profile: Profile,
        cfg: WatchConfig,
        sampler: Sampler,
        server: LlamaServer,
        split_ready: Callable[[], str | None],
        alone: tuple[ServerInvocation | None, str],
        fingerprint: Fingerprint | None,
        say: Say,
        publish: Callable[[WatchRecord], None],
    ):
        s = profile.serve
        self.cfg, self.say = cfg, say
        self.hold_s = s.fallback_hold_s
        self.server = server
        self.endpoints_answer = split_ready
        self.alone, self.alone_why = alone
        self.mode = "split"
        self.mode_t = time.monotonic()
        self.ready = False
        self.ready_tick = 0
        self.canary = CanaryClock(
            fingerprint,
            s.canary_interval_s,
            s.canary_tokens,
            say,
            on_result=self._canary_result,
        )
        sampler.expect_connected = lambda: self.mode == "split" and self.ready
        self.watch = Watch(
            cfg,
            sampler,
            on_record=publish,
            extra=lambda: self.canary.findings(server, self.mode == "split" and self.ready),
        )
        self.watch.record.mode_since = self.watch.record.since

    def _canary_result(self, result: CanaryRecord) -> None:
        self.watch.set_canary(result)
        if result.verdict is Verdict.FAIL:
            self.watch.wake()  # judged and acted on now, not at the next interval

    # ---- the supervisor's hooks --------------------------------------------------

    def choose_alone(self) -> bool:
        return self.mode == "alone"

    def before_start(self) -> str | None:
        if self.mode == "stopped":
            why = self._not_back_yet()
            if why:
                return f"split stopped ({self.watch.record.mode_reason}); {why}"
            self._set_mode("split", "the link held: back to the split")
        if self.mode == "split":
            return self.endpoints_answer()
        return None

    def on_ready(self, _pid: int) -> None:
        self.ready = True
        self.ready_tick = self.watch.record.ticks
        if self.mode == "split":
            self.canary.forget()
            self.canary.due = "start"
            self.canary.kick(self.server)  # now, not at the next tick

    def healthy(self, _pid: int) -> str | None:
        rec = self.watch.record
        if self.mode == "alone":
            if self._not_back_yet() is None and self.endpoints_answer() is None:
                return self._leave("split", f"the link held {self.hold_s:g} s: back to the split")
            return None
        # Only a reading taken after this start counts (the one before saw it loading).
        if rec.ticks <= self.ready_tick + 1 or rec.verdict is not Verdict.FAIL:
            return None
        why = "; ".join(f"{f.check}: {f.detail}" for f in rec.findings if f.verdict is Verdict.FAIL)
        if self.cfg.on_fail == "keep":
            return None
        if self.cfg.on_fail == "fallback" and self.alone is not None:
            return self._leave("alone", f"FAIL ({why}): serving on the head alone")
        if self.cfg.on_fail == "fallback":
            why += f"; no fallback: {self.alone_why}"
        return self._leave("stopped", f"FAIL ({why}): the split stopped")

    def on_exit(self, why: str) -> None:
        """llama-server on the split stopped by itself: llama.cpp's RPC client aborts the
        whole server when an RPC call fails (ggml-org/llama.cpp #25938), so a fault on
        the link or the peer often shows first as this exit. Under "fallback" the next
        start is the head alone."""
        if self.mode == "split" and self.cfg.on_fail == "fallback" and self.alone is not None:
            self._set_mode("alone", f"FAIL (llama-server {why}): serving on the head alone")
        self.ready = False

    def endpoint_lost(self, reason: str) -> str:
        """llama-server lost an rpc endpoint (it cannot reconnect by itself): the head
        alone under "fallback", else a restart that waits for the endpoints."""
        if self.cfg.on_fail == "fallback" and self.alone is not None:
            return self._leave("alone", f"FAIL (rpc: {reason}): serving on the head alone")
        return reason

    # ---- modes ----------------------------------------------------------------------

    def _not_back_yet(self) -> str | None:
        in_mode = time.monotonic() - self.mode_t
        held = self.watch.link_held_s()
        if min(in_mode, held) >= self.hold_s:
            return None
        return (
            f"back to the split once the link has held {self.hold_s:g} s "
            f"(held {held:.0f} s, {in_mode:.0f} s in this mode)"
        )

    def _leave(self, mode: str, reason: str) -> Switch:
        self._set_mode(mode, reason)
        return Switch(reason, stop_s=SWITCH_STOP_S)

    def _set_mode(self, mode: str, reason: str) -> None:
        self.say(f"watch: {reason}")
        self.mode, self.mode_t, self.ready = mode, time.monotonic(), False
        self.watch.set_mode(mode, reason)


def prometheus(record: WatchRecord, profile: str, host: str, role: str) -> str:
    """The watch as node_exporter's textfile collector reads it."""
    labels = f'profile="{profile}",host="{host}",role="{role}"'
    level = {Verdict.PASS: 0, Verdict.WARN: 1, Verdict.FAIL: 2}[record.verdict]
    lines = [
        "# HELP linkctl_watch_verdict The watch's verdict: 0 PASS, 1 WARN, 2 FAIL.",
        "# TYPE linkctl_watch_verdict gauge",
        f"linkctl_watch_verdict{{{labels}}} {level}",
        "# HELP linkctl_watch_mode 1 for the mode llama-server runs in (head).",
        "# TYPE linkctl_watch_mode gauge",
    ]
    for m in ("split", "alone", "stopped"):
        lines.append(f'linkctl_watch_mode{{{labels},mode="{m}"}} {int(record.mode == m)}')
    for k, v in sorted(record.figures.items()):
        if isinstance(v, int | float) and not isinstance(v, bool):
            lines.append(f"linkctl_watch_{k}{{{labels}}} {v}")
    if record.canary is not None:
        ok = int(record.canary.verdict is Verdict.PASS)
        lines.append(f"linkctl_watch_canary_pass{{{labels}}} {ok}")
        lines.append(f"linkctl_watch_canary_seconds{{{labels}}} {record.canary.wall_s}")
    return "\n".join(lines) + "\n"


def publisher(
    write_status: Callable[[WatchRecord], None], textfile: str | None, labels: tuple[str, str, str]
) -> Callable[[WatchRecord], None]:
    from linkctl.core.paths import write_atomic

    def publish(record: WatchRecord) -> None:
        write_status(record)
        if textfile:
            write_atomic(Path(textfile), prometheus(record, *labels))

    return publish


class RpcGuard:
    """rpc host: the watch's FAIL on rpc-server itself (stopped) restarts it."""

    def __init__(self, watch: Watch):
        self.watch = watch
        self.ready_tick = 0

    def on_ready(self, _pid: int) -> None:
        self.ready_tick = self.watch.record.ticks

    def healthy(self, _pid: int) -> str | None:
        rec = self.watch.record
        if rec.ticks <= self.ready_tick + 1:
            return None
        return next(
            (f.detail for f in rec.findings if f.check == "rpc" and f.verdict is Verdict.FAIL),
            None,
        )
