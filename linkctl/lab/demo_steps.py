"""The demo's steps, in order: each a title, run(ctx) and cleanup(ctx) over one
DemoContext. Every step runs the real `linkctl` command inside a host's namespace and
reads its JSON into the report."""

from __future__ import annotations

import contextlib
import json
import statistics
import sys
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any

from linkctl.core.checks import Check, Verdict, failed_text
from linkctl.core.errors import CheckFailed
from linkctl.core.records import ProbeRecord, parse
from linkctl.core.runner import Result
from linkctl.lab import netns
from linkctl.lab.demo_context import (
    MODEL_SPEC,
    PROMPT,
    Background,
    Calibration,
    DemoContext,
    DemoOptions,
    DoctorSummary,
    HostInfo,
    LabInfo,
    LinkResult,
    Measured,
    ModelInfo,
    Predicted,
    ProbeLimits,
    Shaping,
    VerifyResult,
)

CALIBRATE_TOKENS, CALIBRATE_RUNS = 64, 5
PROXY_PORT_OFFSET = 1  # the delay proxy listens on the rpc port + 1, same address
RPC_RTT_SAMPLES = 200


class Step:
    """One stage of the demo. ``run`` may set the progress line's result; ``cleanup``
    undoes what ``run`` left running (called, in reverse order, for every step that
    started, whether it finished or not). A silent step prints nothing and is not in
    the report's step list."""

    title: str = ""
    silent: bool = False

    def run(self, ctx: DemoContext) -> str | None:
        raise NotImplementedError

    def plan(self, ctx: DemoContext) -> None:
        """For `lab demo --dry-run`: set, changing nothing, what later steps' titles need."""
        return None

    def cleanup(self, ctx: DemoContext) -> None:
        return None


class LabUp(Step):
    def __init__(self, n_hosts: int):
        self.title = f"lab up: namespaces for {n_hosts} hosts"

    def run(self, ctx: DemoContext) -> str:
        ctx.lab = lab = netns.up(ctx.profile, ctx.opts.name)
        return ", ".join(f"{h.name} {h.address}" for h in lab.hosts)

    def plan(self, ctx: DemoContext) -> None:
        ctx.lab = netns.plan(ctx.profile, ctx.opts.name)

    def cleanup(self, ctx: DemoContext) -> None:
        if ctx.lab is not None:
            ctx.say("cleaning up: lab down")
            netns.down(ctx.lab.name)


class WriteProfiles(Step):
    """The lab profile with the demo's model, threads and context; and the head's
    copy, whose rpc ports point at the delay proxies when there is a delay."""

    silent = True

    def run(self, ctx: DemoContext) -> None:
        import tomli_w

        self.plan(ctx)
        ctx.prof_path.write_text(tomli_w.dumps(ctx.prof))
        if ctx.head_prof_path != ctx.prof_path:
            ctx.head_prof_path.write_text(tomli_w.dumps(ctx.head_prof))

    def plan(self, ctx: DemoContext) -> None:
        """Both profiles, their paths and the report's lab sections, in memory."""
        import tomli_w

        assert ctx.lab is not None
        root = Path(ctx.lab.root)
        ctx.model_path = root / "tiny.gguf"
        # The lab profile, as `lab up` writes it (ctx.lab.profile_path).
        data = netns.remap_profile(ctx.profile).to_toml_dict()
        t = ctx.opts.threads
        data["serve"] |= {"model": str(ctx.model_path), "ctx": MODEL_SPEC.n_ctx, "threads": t}
        for h in data["hosts"]:
            h.setdefault("rpc", {})["threads"] = t
        if ctx.rate_bps:
            # The shaped link is slow on purpose: hold it to 80% of the rate set.
            data["probe"]["min_throughput_gbps"] = round(0.8 * ctx.rate_bps / 1e9, 3)
        ctx.prof_path = ctx.head_prof_path = root / "demo.toml"
        ctx.prof = ctx.head_prof = tomllib.loads(tomli_w.dumps(data))
        if ctx.opts.delay_ms:
            for h in data["hosts"]:
                if h["role"] == "rpc":
                    h["rpc"]["port"] += PROXY_PORT_OFFSET
            ctx.head_prof_path = root / "demo-head.toml"
            ctx.head_prof = tomllib.loads(tomli_w.dumps(data))
        prof, lab, rep = ctx.prof, ctx.lab, ctx.report
        rep.profile = ctx.profile.name
        rep.lab = LabInfo(name=lab.name, subnet=prof["link"]["subnet"], profile=str(ctx.prof_path))
        rep.hosts = [
            HostInfo(name=h.name, address=h.address, interface=h.interface) for h in lab.hosts
        ]
        rep.shaping = Shaping(rate_bps=ctx.rate_bps, delay_ms=ctx.opts.delay_ms)
        rep.probe_limits = ProbeLimits(
            max_rtt_p99_us=prof["probe"]["max_rtt_p99_us"],
            min_throughput_gbps=prof["probe"]["min_throughput_gbps"],
        )


class Linkctl(Step):
    """`linkctl ARGS --profile P` on one host; a non-zero exit stops the demo."""

    def __init__(self, title: str, host: str, *args: str):
        self.title, self.host, self.args = title, host, args

    def run(self, ctx: DemoContext) -> None:
        ctx.linkctl(self.host, *self.args, "--profile", str(ctx.prof_path))


class Shape(Step):
    def __init__(self, rate_bps: int):
        self.rate_bps = rate_bps
        self.title = f"shape the link: tbf {rate_bps / 1e9:g} Gbit/s each way"

    def run(self, ctx: DemoContext) -> None:
        assert ctx.lab is not None
        netns.shape(ctx.lab, self.rate_bps)


class BackgroundStep(Step):
    """A process that keeps running after the step (responder, serve, delay proxy);
    its cleanup stops it."""

    bg: Background | None = None

    def cleanup(self, ctx: DemoContext) -> None:
        if self.bg is not None:
            self.bg.stop()


class Responder(BackgroundStep):
    def __init__(self, host: dict[str, Any]):
        self.host = host
        self.title = f"responder on {host['name']}"

    def run(self, ctx: DemoContext) -> None:
        h = self.host
        argv = ["linkctl", "responder", "--profile", str(ctx.prof_path)]
        self.bg = ctx.start(h["name"], "responder", argv)
        port = ctx.prof["probe"]["responder_port"]
        ctx.wait_port(ctx.head, h["address"].split("/")[0], port, self.bg)


def doctor_checks_of(rows: list[dict[str, Any]]) -> list[Check]:
    """`linkctl doctor --json`'s lines (its "checks": doctor.DoctorResult.as_json) as
    Check records."""
    return [
        Check(
            name=r["check"],
            verdict=Verdict(r["verdict"]),
            value=r.get("value"),
            threshold=r.get("threshold"),
            detail=r.get("detail") or "",
            fix=r.get("fix"),
        )
        for r in rows
    ]


class ProbeOutcome(Enum):
    PASSED = "passed"
    FAILED = "failed"  # it ran and a check failed: the link, or a load spike
    COULD_NOT_RUN = "could not run"  # stopped, died, or printed no report


@dataclass(frozen=True)
class ProbeAttempt:
    """One `linkctl probe --json`: its process, its report (None when it printed none)
    and its outcome, with why when it did not pass."""

    result: Result
    record: ProbeRecord | None
    outcome: ProbeOutcome
    why: str = ""  # the stop reason, the failed checks with figures, or last words

    def __str__(self) -> str:
        return f"{self.outcome.value}: {self.why}" if self.why else self.outcome.value


class Probe(Step):
    def __init__(self, head: str, peer: str):
        self.head, self.peer = head, peer
        self.title = f"probe {head} -> {peer}"

    def run(self, ctx: DemoContext) -> str:
        r = self.probe(ctx)
        if ctx.report.link is None:
            ctx.report.link = []
        ctx.report.link.append(r)
        if not r.ok:
            raise CheckFailed(
                f"probe {self.head} -> {self.peer} failed: {r.failed}",
                f"see {ctx.out_dir / 'logs'}",
            )
        return (
            f"{Verdict.PASS}: RTT p50 {r.rtt_p50_us:.0f} µs, "
            f"{r.throughput_gbps:.1f} Gbit/s, path MTU {r.path_mtu}"
        )

    def attempt(self, ctx: DemoContext, log: Path) -> ProbeAttempt:
        """One `linkctl probe --json`, and whether it passed; if not, why: the report's
        stop reason, its failed checks with their figures, or the process's own last
        words."""
        argv = ["linkctl", "probe", "--profile", str(ctx.prof_path), "--peer", self.peer]
        r = ctx.run_in(self.head, [*argv, "--json"], log, timeout=180)
        data: Any = None
        if r.stdout.strip().startswith("["):  # a list of reports, one per peer probed
            with contextlib.suppress(ValueError, LookupError):
                data = json.loads(r.stdout)[0]
        rec = None
        if data:
            rec = parse(
                ProbeRecord,
                data,
                f"from `linkctl probe --peer {self.peer} --json`",
                "probe report",
                f"see {log}",
            )
        if r.returncode == 0 and rec is not None:
            return ProbeAttempt(r, rec, ProbeOutcome.PASSED)
        if rec is not None and rec.stopped:
            return ProbeAttempt(r, rec, ProbeOutcome.COULD_NOT_RUN, rec.stopped)
        failed = failed_text(rec.checks) if rec is not None else ""
        if failed:
            return ProbeAttempt(r, rec, ProbeOutcome.FAILED, failed)
        last = (r.stderr.strip() or "no output").splitlines()[-1]
        return ProbeAttempt(r, rec, ProbeOutcome.COULD_NOT_RUN, f"{last} (exit {r.returncode})")

    def probe(self, ctx: DemoContext) -> LinkResult:
        """Probe; once more if the first run did not pass.

        The lab's hosts share this machine's CPUs with everything else. Under CI load a
        probe has died with no output, stopped (exit 2), and missed the lab's 5 ms tail
        on 1000 round trips; a second run tells a load spike from a broken link. The
        first run's outcome is said, kept in the log and in the report."""
        peer = self.peer
        log = ctx.log(f"{self.head}-probe-{peer}.log")
        first = last = self.attempt(ctx, log)
        if first.outcome is not ProbeOutcome.PASSED:
            ctx.say(f"     first probe {first}; the lab shares its CPU: probing once more")
            text = log.read_text()
            last = self.attempt(ctx, log)
            log.write_text(f"{text}\n--- second run ---\n{log.read_text()}")
        rep = last.record
        if last.outcome is ProbeOutcome.COULD_NOT_RUN or rep is None:
            raise CheckFailed(f"`linkctl probe --peer {peer}` {last}", f"see {log}")
        checks = rep.checks
        tcp1 = rep.latency.tcp["1"]
        thr = rep.runs()
        return LinkResult(
            peer=peer,
            ok=rep.ok,
            failed=failed_text(checks),
            first_run=None if first.outcome is ProbeOutcome.PASSED else str(first),
            path_mtu=rep.mtu.path_mtu_at_least,
            rtt_p50_us=tcp1.p50_us,
            rtt_p99_us=tcp1.p99_us,
            rtt_32k_p50_us=rep.latency.tcp["32768"].p50_us,
            throughput_gbps=thr["fwd_p1"].gbps,
            throughput_rev_gbps=thr["rev_p1"].gbps,
            throughput_p4_gbps=thr["fwd_p4"].gbps,
            retransmits=sum(v.retransmits or 0 for v in thr.values()),
            verdicts={c.name: c.verdict for c in checks},
        )


class TinyModel(Step):
    title = "write a tiny random-weight llama GGUF"

    def run(self, ctx: DemoContext) -> str:
        from linkctl.gguf.tiny import write_tiny_llama

        m = write_tiny_llama(ctx.model_path, MODEL_SPEC)
        ctx.report.model = ModelInfo(**{k: m[k] for k in ("bytes", "n_layer", "n_embd", "params")})
        return f"{m['n_layer']} layers, {m['bytes'] / 1e6:.0f} MB F32"


class Calibrate(Step):
    def __init__(self, host: str, rpc: bool):
        self.host, self.rpc = host, rpc
        self.title = f"calibrate {host}" + (" (behind loopback RPC)" if rpc else "")

    def run(self, ctx: DemoContext) -> str:
        c = ctx.json_of(
            self.host,
            "calibrate",
            "--profile",
            str(ctx.prof_path),
            "--model",
            str(ctx.model_path),
            "--threads",
            str(ctx.opts.threads),
            "--tokens",
            str(CALIBRATE_TOKENS),
            "--runs",
            str(CALIBRATE_RUNS),
            *(["--rpc"] if self.rpc else []),
            timeout=600,
        )
        if self.rpc:
            ctx.cal_files.append(c["saved_to"])
        if ctx.report.calibration is None:
            ctx.report.calibration = {}
        ctx.report.calibration[self.host] = Calibration(
            decode_tok_s=c["decode_tok_s"],
            effective_bandwidth_gbs=c["effective_bandwidth_gbs"],
            rpc_effective_bandwidth_gbs=c.get("rpc_effective_bandwidth_gbs"),
        )
        return f"{c['decode_tok_s']:.1f} tok/s alone, {c['effective_bandwidth_gbs']:.2f} GB/s"


class ServeRpc(BackgroundStep):
    def __init__(self, host: dict[str, Any]):
        self.host = host
        endpoint = f"{host['address'].split('/')[0]}:{host['rpc']['port']}"
        self.title = f"serve on {host['name']}: rpc-server on {endpoint}"

    def run(self, ctx: DemoContext) -> None:
        argv = ["linkctl", "serve", "--profile", str(ctx.prof_path)]
        self.bg = ctx.start(self.host["name"], "serve", argv)
        ctx.wait_ready(self.host["name"], "rpc", self.bg, 60)


class DelayProxy(BackgroundStep):
    def __init__(self, host: dict[str, Any], delay_ms: float):
        self.host, self.delay_ms = host, delay_ms
        self.title = f"delay proxy on {host['name']}: +{delay_ms:g} ms each way"

    def run(self, ctx: DemoContext) -> None:
        ip, port = self.host["address"].split("/")[0], self.host["rpc"]["port"]
        listen = port + PROXY_PORT_OFFSET
        argv = [sys.executable, "-m", "linkctl.lab.delayproxy", "--listen", f"{ip}:{listen}"]
        argv += ["--target", f"{ip}:{port}", "--delay-ms", str(self.delay_ms)]
        self.bg = ctx.start(self.host["name"], "delayproxy", argv)
        ctx.wait_port(ctx.head, ip, listen, self.bg)


class Doctor(Step):
    def __init__(self, head: str):
        self.head = head
        self.title = f"doctor on {head}"

    def run(self, ctx: DemoContext) -> str:
        log = ctx.log(f"{self.head}-doctor.log")
        argv = ["linkctl", "doctor", "--profile", str(ctx.prof_path), "--json"]
        r = ctx.run_in(self.head, argv, log, timeout=120)
        rows = json.loads(r.stdout)["checks"] if r.stdout.strip().startswith("{") else []
        checks = doctor_checks_of(rows)
        count = {v: sum(c.verdict is v for c in checks) for v in Verdict}
        ctx.report.doctor = DoctorSummary(
            exit_code=r.returncode,
            passed=count[Verdict.PASS],
            warned=count[Verdict.WARN],
            failed=count[Verdict.FAIL],
        )
        if r.returncode != 0:
            failed = "; ".join(f"{c.name}: {c.detail}" for c in checks if not c.ok)
            raise CheckFailed(
                f"doctor on {self.head} exited {r.returncode}: {failed or r.stderr.strip()}",
                f"see {log}",
            )
        shown = (Verdict.PASS, Verdict.WARN, Verdict.FAIL)
        return ", ".join(f"{count[v]} {v}" for v in shown)


class RpcRoundTrip(Step):
    def __init__(self, head: str, ip: str, port: int):
        self.head, self.ip, self.port = head, ip, port
        self.title = f"RPC round trip {head} -> {ip}:{port}"

    def run(self, ctx: DemoContext) -> str:
        from linkctl.llama.rpc import round_trip_us

        assert ctx.lab is not None and ctx.report.link is not None
        # Before llama-server connects: rpc-server serves one client at a time.
        with netns.inside(ctx.lab.host(self.head).netns):
            ctx.rtts.append(round_trip_us(self.ip, self.port, RPC_RTT_SAMPLES))
        ctx.report.link[len(ctx.rtts) - 1].rpc_rtt_p50_us = round(ctx.rtts[-1], 1)
        return f"p50 {ctx.rtts[-1]:.0f} µs over {RPC_RTT_SAMPLES} GET_DEVICE_MEMORY"


class EstimateOnHead(Step):
    title = "estimate on the head"

    def run(self, ctx: DemoContext) -> str:
        n_ctx = len(PROMPT.encode()) + 1 + ctx.opts.tokens // 2  # byte vocab: a token per byte
        args = ["estimate", "--profile", str(ctx.prof_path), "--model", str(ctx.model_path)]
        args += ["--ctx", str(n_ctx)]
        for f in ctx.cal_files:
            args += ["--calibration", f]
        if ctx.opts.delay_ms:
            # The probe does not see the proxy's delay; the RPC exchange through it does.
            args += ["--rtt-us", f"{statistics.mean(ctx.rtts):.1f}"]
        est = ctx.json_of(ctx.head, *args)
        ctx.report.predicted = Predicted(
            split_decode_tok_s=est["split"]["decode_tok_s"],
            local_decode_tok_s=est["local"]["decode_tok_s"],
            network_per_token_us=est["network_per_token_us"],
            network_per_layer_us=est["network_per_layer_us"],
            rtt_us=est["link"]["rtt_us"],
            throughput_gbps=est["link"]["throughput_gbps"],
            link_source=est["link"]["source"],
            recommendation=est["recommendation"],
            reason=est["reason"],
            recommended_tensor_split=est["recommended_tensor_split"],
            ctx=n_ctx,
        )
        return (
            f"split {est['split']['decode_tok_s']:.1f} tok/s predicted; "
            f"recommendation: {est['recommendation']}"
        )


class Verify(Step):
    def __init__(self, head: str):
        self.head = head
        self.title = f"verify on {head}: the split against a reference placement"

    def run(self, ctx: DemoContext) -> str:
        log = ctx.log(f"{self.head}-verify.log")
        argv = ["linkctl", "verify", "--profile", str(ctx.head_prof_path)]
        argv += ["--model", str(ctx.model_path), "--json"]
        r = ctx.run_in(self.head, argv, log, timeout=900)
        v = json.loads(r.stdout) if r.stdout.strip().startswith("{") else {}
        ctx.report.verify = VerifyResult(
            exit_code=r.returncode,
            verdict=v.get("verdict"),
            summary=v.get("summary"),
            elapsed_s=v.get("elapsed_s"),
        )
        last = (r.stderr.strip() or "no output").splitlines()[-1]
        if r.returncode != 0:
            raise CheckFailed(
                f"verify on {self.head} exited {r.returncode}: {v.get('summary') or last}",
                f"see {log}",
            )
        return v.get("summary") or last


class ServeHead(BackgroundStep):
    def __init__(self, head: str):
        self.head = head
        self.title = f"serve on {head}: llama-server --rpc over the link"

    def run(self, ctx: DemoContext) -> None:
        argv = ["linkctl", "serve", "--profile", str(ctx.head_prof_path)]
        argv += ["--model", str(ctx.model_path)]
        self.bg = ctx.start(self.head, "serve", argv)
        ctx.wait_ready(self.head, "head", self.bg, 180)


class Completions(Step):
    def __init__(self, opts: DemoOptions):
        self.title = f"completions: {opts.runs} x {opts.tokens} tokens through llama-server"

    def run(self, ctx: DemoContext) -> str:
        from linkctl.llama.client import LlamaServer

        assert ctx.lab is not None and ctx.report.predicted is not None
        o = ctx.opts
        with netns.inside(ctx.lab.host(ctx.head).netns):
            head = LlamaServer("127.0.0.1", ctx.prof["serve"]["port"])
            runs = head.timed_completions(o.tokens, o.runs, PROMPT)
        tok_s = [r.predicted_per_second for r in runs]
        best = max(tok_s)
        ctx.report.measured = Measured(
            split_decode_tok_s=best,
            median_decode_tok_s=statistics.median(tok_s),
            runs_tok_s=tok_s,
            tokens_generated=int(sum(r.predicted_n for r in runs)),
            prompt_tokens=int(runs[0].prompt_n),
        )
        pred = ctx.report.predicted.split_decode_tok_s
        ctx.report.error_pct = round((pred - best) / best * 100, 1)
        return f"{best:.1f} tok/s (best of {o.runs}; median {statistics.median(tok_s):.1f})"


class StopBackground(Step):
    """Every background process, newest first, before the hosts' teardown."""

    silent = True

    def run(self, ctx: DemoContext) -> None:
        ctx.stop_background()
        ctx.background.clear()


def steps(ctx: DemoContext) -> Iterator[Step]:
    """The demo, in order. A generator: the steps after the lab is up are made once
    it exists (their titles name its hosts and addresses)."""
    o = ctx.opts
    yield LabUp(len(ctx.profile.hosts))
    yield WriteProfiles()
    assert ctx.lab is not None
    head, rpc_hosts = ctx.head, ctx.rpc_hosts
    mtu = ctx.prof["link"]["mtu"]
    for h in ctx.lab.hosts:
        yield Linkctl(f"setup on {h.name}: {h.interface} {h.address}, MTU {mtu}", h.name, "setup")
    if ctx.rate_bps:
        yield Shape(ctx.rate_bps)
    yield from (Responder(h) for h in rpc_hosts)
    yield from (Probe(head, h["name"]) for h in rpc_hosts)
    yield TinyModel()
    yield from (Calibrate(h["name"], rpc=True) for h in rpc_hosts)
    yield Calibrate(head, rpc=False)
    yield from (ServeRpc(h) for h in rpc_hosts)
    if o.delay_ms:
        yield from (DelayProxy(h, o.delay_ms) for h in rpc_hosts)
    yield Doctor(head)
    for h in (x for x in ctx.head_prof["hosts"] if x["role"] == "rpc"):
        yield RpcRoundTrip(head, h["address"].split("/")[0], h["rpc"]["port"])
    yield EstimateOnHead()
    yield Verify(head)
    yield ServeHead(head)
    yield Completions(o)
    yield StopBackground()
    for h in ctx.lab.hosts:
        yield Linkctl(f"teardown on {h.name}", h.name, "teardown")
