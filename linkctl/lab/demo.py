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

Shape: each stage is a Step (a title, run(ctx), cleanup(ctx)) over one typed
DemoContext; `steps()` yields them in order (lazily: later titles name the lab's
hosts), and Demo runs them, prints progress, and on any exit undoes every step
that started, in reverse.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import time
import tomllib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from linkctl.core.errors import CheckFailed, InputError, LinkctlError
from linkctl.core.paths import state_dir
from linkctl.core.profile import Profile
from linkctl.core.records import ProbeRecord, ServeStatus, load_status, parse, status_path
from linkctl.core.runner import Result, Runner, default_runner
from linkctl.lab import netns as labmod

# Big enough that a token is memory-bound work (110 MB of F32 weights read per
# token), small enough to write in a second and decode at tens of tok/s on one core.
MODEL_SPEC = {"n_layer": 8, "n_embd": 512, "n_head": 8, "n_ff": 1536, "n_ctx": 1024}
PROMPT = "The cable between two machines carries the activations of every token. "
CALIBRATE_TOKENS, CALIBRATE_RUNS = 64, 5
PROXY_PORT_OFFSET = 1  # the delay proxy listens on the rpc port + 1, same address
RPC_RTT_SAMPLES = 200


@dataclass
class DemoOptions:
    name: str = "demo"
    delay_ms: float = 0.0
    rate: str | None = None
    tokens: int = 64
    runs: int = 3
    threads: int = 1

    def check(self) -> int | None:
        """Validate before anything is created; returns the rate in bits/s (or None)."""
        if not 0 <= self.delay_ms <= 100:
            raise InputError(
                f"--delay-ms {self.delay_ms:g} is outside 0..100", "e.g. --delay-ms 0.5"
            )
        ctx_left = MODEL_SPEC["n_ctx"] - len(PROMPT.encode()) - 8
        if not 8 <= self.tokens <= ctx_left:
            raise InputError(
                f"--tokens {self.tokens} is outside 8..{ctx_left} (the demo model's context)",
                "e.g. --tokens 64",
            )
        if not 1 <= self.runs <= 20:
            raise InputError(f"--runs {self.runs} is outside 1..20", "e.g. --runs 3")
        ncpu = os.cpu_count() or 1
        if not 1 <= self.threads <= ncpu:
            raise InputError(
                f"--threads {self.threads} is outside 1..{ncpu} (this machine's CPUs)",
                "e.g. --threads 1",
            )
        return labmod.parse_rate(self.rate) if self.rate else None


class Background:
    """A `linkctl` (or proxy) process inside a namespace, until the demo stops it."""

    def __init__(self, what: str, proc: subprocess.Popen, log: Path):
        self.what, self.proc, self.log = what, proc, log
        self.stopped = False

    def tail(self, n: int = 3) -> str:
        try:
            lines = self.log.read_text(errors="replace").strip().splitlines()
        except OSError:
            return ""
        return " | ".join(lines[-n:])

    def stop(self, timeout: float = 15) -> None:
        """SIGTERM (linkctl's supervisors forward it to llama.cpp), then SIGKILL the group.
        Once only: after that the pid (the group's id) may belong to someone else."""
        if self.stopped:
            return
        self.stopped = True
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(5)


@dataclass
class DemoContext:
    """What the steps share: the options, the lab, its paths and the results so far."""

    profile: Profile
    opts: DemoOptions
    rate_bps: int | None
    out_dir: Path  # report and logs: in the state directory, outside the lab
    runner: Runner
    say: Callable[[str], None]
    lab: labmod.Lab | None = None
    prof_path: Path = Path()  # the lab profile with the demo's model, threads and ctx
    head_prof_path: Path = Path()  # the head's copy (rpc ports at the delay proxies)
    model_path: Path = Path()
    prof: dict[str, Any] = field(default_factory=dict)  # prof_path, parsed
    background: list[Background] = field(default_factory=list)
    cal_files: list[str] = field(default_factory=list)  # the rpc hosts' calibrations
    rtts: list[float] = field(default_factory=list)  # RPC round trip p50 per rpc host
    report: dict[str, Any] = field(default_factory=dict)

    @property
    def head(self) -> str:
        return next(h["name"] for h in self.prof["hosts"] if h["role"] == "head")

    @property
    def rpc_hosts(self) -> list[dict[str, Any]]:
        return [h for h in self.prof["hosts"] if h["role"] == "rpc"]

    def log(self, name: str) -> Path:
        return self.out_dir / "logs" / name

    def argv(self, host: str, argv: list[str]) -> tuple[list[str], dict[str, str]]:
        assert self.lab is not None
        argv, env = labmod.exec_argv(self.lab, host, argv)
        # Caches the children write under $HOME (scapy's tables, rpc-server's tensor
        # cache) stay in the lab, which is removed at the end.
        home = self.lab.host_state_dir(host) / "home"
        env.update(HOME=str(home), XDG_CACHE_HOME=str(home / ".cache"))
        env.update(XDG_CONFIG_HOME=str(home / ".config"))
        return argv, env

    def run_in(self, host: str, argv: list[str], log: Path, timeout: float) -> Result:
        """Run ``argv`` inside ``host``'s namespace, output to ``log``; never raises on exit."""
        full, env = self.argv(host, argv)
        r = self.runner.run(full, timeout=timeout, check=False, env=env)
        log.write_text(r.stdout + r.stderr)
        return r

    def linkctl(self, host: str, *args: str, timeout: float = 180) -> Result:
        """Run `linkctl ARGS` inside ``host``'s namespace; a failure stops the demo."""
        argv, env = self.argv(host, ["linkctl", *args])
        r = self.runner.run(argv, timeout=timeout, check=False, env=env)
        log = self.log(f"{host}-{args[0]}.log")
        log.write_text(f"$ linkctl {' '.join(args)}\n{r.stdout}\n{r.stderr}")
        if r.returncode != 0:
            last = (r.stderr.strip() or r.stdout.strip() or "no output").splitlines()[-1]
            raise CheckFailed(
                f"`linkctl {args[0]}` on {host} exited {r.returncode}: {last}", f"see {log}"
            )
        return r

    def json_of(self, host: str, *args: str, timeout: float = 180) -> dict[str, Any]:
        return json.loads(self.linkctl(host, *args, "--json", timeout=timeout).stdout)

    def start(self, host: str, what: str, argv: list[str]) -> Background:
        full, env = self.argv(host, argv)
        log = self.log(f"{host}-{what}.log")
        with log.open("w") as f:
            proc = self.runner.spawn(
                full, stdout=f, stderr=subprocess.STDOUT, env=env, new_session=True
            )
        bg = Background(f"{what} on {host}", proc, log)
        self.background.append(bg)
        return bg

    def wait_port(self, host: str, addr: str, port: int, bg: Background, timeout=30.0) -> None:
        import socket

        assert self.lab is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            _check_alive(bg)
            with labmod.inside(self.lab.host(host).netns), socket.socket() as s:
                s.settimeout(0.5)
                if s.connect_ex((addr, port)) == 0:
                    return
            time.sleep(0.1)
        raise CheckFailed(
            f"{bg.what}: {addr}:{port} not listening within {timeout:g} s", f"see {bg.log}"
        )

    def wait_ready(self, host: str, role: str, bg: Background, timeout: float) -> ServeStatus:
        assert self.lab is not None
        path = status_path(role, root=self.lab.host_state_dir(host))
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            _check_alive(bg)
            # Not there yet, or caught mid-write by a reader of the old file: poll again.
            with contextlib.suppress(InputError):
                st = load_status(path)
                if st.state == "ready":
                    return st
            time.sleep(0.2)
        raise CheckFailed(f"{bg.what} not ready within {timeout:g} s: {bg.tail()}", f"see {bg.log}")

    def stop_background(self) -> None:
        for bg in reversed(self.background):
            bg.stop()


def _check_alive(bg: Background) -> None:
    if bg.proc.poll() is not None:
        raise CheckFailed(f"{bg.what} exited {bg.proc.returncode}: {bg.tail()}", f"see {bg.log}")


# ---- the steps ----------------------------------------------------------------------


class Step:
    """One stage of the demo. ``run`` may set the progress line's result; ``cleanup``
    undoes what ``run`` left running (called, in reverse order, for every step that
    started, whether it finished or not). A silent step prints nothing and is not in
    the report's step list."""

    title: str = ""
    silent: bool = False

    def run(self, ctx: DemoContext) -> str | None:
        raise NotImplementedError

    def cleanup(self, ctx: DemoContext) -> None:
        return None


class LabUp(Step):
    def __init__(self, n_hosts: int):
        self.title = f"lab up: namespaces for {n_hosts} hosts"

    def run(self, ctx: DemoContext) -> str:
        ctx.lab = lab = labmod.up(ctx.profile, ctx.opts.name)
        return ", ".join(f"{h.name} {h.address}" for h in lab.hosts)

    def cleanup(self, ctx: DemoContext) -> None:
        if ctx.lab is not None:
            ctx.say("cleaning up: lab down")
            labmod.down(ctx.lab.name)


class WriteProfiles(Step):
    """The lab profile with the demo's model, threads and context; and the head's
    copy, whose rpc ports point at the delay proxies when there is a delay."""

    silent = True

    def run(self, ctx: DemoContext) -> None:
        import tomli_w

        assert ctx.lab is not None
        root = Path(ctx.lab.root)
        ctx.model_path = root / "tiny.gguf"
        data = tomllib.loads(Path(ctx.lab.profile_path).read_text())
        t = ctx.opts.threads
        data["serve"] |= {"model": str(ctx.model_path), "ctx": MODEL_SPEC["n_ctx"], "threads": t}
        for h in data["hosts"]:
            h.setdefault("rpc", {})["threads"] = t
        if ctx.rate_bps:
            # The shaped link is slow on purpose: hold it to 80% of the rate set.
            data["probe"]["min_throughput_gbps"] = round(0.8 * ctx.rate_bps / 1e9, 3)
        ctx.prof_path = ctx.head_prof_path = root / "demo.toml"
        ctx.prof_path.write_text(tomli_w.dumps(data))
        ctx.prof = tomllib.loads(ctx.prof_path.read_text())
        if ctx.opts.delay_ms:
            for h in data["hosts"]:
                if h["role"] == "rpc":
                    h["rpc"]["port"] += PROXY_PORT_OFFSET
            ctx.head_prof_path = root / "demo-head.toml"
            ctx.head_prof_path.write_text(tomli_w.dumps(data))
        prof, lab = ctx.prof, ctx.lab
        ctx.report.update(
            profile=ctx.profile.name,
            lab={"name": lab.name, "subnet": prof["link"]["subnet"], "profile": str(ctx.prof_path)},
            hosts=[
                {"name": h.name, "address": h.address, "interface": h.interface} for h in lab.hosts
            ],
            shaping={"rate_bps": ctx.rate_bps, "delay_ms": ctx.opts.delay_ms},
            probe_limits={k: prof["probe"][k] for k in ("max_rtt_p99_us", "min_throughput_gbps")},
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
        labmod.shape(ctx.lab, self.rate_bps)


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


class Probe(Step):
    def __init__(self, head: str, peer: str):
        self.head, self.peer = head, peer
        self.title = f"probe {head} -> {peer}"

    def run(self, ctx: DemoContext) -> str:
        r = self.probe(ctx)
        ctx.report.setdefault("link", []).append(r)
        if not r["ok"]:
            raise CheckFailed(
                f"probe {self.head} -> {self.peer} failed: {r['failed']}",
                f"see {ctx.out_dir / 'logs'}",
            )
        return (
            f"PASS: RTT p50 {r['rtt_p50_us']:.0f} µs, "
            f"{r['throughput_gbps']:.1f} Gbit/s, path MTU {r['path_mtu']}"
        )

    def attempt(self, ctx: DemoContext, log: Path) -> tuple[Result, str | None]:
        """One `linkctl probe --json`; returns its result and why it did not pass (None:
        it passed): the report's stop reason, its failed checks with their figures, or
        the process's own last words."""
        argv = ["linkctl", "probe", "--profile", str(ctx.prof_path), "--peer", self.peer]
        r = ctx.run_in(self.head, [*argv, "--json"], log, timeout=180)
        out = r.stdout.strip()
        rec: dict[str, Any] = {}
        if out.startswith("{"):
            with contextlib.suppress(ValueError):
                rec = json.loads(out)
        if r.returncode == 0 and rec:
            return r, None
        if rec.get("stopped"):
            return r, f"could not run: {rec['stopped']}"
        failed = _failed_text(rec.get("checks", []))
        if failed:
            return r, f"failed: {failed}"
        last = (r.stderr.strip() or "no output").splitlines()[-1]
        return r, f"could not run: {last} (exit {r.returncode})"

    def probe(self, ctx: DemoContext) -> dict[str, Any]:
        """Probe; once more if the first run did not pass.

        The lab's hosts share this machine's CPUs with everything else. Under CI load a
        probe has died with no output, stopped (exit 2), and missed the lab's 5 ms tail
        on 1000 round trips; a second run tells a load spike from a broken link. The
        first run's outcome is said, kept in the log and in the report."""
        peer = self.peer
        log = ctx.log(f"{self.head}-probe-{peer}.log")
        r, first = self.attempt(ctx, log)
        why = first
        if first is not None:
            ctx.say(f"     first probe {first}; the lab shares its CPU: probing once more")
            text = log.read_text()
            r, why = self.attempt(ctx, log)
            log.write_text(f"{text}\n--- second run ---\n{log.read_text()}")
        if why is not None and why.startswith("could not run"):
            raise CheckFailed(f"`linkctl probe --peer {peer}` {why}", f"see {log}")
        rep = parse(
            ProbeRecord,
            json.loads(r.stdout),
            f"from `linkctl probe --peer {peer} --json`",
            "probe report",
            f"see {log}",
        )
        tcp1 = rep.latency.tcp["1"]
        thr = rep.runs()
        return {
            "peer": peer,
            "ok": rep.ok,
            "failed": _failed_text(rep.checks),
            "first_run": first,  # why the first run did not pass (None: it did)
            "path_mtu": rep.mtu.path_mtu_at_least,
            "rtt_p50_us": tcp1.p50_us,
            "rtt_p99_us": tcp1.p99_us,
            "rtt_32k_p50_us": rep.latency.tcp["32768"].p50_us,
            "throughput_gbps": thr["fwd_p1"].gbps,
            "throughput_rev_gbps": thr["rev_p1"].gbps,
            "throughput_p4_gbps": thr["fwd_p4"].gbps,
            "retransmits": sum(v.retransmits or 0 for v in thr.values()),
            "verdicts": {c["name"]: c["verdict"] for c in rep.checks},
        }


def _failed_text(checks: list[dict[str, Any]]) -> str:
    """'tcp rtt 1 B (7310 vs limit 5000), ...': the failed checks with figure and limit."""
    out = []
    for c in checks:
        if c.get("verdict") != "FAIL":
            continue
        value, limit = c.get("value"), c.get("threshold")
        figures = "" if value is None or limit is None else f" ({value:g} vs limit {limit:g})"
        out.append(f"{c.get('name')}{figures}")
    return ", ".join(out)


class TinyModel(Step):
    title = "write a tiny random-weight llama GGUF"

    def run(self, ctx: DemoContext) -> str:
        from linkctl.gguf.tiny import TinySpec, write_tiny_llama

        m = write_tiny_llama(ctx.model_path, TinySpec(**MODEL_SPEC))
        ctx.report["model"] = {k: m[k] for k in ("bytes", "n_layer", "n_embd", "params")}
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
        ctx.report.setdefault("calibration", {})[self.host] = {
            "decode_tok_s": c["decode_tok_s"],
            "effective_bandwidth_gbs": c["effective_bandwidth_gbs"],
            "rpc_effective_bandwidth_gbs": c.get("rpc_effective_bandwidth_gbs"),
        }
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
        lines = json.loads(r.stdout) if r.stdout.strip().startswith("[") else []
        counts = {v: sum(ln["verdict"] == v for ln in lines) for v in ("PASS", "WARN", "FAIL")}
        ctx.report["doctor"] = {"exit_code": r.returncode, **counts}
        if r.returncode != 0:
            failed = "; ".join(
                f"{ln['check']}: {ln['detail']}" for ln in lines if ln["verdict"] == "FAIL"
            )
            raise CheckFailed(
                f"doctor on {self.head} exited {r.returncode}: {failed or r.stderr.strip()}",
                f"see {log}",
            )
        return ", ".join(f"{n} {v}" for v, n in counts.items())


class RpcRoundTrip(Step):
    def __init__(self, head: str, ip: str, port: int):
        self.head, self.ip, self.port = head, ip, port
        self.title = f"RPC round trip {head} -> {ip}:{port}"

    def run(self, ctx: DemoContext) -> str:
        from linkctl.llama.client import rpc_rtt_us

        assert ctx.lab is not None
        # Before llama-server connects: rpc-server serves one client at a time.
        with labmod.inside(ctx.lab.host(self.head).netns):
            ctx.rtts.append(rpc_rtt_us(self.port, RPC_RTT_SAMPLES, host=self.ip))
        entry = ctx.report["link"][len(ctx.rtts) - 1]
        entry["rpc_rtt_p50_us"] = round(ctx.rtts[-1], 1)
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
        ctx.report["predicted"] = {
            "split_decode_tok_s": est["split"]["decode_tok_s"],
            "local_decode_tok_s": est["local"]["decode_tok_s"],
            "network_per_token_us": est["network_per_token_us"],
            "network_per_layer_us": est["network_per_layer_us"],
            "rtt_us": est["link"]["rtt_us"],
            "throughput_gbps": est["link"]["throughput_gbps"],
            "link_source": est["link"]["source"],
            "recommendation": est["recommendation"],
            "reason": est["reason"],
            "recommended_tensor_split": est["recommended_tensor_split"],
            "ctx": n_ctx,
        }
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
        ctx.report["verify"] = {
            "exit_code": r.returncode,
            "verdict": v.get("verdict"),
            "summary": v.get("summary"),
            "elapsed_s": v.get("elapsed_s"),
        }
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
        from linkctl.llama.client import timed_completions

        assert ctx.lab is not None
        o = ctx.opts
        with labmod.inside(ctx.lab.host(ctx.head).netns):
            runs = timed_completions(ctx.prof["serve"]["port"], o.tokens, o.runs, PROMPT)
        tok_s = [r.predicted_per_second for r in runs]
        best = max(tok_s)
        ctx.report["measured"] = {
            "split_decode_tok_s": best,
            "median_decode_tok_s": statistics.median(tok_s),
            "runs_tok_s": tok_s,
            "tokens_generated": int(sum(r.predicted_n for r in runs)),
            "prompt_tokens": int(runs[0].prompt_n),
        }
        pred = ctx.report["predicted"]["split_decode_tok_s"]
        ctx.report["error_pct"] = round((pred - best) / best * 100, 1)
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
    ctx.report["link"] = []
    yield from (Probe(head, h["name"]) for h in rpc_hosts)
    yield TinyModel()
    ctx.report["calibration"] = {}
    yield from (Calibrate(h["name"], rpc=True) for h in rpc_hosts)
    yield Calibrate(head, rpc=False)
    yield from (ServeRpc(h) for h in rpc_hosts)
    if o.delay_ms:
        yield from (DelayProxy(h, o.delay_ms) for h in rpc_hosts)
    yield Doctor(head)
    head_prof = tomllib.loads(ctx.head_prof_path.read_text())
    for h in (x for x in head_prof["hosts"] if x["role"] == "rpc"):
        yield RpcRoundTrip(head, h["address"].split("/")[0], h["rpc"]["port"])
    yield EstimateOnHead()
    yield Verify(head)
    yield ServeHead(head)
    yield Completions(o)
    yield StopBackground()
    for h in ctx.lab.hosts:
        yield Linkctl(f"teardown on {h.name}", h.name, "teardown")


# ---- the runner ---------------------------------------------------------------------


@dataclass
class Demo:
    profile: Profile
    opts: DemoOptions
    say: Callable[[str], None] = lambda _m: None
    runner: Runner = field(default_factory=default_runner)
    done: list[dict[str, Any]] = field(default_factory=list)  # the report's step list

    @property
    def out_dir(self) -> Path:
        """Report and logs: in the state directory, outside the lab (which is removed)."""
        return state_dir() / "demo" / self.opts.name

    def run(self) -> dict[str, Any]:
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
                ctx.report["left_behind"] = left_behind(ctx)
            finally:
                signal.signal(signal.SIGINT, old_int)
                signal.signal(signal.SIGTERM, old_term)
            ctx.report.update(
                outcome=outcome, total_s=round(time.monotonic() - t0, 1), steps=self.done
            )
            self.out_dir.mkdir(parents=True, exist_ok=True)
            (self.out_dir / "report.json").write_text(json.dumps(ctx.report, indent=2) + "\n")
        return ctx.report

    def _run_step(self, ctx: DemoContext, step: Step) -> None:
        if step.silent:
            step.run(ctx)
            return
        self.say(f"[{len(self.done) + 1:>2}] {step.title} ...")
        t0 = time.monotonic()
        result = step.run(ctx)
        info: dict[str, Any] = {"step": step.title}
        if result is not None:
            info["result"] = result
        info["seconds"] = round(time.monotonic() - t0, 2)
        self.done.append(info)
        self.say(f"     {info.get('result', 'done')} ({info['seconds']:.1f} s)")


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
