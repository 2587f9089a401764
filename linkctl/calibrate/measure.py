"""`linkctl calibrate`, stage 2 of 3: run llama.cpp as the plan says and time it.

The only stage that takes time. It writes the plan's generated models (when not
there yet), starts the servers on 127.0.0.1, times the requests and stops every
server it started; the figures go to calibrate.record.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from linkctl.calibrate.plan import CalibrationPlan
from linkctl.core.paths import make_dirs
from linkctl.core.runner import Children, Runner, default_runner
from linkctl.llama.client import LlamaServer, Timing


@dataclass(frozen=True)
class RpcRuns:
    loopback_rtt_us: float  # GET_DEVICE_MEMORY p50, before llama-server connects
    runs: list[Timing]


@dataclass(frozen=True)
class Measurements:
    runs: list[list[Timing]]  # per plan model, in the plan's order
    rpc: RpcRuns | None = None


def measure(
    plan: CalibrationPlan,
    runner: Runner | None = None,
    say: Callable[[str], None] | None = None,
) -> Measurements:
    """``say`` gets one line per step (progress)."""
    from linkctl.gguf.tiny import write_tiny_llama

    runner = runner or default_runner()
    say = say or (lambda _line: None)
    make_dirs(Path(plan.workdir))
    for m in plan.models:
        if m.spec and not Path(m.path).is_file():
            say(f"writing {m.path}")
            write_tiny_llama(m.path, m.spec)

    # All servers up at once and the timed requests interleaved (A, B, A, B, ...), so a
    # burst of other load on the host hits every model alike instead of skewing the solve.
    runs: list[list[Timing]] = [[] for _ in plan.servers]
    with Children(runner) as srv:
        for s in plan.servers:
            say(f"loading {s.invocation.model} in llama-server on 127.0.0.1:{s.port}")
            server = LlamaServer.serving(s.invocation)
            server.wait_healthy(srv.spawn(s.argv, Path(s.log)), 300, Path(s.log))
        first = LlamaServer.serving(plan.servers[0].invocation)
        prompt = first.prompt_tokens(plan.prompt_tokens)
        for n in range(plan.runs):
            say(f"timed run {n + 1}/{plan.runs} on each of {len(plan.servers)} models")
            for i, s in enumerate(plan.servers):
                runs[i] += LlamaServer.serving(s.invocation).timed_completions(
                    plan.tokens, 1, prompt
                )
    if not (plan.rpc_server and plan.rpc_head):
        return Measurements(runs)

    from linkctl.llama.rpc import round_trip_us, wait_ready

    with Children(runner) as srv:
        rs, head = plan.rpc_server, plan.rpc_head
        say(f"ggml-rpc-server on 127.0.0.1:{rs.port}: loopback round trip")
        srv.spawn(rs.argv, Path(rs.log))
        wait_ready("127.0.0.1", rs.port, 30)
        loop_rtt = round_trip_us("127.0.0.1", rs.port)
        say(f"loading {head.invocation.model} in llama-server behind it, {plan.runs} timed runs")
        hp = srv.spawn(head.argv, Path(head.log))
        behind = LlamaServer.serving(head.invocation)
        behind.wait_healthy(hp, 300, Path(head.log))
        rpc_runs = behind.timed_completions(plan.tokens, plan.runs, prompt)
    return Measurements(runs, RpcRuns(loop_rtt, rpc_runs))
