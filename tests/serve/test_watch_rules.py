"""The watch's rules on given readings (pure: linkctl.serve.watch.judge and Watch), and
the supervisor's Switch with a real child process. The lab faults are tests/test_watch.py."""

from __future__ import annotations

import sys
import time

from linkctl.core.checks import Verdict
from linkctl.net.netstate import TcpConn
from linkctl.serve.watch import (
    RATE_INTERVALS,
    REF_INTERVALS,
    Reading,
    Watch,
    WatchConfig,
    figures,
    judge,
)


def cfg(**kw) -> WatchConfig:
    base = {
        "role": "head",
        "interface": "en0",
        "interval_s": 1.0,
        "stall_s": 2.0,
        "on_fail": "fallback",
        "probe_rtt_ms": 0.05,
        "speed_mbps": 10000,
    }
    return WatchConfig(**(base | kw))


def conn(**kw) -> TcpConn:
    base = {
        "local": "198.18.100.1:40000",
        "remote": "198.18.100.2:50052",
        "rtt_ms": 0.08,
        "min_rtt_ms": 0.02,
        "retrans_total": 0,
        "unacked": 0,
        "last_send_ms": 0,
        "last_recv_ms": 0,
        "bytes_sent": 1,
        "bytes_received": 1,
    }
    return TcpConn(**(base | kw))


def reading(**kw) -> Reading:
    return Reading(**({"mono": 0.0, "carrier": True, "speed_mbps": 10000} | kw))


def checks(found) -> dict[str, Verdict]:
    return {f.check: f.verdict for f in found}


def test_a_healthy_reading_has_no_finding():
    assert judge(cfg(), reading(conns=[conn()]), reading(conns=[conn()])) == []


def test_link_findings():
    c = cfg()
    assert checks(judge(c, reading(carrier=False), None)) == {"carrier": Verdict.FAIL}
    gone = reading(carrier=False, link_error="interface 'en0' does not exist here")
    assert judge(c, gone, None)[0].detail == "interface 'en0' does not exist here"
    assert checks(judge(c, reading(speed_mbps=1000), None)) == {"speed": Verdict.WARN}
    # RTT: above max(4 x probe, probe + 0.5 ms) = 0.55 ms here
    assert judge(c, reading(conns=[conn(rtt_ms=0.5)]), None) == []
    assert checks(judge(c, reading(conns=[conn(rtt_ms=0.6)]), None)) == {"rtt": Verdict.WARN}
    # a connection that sent nothing this interval: its smoothed RTT is its last busy
    # moment's (the kernel moves it on ACKs of new data), not the link's now
    stale = conn(rtt_ms=0.73, last_send_ms=1500)
    assert judge(c, reading(conns=[stale]), None) == []
    assert checks(judge(c, reading(conns=[stale, conn(rtt_ms=0.6)]), None)) == {"rtt": Verdict.WARN}
    # no probe report: no RTT bound to judge by
    assert judge(cfg(probe_rtt_ms=None), reading(conns=[conn(rtt_ms=9)]), None) == []
    more = judge(c, reading(conns=[conn(retrans_total=7)]), reading(conns=[conn(retrans_total=4)]))
    assert checks(more) == {"retransmits": Verdict.WARN}
    lost = judge(c, reading(ping_lost="ping x: no reply to 2 echoes"), None)
    assert checks(lost) == {"ping": Verdict.FAIL}
    cannot = judge(c, reading(ping_error="ping x could not run: permission denied"), None)
    assert checks(cannot) == {"ping": Verdict.WARN}


def test_the_rtt_figure_is_of_connections_that_sent_since_the_last_reading():
    busy, stale = conn(rtt_ms=0.2), conn(local="198.18.100.1:40001", rtt_ms=0.9, last_send_ms=1500)
    before, now = reading(mono=10.0), reading(mono=11.0, conns=[busy, stale])
    assert figures(now, before, 1.0)["rtt_ms"] == 0.2
    # 1.6 s since the last reading (a slow sample): the stale one sent within it
    assert figures(reading(mono=11.6, conns=[busy, stale]), before, 1.0)["rtt_ms"] == 0.9
    # idle: no RTT figure (the echo's ping_ms speaks for the link), the count still there
    idle = figures(reading(mono=11.0, conns=[stale], ping_ms=0.05), before, 1.0)
    assert (idle["rtt_ms"], idle["rpc_connections"], idle["ping_ms"]) == (None, 1, 0.05)


def test_rpc_findings_and_the_stall_needs_someone_waiting():
    c = cfg()
    lost = judge(c, reading(missing=["198.18.100.2:50052"]), None)
    assert checks(lost) == {"rpc": Verdict.FAIL}
    silent = conn(last_recv_ms=5000)
    assert judge(c, reading(conns=[silent], busy=0), None) == []  # idle: silence is fine
    assert checks(judge(c, reading(conns=[silent], busy=1), None)) == {"stall": Verdict.FAIL}
    stuck = judge(c, reading(conns=[silent], loop_stuck=True), None)
    assert checks(stuck) == {"stall": Verdict.FAIL} and "main loop" in stuck[0].detail
    assert judge(c, reading(conns=[conn(last_recv_ms=1500)], busy=1), None) == []


def test_rates_judge_against_their_reference_and_band():
    c = cfg(refs={"decode": (100.0, "measured"), "prefill": (1000.0, "estimate")})
    before = reading(tokens=0, token_s=0, prompt_tokens=0, prompt_s=0)
    slow = reading(tokens=60, token_s=1.0, prompt_tokens=600, prompt_s=1.0)
    got = checks(judge(c, slow, before))
    assert got == {"decode": Verdict.WARN, "prefill": Verdict.WARN}
    ok = reading(tokens=80, token_s=1.0, prompt_tokens=700, prompt_s=1.0)  # 0.8, 0.7 x ref
    assert judge(c, ok, before) == []
    few = reading(tokens=5, token_s=1.0, prompt_tokens=5, prompt_s=1.0)  # too few to judge
    assert judge(c, few, before) == []


def test_the_watch_learns_a_reference_and_reports_a_low_rate_only_when_it_holds():
    rates = iter([100.0] * (REF_INTERVALS + 1) + [50.0] * RATE_INTERVALS + [100.0])
    state = {"n": 0.0, "s": 0.0}

    def sample(_idle: bool) -> Reading:
        state["n"] += next(rates)
        state["s"] += 1.0
        return reading(conns=[conn()], tokens=state["n"], token_s=state["s"])

    w = Watch(cfg(), sample)
    for _ in range(REF_INTERVALS + 1):  # the first reading has nothing before it
        assert w.tick().verdict is Verdict.PASS
    assert w.cfg.refs["decode"] == (100.0, "measured")
    verdicts = [w.tick().verdict for _ in range(RATE_INTERVALS)]
    assert verdicts == [Verdict.PASS] * (RATE_INTERVALS - 1) + [Verdict.WARN]
    assert "decode 50.0 tok/s" in w.record.reasons[0]
    assert w.tick().verdict is Verdict.PASS  # back at once
    assert w.record.figures["decode_ref_source"] == "measured"


def test_link_held_restarts_on_a_link_finding():
    link = iter([True, False, True])
    w = Watch(cfg(), lambda _i: reading(carrier=next(link)))
    w.tick()
    time.sleep(0.05)
    assert w.link_held_s() >= 0.05
    w.tick()
    assert w.record.verdict is Verdict.FAIL and w.link_held_s() == 0.0
    w.tick()
    assert w.record.verdict is Verdict.PASS and w.link_held_s() < 0.05


def test_a_switch_restarts_at_once_without_counting_as_a_failure():
    """A real child (python sleeping): healthy() answers a Switch three times; each
    restart is immediate (no backoff), the start limit of 2 is not reached."""
    from linkctl.serve.supervise import ChildSpec, Policy, Supervisor, Switch

    sup: Supervisor | None = None
    seen: list[str] = []

    def healthy(_pid: int) -> str | None:
        assert sup is not None
        if sup.status.starts <= 3:
            return Switch(f"switch {sup.status.starts}", stop_s=1.0)
        sup.request_stop()
        return None

    spec = ChildSpec(
        "sleeper",
        [sys.executable, "-c", "import time; time.sleep(60)"],
        healthy=healthy,
        health_interval=0.05,
    )
    sup = Supervisor(
        spec,
        policy=Policy(backoff_initial=30, max_starts=2, poll_s=0.02),
        choose=lambda: seen.append("chosen") or spec,
    )
    t0 = time.monotonic()
    assert sup.run(install_signals=False) == 0
    assert sup.status.starts == 4 and len(seen) == 4
    assert time.monotonic() - t0 < 15  # a backoff of 30 s would have shown
    exits = [e["reason"] for e in sup.status.events if e["event"] == "exit"]
    assert exits == ["switch 1", "switch 2", "switch 3"]
