"""Where the watch's readings come from (linkctl.serve.watch.Reading): the net backend
(carrier, speed, the kernel's TCP figures, ping), llama-server's /metrics, and the
supervised process itself. Each source that fails says so in the reading; none raises.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from linkctl.core.errors import InputError
from linkctl.llama.client import UpstreamError, UpstreamTimeout
from linkctl.serve.watch import Reading

if TYPE_CHECKING:
    from linkctl.llama.client import LlamaServer
    from linkctl.net.backend import Backend
    from linkctl.net.ping import PingSummary

PING_TIMEOUT_S = 1.0
PING_COUNT = 2  # one echo lost on a busy path is not a peer gone


def process_problem(pid: int | None, name: str) -> str | None:
    """Why the process ``pid`` is not serving (stopped by a signal, a zombie), else None.
    An exit is the supervisor's to see."""
    import psutil

    if pid is None:
        return None
    try:
        st = psutil.Process(pid).status()
    except psutil.NoSuchProcess:
        return None
    if st in (psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP):
        return f"{name} (pid {pid}) is stopped (SIGSTOP or a debugger): it answers nothing"
    if st == psutil.STATUS_ZOMBIE:
        return f"{name} (pid {pid}) has exited"
    return None


@dataclass
class Sampler:
    """One reading per call. ``ends``: the RPC connection's known end ("ip:port"): the
    rpc endpoints on the head (each must be connected while ``expect_connected``), the
    rpc-server's own address on an rpc host."""

    backend: Backend
    interface: str
    peers: list[str]
    ends: list[str]
    server: LlamaServer | None = None  # the head's llama-server (--metrics)
    child: Callable[[], int | None] | None = None  # rpc host: rpc-server's pid
    expect_connected: Callable[[], bool] = lambda: True
    # /metrics goes through llama-server's main loop: a stuck loop answers nothing, and
    # waiting longer than half an interval would hold the reading (and the carrier's
    # verdict with it) past the interval.
    metrics_timeout_s: float = 2.0

    def __call__(self, idle: bool) -> Reading:
        r = Reading(mono=time.monotonic(), carrier=False)
        try:
            f = self.backend.link_facts(self.interface)
            r.carrier = f.carrier and f.up
            r.speed_mbps = f.speed_mbps
            if not f.up:
                r.link_error = f"{self.interface} is down"
        except InputError as e:  # the interface is gone (a deleted veth, a USB NIC pulled)
            r.link_error = e.message
        with contextlib.suppress(OSError):  # no sock_diag here: the other sources still read
            r.conns = self.backend.tcp_connections(self.ends)
        if self.server is not None and self.expect_connected():
            have = {c.remote for c in r.conns}
            r.missing = [e for e in self.ends if e not in have]
        if self.child is not None:
            r.process = process_problem(self.child(), "rpc-server")
        if self.server is not None:
            try:
                m = self.server.metrics(timeout=self.metrics_timeout_s)
                r.busy = int(m.get("requests_processing", 0))
                r.tokens = m.get("tokens_predicted_total")
                r.token_s = m.get("tokens_predicted_seconds_total")
                r.prompt_tokens = m.get("prompt_tokens_total")
                r.prompt_s = m.get("prompt_seconds_total")
            except UpstreamError as e:  # restarting, or stuck: only the latter says much
                r.loop_stuck = isinstance(e, UpstreamTimeout)
        # Off the split (the head alone) the link carries no RPC: the echo is what says
        # it is back, busy or not, and what the return's hold is counted from.
        if (idle or not self.expect_connected()) and r.carrier:
            self._ping(r)
        return r

    def _ping(self, r: Reading) -> None:
        """Two echoes to each peer: lost both is a peer that does not answer; a ping
        that could not run (no ICMP socket permitted, no binary) says nothing about the
        link."""
        worst = None
        for peer in self.peers:
            try:
                p = self._echo(peer)
            except InputError as e:
                r.ping_error = f"ping {peer} could not run: {e.message}"
                return
            except OSError as e:  # whatever the socket says, the watch's thread goes on
                r.ping_error = f"ping {peer} could not run: {e.strerror or e}"
                return
            if not p.received or p.avg_us is None:
                r.ping_lost = f"ping {peer}: no reply to {p.sent} echoes"
                return
            worst = max(worst or 0.0, p.avg_us / 1000)
        r.ping_ms = round(worst, 3) if worst is not None else None

    def _echo(self, peer: str) -> PingSummary:
        """The echoes through a datagram ICMP socket (no process, no capability: what
        the hardened serve unit can open); where the system does not permit that
        socket to this group, through the system's ping (root, by hand)."""
        from linkctl.net.echo import echo
        from linkctl.net.ping import parse_ping

        try:
            return echo(peer, count=PING_COUNT, interval_s=0.2, timeout_s=PING_TIMEOUT_S)
        except InputError as refused:
            argv = self.backend.ping_argv(
                peer, count=PING_COUNT, timeout_s=PING_TIMEOUT_S, interval_s=0.2
            )
            try:
                res = self.backend.runner.run(argv, timeout=PING_TIMEOUT_S + 3, check=False)
            except InputError:  # no ping binary, or it hung past its own deadline
                raise refused from None
            p = parse_ping(res.stdout)
            if not p.sent:  # it could not start either (the unit's sandbox): say why not
                raise refused from None
            return p
