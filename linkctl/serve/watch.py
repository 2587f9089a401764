"""The watch while serving: what happens to the pair after the start.

Every ``serve.watch_interval_s`` it reads, adding no traffic to the RPC connection:

- the link interface: carrier and negotiated speed (the net backend);
- the live RPC connection as the kernel keeps it: smoothed RTT, retransmits, and how
  long since the other end last sent anything (TCP_INFO through sock_diag, Linux);
- rpc-server: on the head an established connection to every endpoint; on the rpc
  host the process itself, running and not stopped;
- on the head, llama-server's counters (--metrics): tokens decoded and prefilled and
  the seconds they took (the rates of the requests that finished in the interval), and
  the requests in progress. Prefill is where a slow link shows first: it moves a
  whole batch of activations per step (the lab's tiny model prefilled 5x slower on a
  link shaped to 100 Mbit/s, and decoded 20% slower);
- when no request ran in the interval, one ICMP echo to each peer (the active sample).

``judge`` turns one reading into findings; the worst is the verdict, kept with the time
it began. FAIL is what the pair cannot serve through (no carrier, an endpoint lost,
rpc-server silent while a request waits, rpc-server stopped, the canary); WARN is what
every token pays for and still works (a lower negotiated speed, RTT well above the
probe's, retransmits, decode or prefill below its range).
"""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from linkctl.core.checks import Verdict, worst
from linkctl.core.log import stamp
from linkctl.core.records import CanaryRecord, WatchFinding, WatchRecord

if TYPE_CHECKING:
    from linkctl.net.netstate import TcpConn

# RTT of the live connection above max(RTT_FACTOR x the probe's, the probe's + RTT_ADD_MS)
# is a WARN: a request/response flow's smoothed RTT runs a little above an idle probe's
# (measured in the lab: 0.05-0.1 ms against 0.03-0.05 ms).
RTT_FACTOR = 4.0
RTT_ADD_MS = 0.5
RETRANS_WARN = 3  # segments retransmitted in one interval (a healthy cable: none)
# A rate below this share of its reference is a WARN. Against the estimate the band is
# wider: it predicts llama-bench, and llama-server on a real pair ran 20-60% below it
# (issue 26); against the rate measured after the start, the spread of a busy shared
# machine (the lab saw healthy intervals at 0.79 x their reference).
RATE_LOW = {"estimate": 0.65, "measured": 0.7}
MIN_TOKENS = 16  # fewer tokens in an interval say nothing about a rate
# A rate is judged low only after this many intervals low in a row, and its reference
# is the median of this many first intervals: one interval of a busy shared machine
# (the lab's two cores also run the client and the proxy) is not a slow link.
RATE_INTERVALS = 2
REF_INTERVALS = 5
RATES = {  # the rate: (its Reading counters)
    "decode": ("tokens", "token_s"),
    "prefill": ("prompt_tokens", "prompt_s"),
}


@dataclass
class Reading:
    """One interval's facts, as sampled; None where a source gave nothing."""

    mono: float
    carrier: bool
    link_error: str | None = None
    speed_mbps: int | None = None
    conns: list[TcpConn] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)  # head: endpoints not connected
    process: str | None = None  # rpc host: why rpc-server is not running
    busy: int | None = None  # requests in progress (llama-server)
    # /metrics did not answer in time: llama-server's main loop, which answers it
    # (a task on its queue), is stuck, e.g. inside an RPC call that gets no answer.
    loop_stuck: bool = False
    tokens: float | None = None  # tokens decoded, cumulative (llama-server)
    token_s: float | None = None  # seconds spent decoding them, cumulative
    prompt_tokens: float | None = None  # tokens prefilled, cumulative
    prompt_s: float | None = None
    ping_ms: float | None = None
    ping_lost: str | None = None  # every echo to a peer went unanswered
    ping_error: str | None = None  # ping could not run: says nothing of the link


@dataclass
class WatchConfig:
    role: str  # head or rpc
    interface: str
    interval_s: float
    stall_s: float
    on_fail: str
    probe_rtt_ms: float | None = None  # the probe report's smallest-payload p50
    speed_mbps: int | None = None  # negotiated at the start
    # Each rate's reference (tok/s) and where it came from: "estimate" (the split's
    # prediction) or "measured" (this serve's first intervals on a passing link).
    refs: dict[str, tuple[float, str]] = field(default_factory=dict)

    def rtt_warn_ms(self) -> float | None:
        if self.probe_rtt_ms is None:
            return None
        return max(RTT_FACTOR * self.probe_rtt_ms, self.probe_rtt_ms + RTT_ADD_MS)


def judge(cfg: WatchConfig, now: Reading, before: Reading | None) -> list[WatchFinding]:
    """Findings for one interval (``before``: the previous reading, for rates)."""
    out: list[WatchFinding] = []

    def add(check: str, verdict: Verdict, detail: str) -> None:
        out.append(WatchFinding(check=check, verdict=verdict, detail=detail))

    if now.link_error or not now.carrier:
        add("carrier", Verdict.FAIL, now.link_error or f"{cfg.interface}: no carrier")
    elif cfg.speed_mbps and now.speed_mbps and now.speed_mbps < cfg.speed_mbps:
        add(
            "speed",
            Verdict.WARN,
            f"{cfg.interface} negotiated {now.speed_mbps} Mb/s, {cfg.speed_mbps} Mb/s at the start",
        )
    if now.missing:
        add("rpc", Verdict.FAIL, f"no connection to rpc endpoint {', '.join(now.missing)}")
    if now.process:
        add("rpc", Verdict.FAIL, now.process)
    if now.conns:
        silent = min(c.last_recv_ms for c in now.conns) / 1000
        if (now.busy or now.loop_stuck) and silent > cfg.stall_s:
            waits = (
                "llama-server's main loop waits"
                if now.loop_stuck
                else f"{now.busy} request(s) wait"
            )
            add(
                "stall",
                Verdict.FAIL,
                f"rpc-server sent nothing for {silent:.1f} s while {waits} "
                f"(limit {cfg.stall_s:g} s)",
            )
        rtt = fresh_rtt_ms(now, before, cfg.interval_s)
        bound = cfg.rtt_warn_ms()
        if rtt is not None and bound is not None and rtt > bound:
            add(
                "rtt",
                Verdict.WARN,
                f"RPC connection RTT {rtt:.2f} ms, above {bound:.2f} ms "
                f"(the probe measured {cfg.probe_rtt_ms:.3f} ms)",
            )
        if before is not None and before.conns:
            was = {c.local: c.retrans_total for c in before.conns}
            more = sum(c.retrans_total - was[c.local] for c in now.conns if c.local in was)
            if more >= RETRANS_WARN:
                add("retransmits", Verdict.WARN, f"{more} segments retransmitted in the interval")
    if now.ping_lost:
        add("ping", Verdict.FAIL, now.ping_lost)
    elif now.ping_error:
        add("ping", Verdict.WARN, now.ping_error)
    elif now.ping_ms is not None and (bound := cfg.rtt_warn_ms()) and now.ping_ms > bound:
        add("rtt", Verdict.WARN, f"ping {now.ping_ms:.2f} ms, above {bound:.2f} ms")
    for kind, (ref, source) in cfg.refs.items():
        r = rate(kind, now, before)
        low = RATE_LOW[source] * ref
        if r is not None and r < low:
            add(
                kind,
                Verdict.WARN,
                f"{kind} {r:.1f} tok/s, below {low:.1f} "
                f"({RATE_LOW[source]:g} x {ref:.1f} tok/s, {source})",
            )
    return out


def fresh_rtt_ms(now: Reading, before: Reading | None, interval_s: float) -> float | None:
    """The highest smoothed RTT among the RPC connections that sent data since the last
    reading, else None. The kernel moves a connection's RTT only when sent data is
    acknowledged: on one that sent nothing it is its last busy moment's (the model
    upload's queueing, a fault gone since), not the link's now; the idle echo speaks for
    the link then. The window: the time since the last reading (an interval plus the
    sampling)."""
    window_ms = (now.mono - before.mono) * 1000 if before else interval_s * 1000
    return max((c.rtt_ms for c in now.conns if c.last_send_ms <= window_ms), default=None)


def rate(kind: str, now: Reading, before: Reading | None) -> float | None:
    """tok/s (``kind``: decode or prefill) of the requests that finished between two
    readings: llama-server adds a request's tokens and times to its counters when it
    ends (tools/server/server-context.cpp, metrics on_prediction)."""
    n_key, s_key = RATES[kind]
    if before is None:
        return None
    vals = [getattr(x, k) for x in (now, before) for k in (n_key, s_key)]
    if None in vals:
        return None
    n1, s1, n0, s0 = vals
    if n1 - n0 < MIN_TOKENS or s1 - s0 <= 0:
        return None
    return float((n1 - n0) / (s1 - s0))


def figures(
    now: Reading, before: Reading | None, interval_s: float
) -> dict[str, float | int | str | None]:
    conns = now.conns
    rtt = fresh_rtt_ms(now, before, interval_s)
    f: dict[str, float | int | str | None] = {
        "carrier": int(now.carrier),
        "speed_mbps": now.speed_mbps,
        "rpc_connections": len(conns),
        "rtt_ms": round(rtt, 3) if rtt is not None else None,  # None: idle, see ping_ms
        "min_rtt_ms": round(min(c.min_rtt_ms for c in conns), 3) if conns else None,
        "retransmits_total": sum(c.retrans_total for c in conns) if conns else None,
        "rpc_silent_s": round(min(c.last_recv_ms for c in conns) / 1000, 3) if conns else None,
        "requests_busy": now.busy,
        "ping_ms": now.ping_ms,
    }
    for kind in RATES:
        r = rate(kind, now, before)
        f[f"{kind}_tok_s"] = round(r, 2) if r is not None else None
    return f


class Watch:
    """The watch's state: readings in, the record out. ``tick`` takes one reading
    (``sample``) and judges it; ``run`` ticks every interval in a thread of its own
    until ``stop``. ``extra`` adds findings of its own kind (the canary's) to a tick."""

    def __init__(
        self,
        cfg: WatchConfig,
        sample: Callable[[bool], Reading],
        *,
        on_record: Callable[[WatchRecord], None] | None = None,
        extra: Callable[[], list[WatchFinding]] | None = None,
    ):
        self.cfg = cfg
        self.sample = sample
        self.on_record = on_record
        self.extra = extra
        self.before: Reading | None = None
        now = stamp()
        # Not PASS before it has looked: WARN until the first reading.
        self.record = WatchRecord(
            verdict=Verdict.WARN,
            reasons=["watch: no reading yet"],
            since=now,
            interval_s=cfg.interval_s,
            checked_at=now,
            on_fail=cfg.on_fail,
        )
        self._link_ok_since: float | None = time.monotonic()
        self._rates: dict[str, list[float]] = {kind: [] for kind in RATES}
        self._low = dict.fromkeys(RATES, 0)  # intervals in a row each rate was low
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self.lock = threading.Lock()

    def set_mode(self, mode: str, reason: str) -> None:
        with self.lock:
            self.record.mode, self.record.mode_reason = mode, reason
            self.record.mode_since = stamp()
        self._publish()

    def set_canary(self, result: CanaryRecord) -> None:
        with self.lock:
            self.record.canary = result
        self._publish()

    def link_held_s(self) -> float:
        """How long every link finding has passed (carrier, ping, RTT, retransmits)."""
        since = self._link_ok_since
        return 0.0 if since is None else time.monotonic() - since

    def tick(self) -> WatchRecord:
        before = self.before
        # The active sample only when no request decoded in the interval: a busy link's
        # own connection says more than an echo, and costs nothing.
        idle = before is None or before.busy in (0, None)
        t0 = time.perf_counter()
        now = self.sample(idle)
        took_ms = (time.perf_counter() - t0) * 1000
        found = self._persistent(judge(self.cfg, now, before))
        if self.extra is not None:
            found += self.extra()
        self._learn_rates(now, before)
        link = {"carrier", "speed", "ping", "rtt", "retransmits"}
        if any(f.check in link and f.verdict is not Verdict.PASS for f in found):
            self._link_ok_since = None
        elif self._link_ok_since is None:
            self._link_ok_since = time.monotonic()
        verdict = worst(f.verdict for f in found)
        with self.lock:
            r = self.record
            if verdict is not r.verdict:
                r.since = stamp()
            r.verdict = verdict
            r.findings = found
            r.reasons = [f"{f.check}: {f.detail}" for f in found]
            r.figures = figures(now, before, self.cfg.interval_s) | {"sample_ms": round(took_ms, 2)}
            for kind, (ref, source) in self.cfg.refs.items():
                r.figures[f"{kind}_ref_tok_s"] = round(ref, 2)
                r.figures[f"{kind}_ref_source"] = source
            r.checked_at = stamp()
            r.ticks += 1
            r.link_held_s = round(self.link_held_s(), 1)
        self.before = now
        self._publish()
        return self.record

    def _persistent(self, found: list[WatchFinding]) -> list[WatchFinding]:
        """Rate findings only once they held RATE_INTERVALS intervals in a row."""
        out = []
        for kind in RATES:
            low = any(f.check == kind for f in found)
            self._low[kind] = self._low[kind] + 1 if low else 0
        for f in found:
            if f.check not in RATES or self._low[f.check] >= RATE_INTERVALS:
                out.append(f)
        return out

    def _learn_rates(self, now: Reading, before: Reading | None) -> None:
        """Without an estimate, a rate's reference is the median of the first
        REF_INTERVALS intervals that moved enough tokens while the link passed."""
        for kind, seen in self._rates.items():
            r = rate(kind, now, before)
            if kind in self.cfg.refs or r is None or self._link_ok_since is None:
                continue
            seen.append(r)
            if len(seen) >= REF_INTERVALS:
                self.cfg.refs[kind] = (statistics.median(seen), "measured")

    def _publish(self) -> None:
        if self.on_record is not None:
            with self.lock:
                copy = self.record.model_copy(deep=True)
            self.on_record(copy)

    # ---- in a thread -----------------------------------------------------------------

    def start(self) -> Watch:
        self._thread = threading.Thread(target=self._run, daemon=True, name="watch")
        self._thread.start()
        return self

    def _run(self) -> None:
        # The first reading at once: it pays the sources' one-time costs (pyroute2's
        # import alone is ~250 ms of CPU) before serving, not in the first requests.
        self.tick()
        while not self._stop.is_set():
            self._wake.wait(self.cfg.interval_s)
            self._wake.clear()
            if not self._stop.is_set():
                self.tick()

    def wake(self) -> None:
        """Take the next reading now (a canary FAIL is acted on at once, not at the
        next interval)."""
        self._wake.set()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=self.cfg.interval_s + 10)
