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

from linkctl import lab as labmod
from linkctl.errors import CheckFailed, InputError, LinkctlError
from linkctl.paths import state_dir
from linkctl.profile import Profile
from linkctl.runner import Result, Runner, default_runner

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

    def tail(self, n: int = 3) -> str:
        try:
            lines = self.log.read_text(errors="replace").strip().splitlines()
        except OSError:
            return ""
        return " | ".join(lines[-n:])

    def stop(self, timeout: float = 15) -> None:
        """SIGTERM (linkctl's supervisors forward it to llama.cpp), then SIGKILL the group."""
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
class Demo:
    profile: Profile
    opts: DemoOptions
    say: Callable[[str], None] = lambda _m: None
    runner: Runner = field(default_factory=default_runner)
    lab: labmod.Lab | None = None
    background: list[Background] = field(default_factory=list)
    steps: list[dict[str, Any]] = field(default_factory=list)
    report: dict[str, Any] = field(default_factory=dict)

    # ---- plumbing -----------------------------------------------------------------

    @property
    def out_dir(self) -> Path:
        """Report and logs: in the state directory, outside the lab (which is removed)."""
        return state_dir() / "demo" / self.opts.name

    @contextlib.contextmanager
    def step(self, title: str) -> Iterator[dict[str, Any]]:
        info: dict[str, Any] = {"step": title}
        self.say(f"[{len(self.steps) + 1:>2}] {title} ...")
        t0 = time.monotonic()
        yield info
        info["seconds"] = round(time.monotonic() - t0, 2)
        self.steps.append(info)
        self.say(f"     {info.get('result', 'done')} ({info['seconds']:.1f} s)")

    def _argv(self, host: str, argv: list[str]) -> tuple[list[str], dict[str, str]]:
        assert self.lab is not None
        argv, env = labmod.exec_argv(self.lab, host, argv)
        # Caches the children write under $HOME (scapy's tables, rpc-server's tensor
        # cache) stay in the lab, which is removed at the end.
        home = self.lab.host_state_dir(host) / "home"
        env.update(HOME=str(home), XDG_CACHE_HOME=str(home / ".cache"))
        env.update(XDG_CONFIG_HOME=str(home / ".config"))
        return argv, env

    def linkctl(self, host: str, *args: str, timeout: float = 180) -> Result:
        """Run `linkctl ARGS` inside ``host``'s namespace; a failure stops the demo."""
        argv, env = self._argv(host, ["linkctl", *args])
        r = self.runner.run(argv, timeout=timeout, check=False, env=env)
        log = self.out_dir / "logs" / f"{host}-{args[0]}.log"
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
        full, env = self._argv(host, argv)
        log = self.out_dir / "logs" / f"{host}-{what}.log"
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
            if bg.proc.poll() is not None:
                raise CheckFailed(
                    f"{bg.what} exited {bg.proc.returncode}: {bg.tail()}", f"see {bg.log}"
                )
            with labmod.inside(self.lab.host(host).netns), socket.socket() as s:
                s.settimeout(0.5)
                if s.connect_ex((addr, port)) == 0:
                    return
            time.sleep(0.1)
        raise CheckFailed(
            f"{bg.what}: {addr}:{port} not listening within {timeout:g} s", f"see {bg.log}"
        )

    def wait_ready(self, host: str, role: str, bg: Background, timeout: float) -> dict:
        assert self.lab is not None
        path = self.lab.host_state_dir(host) / "serve" / f"{role}.json"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if bg.proc.poll() is not None:
                raise CheckFailed(
                    f"{bg.what} exited {bg.proc.returncode}: {bg.tail()}", f"see {bg.log}"
                )
            with contextlib.suppress(OSError, ValueError):
                st = json.loads(path.read_text())
                if st.get("state") == "ready":
                    return st
            time.sleep(0.2)
        raise CheckFailed(f"{bg.what} not ready within {timeout:g} s: {bg.tail()}", f"see {bg.log}")

    # ---- the run --------------------------------------------------------------------

    def run(self) -> dict[str, Any]:
        """Run every step; always clean up. Returns the report (also saved)."""
        rate_bps = self.opts.check()
        self.out_dir.joinpath("logs").mkdir(parents=True, exist_ok=True)
        t0 = time.monotonic()
        old_term = signal.signal(signal.SIGTERM, _raise_interrupt)
        outcome = "interrupted"
        try:
            self._steps(rate_bps)
            outcome = "ok"
        except LinkctlError as e:
            outcome = f"failed: {e.line()}"
            raise
        finally:
            # A second Ctrl-C must not cut the cleanup short and leave namespaces behind.
            old_int = signal.signal(signal.SIGINT, signal.SIG_IGN)
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            try:
                self.cleanup()
            finally:
                signal.signal(signal.SIGINT, old_int)
                signal.signal(signal.SIGTERM, old_term)
            self.report.update(
                outcome=outcome, total_s=round(time.monotonic() - t0, 1), steps=self.steps
            )
            self.out_dir.mkdir(parents=True, exist_ok=True)
            (self.out_dir / "report.json").write_text(json.dumps(self.report, indent=2) + "\n")
        return self.report

    def _steps(self, rate_bps: int | None) -> None:
        o = self.opts
        with self.step(f"lab up: namespaces for {len(self.profile.hosts)} hosts") as s:
            self.lab = labmod.up(self.profile, o.name)
            lab = self.lab
            s["result"] = ", ".join(f"{h.name} {h.address}" for h in lab.hosts)
        root = Path(lab.root)
        model_path = root / "tiny.gguf"
        prof_path, head_prof_path = self._write_profiles(root, model_path, rate_bps)
        prof = tomllib.loads(prof_path.read_text())
        head = next(h["name"] for h in prof["hosts"] if h["role"] == "head")
        rpc_hosts = [h for h in prof["hosts"] if h["role"] == "rpc"]
        self.report.update(
            profile=self.profile.name,
            lab={"name": lab.name, "subnet": prof["link"]["subnet"], "profile": str(prof_path)},
            hosts=[
                {"name": h.name, "address": h.address, "interface": h.interface} for h in lab.hosts
            ],
            shaping={"rate_bps": rate_bps, "delay_ms": o.delay_ms},
            probe_limits={k: prof["probe"][k] for k in ("max_rtt_p99_us", "min_throughput_gbps")},
        )
        for h in lab.hosts:
            with self.step(
                f"setup on {h.name}: {h.interface} {h.address}, MTU {prof['link']['mtu']}"
            ):
                self.linkctl(h.name, "setup", "--profile", str(prof_path))
        if rate_bps:
            with self.step(f"shape the link: tbf {rate_bps / 1e9:g} Gbit/s each way"):
                labmod.shape(lab, rate_bps)
        for h in rpc_hosts:
            with self.step(f"responder on {h['name']}"):
                bg = self.start(
                    h["name"], "responder", ["linkctl", "responder", "--profile", str(prof_path)]
                )
                self.wait_port(
                    head, h["address"].split("/")[0], prof["probe"]["responder_port"], bg
                )
        self.report["link"] = []
        for h in rpc_hosts:
            with self.step(f"probe {head} -> {h['name']}") as s:
                r = self._probe(head, h["name"], prof_path)
                self.report["link"].append(r)
                s["result"] = (
                    f"{'PASS' if r['ok'] else 'FAIL'}: RTT p50 {r['rtt_p50_us']:.0f} µs, "
                    f"{r['throughput_gbps']:.1f} Gbit/s, path MTU {r['path_mtu']}"
                )
                if not r["ok"]:
                    raise CheckFailed(
                        f"probe {head} -> {h['name']} failed: {r['failed']}",
                        f"see {self.out_dir / 'logs'}",
                    )
        with self.step("write a tiny random-weight llama GGUF") as s:
            from linkctl.tinymodel import TinySpec, write_tiny_llama

            m = write_tiny_llama(model_path, TinySpec(**MODEL_SPEC))
            self.report["model"] = {k: m[k] for k in ("bytes", "n_layer", "n_embd", "params")}
            s["result"] = f"{m['n_layer']} layers, {m['bytes'] / 1e6:.0f} MB F32"
        cal_files = []
        self.report["calibration"] = {}
        for h in [*rpc_hosts, {"name": head, "role": "head"}]:
            rpc = h["role"] == "rpc"
            with self.step(
                f"calibrate {h['name']}" + (" (behind loopback RPC)" if rpc else "")
            ) as s:
                c = self.json_of(
                    h["name"],
                    "calibrate",
                    "--profile",
                    str(prof_path),
                    "--model",
                    str(model_path),
                    "--threads",
                    str(o.threads),
                    "--tokens",
                    str(CALIBRATE_TOKENS),
                    "--runs",
                    str(CALIBRATE_RUNS),
                    *(["--rpc"] if rpc else []),
                    timeout=600,
                )
                if rpc:
                    cal_files.append(c["saved_to"])
                self.report["calibration"][h["name"]] = {
                    "decode_tok_s": c["decode_tok_s"],
                    "effective_bandwidth_gbs": c["effective_bandwidth_gbs"],
                    "rpc_effective_bandwidth_gbs": c.get("rpc_effective_bandwidth_gbs"),
                }
                s["result"] = (
                    f"{c['decode_tok_s']:.1f} tok/s alone, {c['effective_bandwidth_gbs']:.2f} GB/s"
                )
        for h in rpc_hosts:
            endpoint = f"{h['address'].split('/')[0]}:{h['rpc']['port']}"
            with self.step(f"serve on {h['name']}: rpc-server on {endpoint}"):
                bg = self.start(
                    h["name"], "serve", ["linkctl", "serve", "--profile", str(prof_path)]
                )
                self.wait_ready(h["name"], "rpc", bg, 60)
        if o.delay_ms:
            for h in rpc_hosts:
                ip, port = h["address"].split("/")[0], h["rpc"]["port"]
                with self.step(f"delay proxy on {h['name']}: +{o.delay_ms:g} ms each way"):
                    bg = self.start(
                        h["name"],
                        "delayproxy",
                        [
                            sys.executable,
                            "-m",
                            "linkctl.delayproxy",
                            "--listen",
                            f"{ip}:{port + PROXY_PORT_OFFSET}",
                            "--target",
                            f"{ip}:{port}",
                            "--delay-ms",
                            str(o.delay_ms),
                        ],
                    )
                    self.wait_port(head, ip, port + PROXY_PORT_OFFSET, bg)
        with self.step(f"doctor on {head}") as s:
            argv, env = self._argv(
                head, ["linkctl", "doctor", "--profile", str(prof_path), "--json"]
            )
            r = self.runner.run(argv, timeout=120, check=False, env=env)
            (self.out_dir / "logs" / f"{head}-doctor.log").write_text(r.stdout + r.stderr)
            lines = json.loads(r.stdout) if r.stdout.strip().startswith("[") else []
            counts = {v: sum(ln["verdict"] == v for ln in lines) for v in ("PASS", "WARN", "FAIL")}
            self.report["doctor"] = {"exit_code": r.returncode, **counts}
            s["result"] = ", ".join(f"{n} {v}" for v, n in counts.items())
            if r.returncode != 0:
                failed = "; ".join(
                    f"{ln['check']}: {ln['detail']}" for ln in lines if ln["verdict"] == "FAIL"
                )
                raise CheckFailed(
                    f"doctor on {head} exited {r.returncode}: {failed or r.stderr.strip()}",
                    f"see {self.out_dir / 'logs' / f'{head}-doctor.log'}",
                )
        rtts = []
        head_prof = tomllib.loads(head_prof_path.read_text())
        for h in (x for x in head_prof["hosts"] if x["role"] == "rpc"):
            ip, port = h["address"].split("/")[0], h["rpc"]["port"]
            with self.step(f"RPC round trip {head} -> {ip}:{port}") as s:
                from linkctl.calibrate import rpc_rtt_us

                # Before llama-server connects: rpc-server serves one client at a time.
                with labmod.inside(lab.host(head).netns):
                    rtts.append(rpc_rtt_us(port, RPC_RTT_SAMPLES, host=ip))
                s["result"] = f"p50 {rtts[-1]:.0f} µs over {RPC_RTT_SAMPLES} GET_DEVICE_MEMORY"
        for entry, rtt in zip(self.report["link"], rtts, strict=True):
            entry["rpc_rtt_p50_us"] = round(rtt, 1)
        ctx = len(PROMPT.encode()) + 1 + o.tokens // 2  # byte-level vocab: a token per byte
        with self.step("estimate on the head") as s:
            args = [
                "estimate",
                "--profile",
                str(prof_path),
                "--model",
                str(model_path),
                "--ctx",
                str(ctx),
            ]
            for f in cal_files:
                args += ["--calibration", f]
            if o.delay_ms:
                # The probe does not see the proxy's delay; the RPC exchange through it does.
                args += ["--rtt-us", f"{statistics.mean(rtts):.1f}"]
            est = self.json_of(head, *args)
            self.report["predicted"] = {
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
                "ctx": ctx,
            }
            s["result"] = (
                f"split {est['split']['decode_tok_s']:.1f} tok/s predicted; "
                f"recommendation: {est['recommendation']}"
            )
        with self.step(f"verify on {head}: the split against a reference placement") as s:
            argv, env = self._argv(
                head,
                [
                    "linkctl",
                    "verify",
                    "--profile",
                    str(head_prof_path),
                    "--model",
                    str(model_path),
                    "--json",
                ],
            )
            r = self.runner.run(argv, timeout=900, check=False, env=env)
            log = self.out_dir / "logs" / f"{head}-verify.log"
            log.write_text(r.stdout + r.stderr)
            v = json.loads(r.stdout) if r.stdout.strip().startswith("{") else {}
            self.report["verify"] = {
                "exit_code": r.returncode,
                "verdict": v.get("verdict"),
                "summary": v.get("summary"),
                "elapsed_s": v.get("elapsed_s"),
            }
            last = (r.stderr.strip() or "no output").splitlines()[-1]
            s["result"] = v.get("summary") or last
            if r.returncode != 0:
                raise CheckFailed(
                    f"verify on {head} exited {r.returncode}: {v.get('summary') or last}",
                    f"see {log}",
                )
        with self.step(f"serve on {head}: llama-server --rpc over the link"):
            bg = self.start(
                head,
                "serve",
                ["linkctl", "serve", "--profile", str(head_prof_path), "--model", str(model_path)],
            )
            self.wait_ready(head, "head", bg, 180)
        with self.step(f"completions: {o.runs} x {o.tokens} tokens through llama-server") as s:
            from linkctl.calibrate import timed_completions

            with labmod.inside(lab.host(head).netns):
                runs = timed_completions(prof["serve"]["port"], o.tokens, o.runs, PROMPT)
            tok_s = [r["predicted_per_second"] for r in runs]
            best = max(tok_s)
            self.report["measured"] = {
                "split_decode_tok_s": best,
                "median_decode_tok_s": statistics.median(tok_s),
                "runs_tok_s": tok_s,
                "tokens_generated": int(sum(r["predicted_n"] for r in runs)),
                "prompt_tokens": int(runs[0]["prompt_n"]),
            }
            pred = self.report["predicted"]["split_decode_tok_s"]
            self.report["error_pct"] = round((pred - best) / best * 100, 1)
            s["result"] = (
                f"{best:.1f} tok/s (best of {o.runs}; median {statistics.median(tok_s):.1f})"
            )
        for bg in reversed(self.background):
            bg.stop()
        self.background.clear()
        for h in lab.hosts:
            with self.step(f"teardown on {h.name}"):
                self.linkctl(h.name, "teardown", "--profile", str(prof_path))

    def _write_profiles(self, root: Path, model: Path, rate_bps: int | None) -> tuple[Path, Path]:
        """The lab profile with the demo's model, threads and context; and the head's
        copy, whose rpc ports point at the delay proxies when there is a delay."""
        import tomli_w

        assert self.lab is not None
        data = tomllib.loads(Path(self.lab.profile_path).read_text())
        t = self.opts.threads
        data["serve"] |= {"model": str(model), "ctx": MODEL_SPEC["n_ctx"], "threads": t}
        for h in data["hosts"]:
            h.setdefault("rpc", {})["threads"] = t
        if rate_bps:
            # The shaped link is slow on purpose: hold it to 80% of the rate set.
            data["probe"]["min_throughput_gbps"] = round(0.8 * rate_bps / 1e9, 3)
        prof = root / "demo.toml"
        prof.write_text(tomli_w.dumps(data))
        if not self.opts.delay_ms:
            return prof, prof
        for h in data["hosts"]:
            if h["role"] == "rpc":
                h["rpc"]["port"] += PROXY_PORT_OFFSET
        head = root / "demo-head.toml"
        head.write_text(tomli_w.dumps(data))
        return prof, head

    def _probe(self, head: str, peer: str, prof_path: Path) -> dict[str, Any]:
        argv, env = self._argv(
            head, ["linkctl", "probe", "--profile", str(prof_path), "--peer", peer, "--json"]
        )
        log = self.out_dir / "logs" / f"{head}-probe-{peer}.log"
        r = self.runner.run(argv, timeout=180, check=False, env=env)
        log.write_text(r.stdout + r.stderr)
        if r.returncode not in (0, 1, 2) and not (r.stdout + r.stderr).strip():
            # A probe that died silently (seen twice under CI load on 2 cores, cause not
            # found: exit status now logged) is run once more, and the demo says so.
            self.say(f"     probe exited {r.returncode} with no output; running it once more")
            r = self.runner.run(argv, timeout=180, check=False, env=env)
            log.write_text(log.read_text() + r.stdout + r.stderr)
        if r.returncode == 2 or not r.stdout.strip().startswith("{"):
            last = (r.stderr.strip() or f"no output, exit {r.returncode}").splitlines()[-1]
            raise CheckFailed(f"`linkctl probe --peer {peer}` could not run: {last} (log: {log})")
        rep = json.loads(r.stdout)
        tcp1 = rep["latency"]["tcp"]["1"]
        thr = rep["throughput"]
        return {
            "peer": peer,
            "ok": rep["ok"],
            "failed": ", ".join(c["name"] for c in rep["checks"] if c["verdict"] == "FAIL"),
            "path_mtu": rep["mtu"].get("path_mtu_at_least"),
            "rtt_p50_us": tcp1["p50_us"],
            "rtt_p99_us": tcp1["p99_us"],
            "rtt_32k_p50_us": rep["latency"]["tcp"]["32768"]["p50_us"],
            "throughput_gbps": thr["fwd_p1"]["gbps"],
            "throughput_rev_gbps": thr["rev_p1"]["gbps"],
            "throughput_p4_gbps": thr["fwd_p4"]["gbps"],
            "retransmits": sum(v.get("retransmits", 0) for v in thr.values()),
            "verdicts": {c["name"]: c["verdict"] for c in rep["checks"]},
        }

    def cleanup(self) -> None:
        """Stop every process the demo started, remove the lab, and check nothing is left."""
        for bg in reversed(self.background):
            bg.stop()
        if self.lab is not None:
            self.say("cleaning up: lab down")
            labmod.down(self.lab.name)
        self.report["left_behind"] = self.left_behind()

    def left_behind(self) -> list[str]:
        from pyroute2 import netns

        if self.lab is None:  # never made a lab (refused, or stopped before): nothing of ours
            return []
        left = [f"netns {ns}" for ns in netns.listnetns() if ns.startswith(f"lk-{self.opts.name}-")]
        left += [
            f"pid {bg.proc.pid} ({bg.what})" for bg in self.background if bg.proc.poll() is None
        ]
        if Path(self.lab.root).exists():
            left.append(self.lab.root)
        return left


def _raise_interrupt(_sig: int, _frame: Any) -> None:
    raise KeyboardInterrupt
