"""`linkctl lab demo`: the whole path in lab namespaces, in one command.

lab up -> `setup` on every host -> (tbf shaping) -> `responder` on every rpc
host -> `probe` from the head to each rpc host -> a tiny GGUF -> `calibrate`
(rpc hosts behind loopback RPC, the head alone) -> `serve` on the rpc hosts
-> (delay proxies) -> `doctor` on the head -> the RPC round trip -> `estimate`
on the head -> `verify` on the head -> `serve` on the head -> timed completions
-> `teardown` -> one report. Every step runs the real `linkctl` command inside
the host's namespace, as a user runs it on the real host; the demo only
sequences them and reads their JSON. Whatever happens (failure, Ctrl-C,
SIGTERM) the lab's processes, namespaces and files are removed; the report
and the step logs stay in the state directory.

Shape: each stage is a Step (linkctl.lab.demo_steps: a title, run(ctx), cleanup(ctx))
over one typed DemoContext (linkctl.lab.demo_context, which holds the typed
DemoReport as it fills in); `steps()` yields them in order (lazily: later titles name
the lab's hosts), and Demo, here, runs them, prints progress, and on any exit undoes
every step that started, in reverse.
"""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from linkctl.core.errors import LinkctlError
from linkctl.core.paths import state_dir
from linkctl.core.profile import Profile
from linkctl.core.runner import Runner, default_runner
from linkctl.lab import netns
from linkctl.lab.demo_context import DemoContext, DemoOptions, DemoReport, StepInfo
from linkctl.lab.demo_steps import Step, steps


@dataclass
class Demo:
    profile: Profile
    opts: DemoOptions
    say: Callable[[str], None] = lambda _m: None
    runner: Runner = field(default_factory=default_runner)
    done: list[StepInfo] = field(default_factory=list)  # the report's step list

    @property
    def out_dir(self) -> Path:
        """Report and logs: in the state directory, outside the lab (which is removed)."""
        return state_dir() / "demo" / self.opts.name

    def plan(self) -> DemoPlan:
        """What run() would do (`lab demo --dry-run`): the same refusals (options, a lab
        already up), every step's title in order, and where it would write; makes,
        starts and writes nothing."""
        rate_bps = self.opts.check()
        ctx = DemoContext(self.profile, self.opts, rate_bps, self.out_dir, self.runner, self.say)
        titles = []
        for step in steps(ctx):
            step.plan(ctx)
            if not step.silent:
                titles.append(step.title)
        assert ctx.lab is not None
        return DemoPlan(
            profile=self.profile.name,
            lab=ctx.lab,
            namespaces=netns.namespaces(ctx.lab),
            steps=titles,
            writes=[ctx.lab.root, str(self.out_dir)],
        )

    def run(self) -> DemoReport:
        """Run every step; always clean up. Returns the report (also saved)."""
        rate_bps = self.opts.check()
        self.out_dir.joinpath("logs").mkdir(parents=True, exist_ok=True)
        ctx = DemoContext(self.profile, self.opts, rate_bps, self.out_dir, self.runner, self.say)
        started: list[Step] = []
        t0 = time.monotonic()
        old_term = signal.signal(signal.SIGTERM, _raise_interrupt)
        outcome = "interrupted"
        try:
            for step in steps(ctx):
                started.append(step)
                self._run_step(ctx, step)
            outcome = "ok"
        except LinkctlError as e:
            outcome = f"failed: {e.line()}"
            raise
        finally:
            # A second Ctrl-C must not cut the cleanup short and leave namespaces behind.
            old_int = signal.signal(signal.SIGINT, signal.SIG_IGN)
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            try:
                for step in reversed(started):
                    step.cleanup(ctx)
                ctx.report.left_behind = left_behind(ctx)
            finally:
                signal.signal(signal.SIGINT, old_int)
                signal.signal(signal.SIGTERM, old_term)
            ctx.report.outcome = outcome
            ctx.report.total_s = round(time.monotonic() - t0, 1)
            ctx.report.steps = self.done
            self.out_dir.mkdir(parents=True, exist_ok=True)
            text = json.dumps(ctx.report.as_json(), indent=2)
            (self.out_dir / "report.json").write_text(text + "\n")
        return ctx.report

    def _run_step(self, ctx: DemoContext, step: Step) -> None:
        if step.silent:
            step.run(ctx)
            return
        self.say(f"[{len(self.done) + 1:>2}] {step.title} ...")
        t0 = time.monotonic()
        result = step.run(ctx)
        info = StepInfo(step=step.title, seconds=round(time.monotonic() - t0, 2))
        if result is not None:
            info.result = result
        self.done.append(info)
        shown = "done" if info.result is None else info.result
        self.say(f"     {shown} ({info.seconds:.1f} s)")


@dataclass
class DemoPlan:
    """`lab demo --dry-run`: the lab it would make, its steps, the directories it writes
    (the lab's, removed at the end; the report's and logs', kept)."""

    profile: str
    lab: netns.Lab
    namespaces: list[str]
    steps: list[str]
    writes: list[str]

    def as_json(self) -> dict[str, Any]:
        return {**asdict(self), "dry_run": True}


def left_behind(ctx: DemoContext) -> list[str]:
    """What of the demo's still exists after its cleanup (the report says; tests check)."""
    from pyroute2 import netns

    if ctx.lab is None:  # never made a lab (refused, or stopped before): nothing of ours
        return []
    left = [f"netns {ns}" for ns in netns.listnetns() if ns.startswith(f"lk-{ctx.opts.name}-")]
    left += [f"pid {bg.proc.pid} ({bg.what})" for bg in ctx.background if bg.proc.poll() is None]
    if Path(ctx.lab.root).exists():
        left.append(ctx.lab.root)
    return left


def _raise_interrupt(_sig: int, _frame: Any) -> None:
    raise KeyboardInterrupt
