"""What the demo's steps share: the options, the running lab and its processes, and
the report as it fills in.

The report is typed (DemoReport); its JSON (report.json, `lab demo --json`) holds
the sections the steps that ran filled in, under the keys the demo has always
written.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from linkctl.core.checks import Verdict
from linkctl.core.errors import CheckFailed, InputError
from linkctl.core.profile import Profile
from linkctl.core.records import ServeStatus, load_status, status_path
from linkctl.core.runner import Result, Runner
from linkctl.gguf.tiny import TinySpec
from linkctl.lab import netns

# Big enough that a token is memory-bound work (110 MB of F32 weights read per
# token), small enough to write in a second and decode at tens of tok/s on one core.
MODEL_SPEC = TinySpec(n_layer=8, n_embd=512, n_head=8, n_ff=1536, n_ctx=1024)
PROMPT = "The cable between two machines carries the activations of every token. "


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
        ctx_left = MODEL_SPEC.n_ctx - len(PROMPT.encode()) - 8
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
        return netns.parse_rate(self.rate) if self.rate else None


# ---- the report ---------------------------------------------------------------------


class _Part(BaseModel):
    model_config = ConfigDict(extra="forbid")


class LabInfo(_Part):
    name: str
    subnet: str
    profile: str  # the lab profile the demo wrote


class HostInfo(_Part):
    name: str
    address: str
    interface: str


class Shaping(_Part):
    rate_bps: int | None
    delay_ms: float


class ProbeLimits(_Part):
    max_rtt_p99_us: float
    min_throughput_gbps: float


class LinkResult(_Part):
    """The probe from the head to one rpc host, and the RPC round trip over that link."""

    peer: str
    ok: bool
    failed: str  # the failed checks with their figures ("" when none failed)
    first_run: str | None  # why the first run did not pass (None: it did)
    path_mtu: int | None
    rtt_p50_us: float | None
    rtt_p99_us: float | None
    rtt_32k_p50_us: float | None
    throughput_gbps: float | None
    throughput_rev_gbps: float | None
    throughput_p4_gbps: float | None
    retransmits: int
    verdicts: dict[str, Verdict]  # by check name
    rpc_rtt_p50_us: float | None = None  # set by the RPC round trip step


class ModelInfo(_Part):
    bytes: int
    n_layer: int
    n_embd: int
    params: int


class Calibration(_Part):
    decode_tok_s: float
    effective_bandwidth_gbs: float
    rpc_effective_bandwidth_gbs: float | None


class DoctorSummary(_Part):
    """Doctor's exit code and how many checks got each verdict (keys PASS, WARN, FAIL)."""

    exit_code: int
    passed: int = Field(serialization_alias=Verdict.PASS.value)
    warned: int = Field(serialization_alias=Verdict.WARN.value)
    failed: int = Field(serialization_alias=Verdict.FAIL.value)


class Predicted(_Part):
    split_decode_tok_s: float
    local_decode_tok_s: float
    network_per_token_us: float
    network_per_layer_us: float
    rtt_us: float
    throughput_gbps: float
    link_source: str
    recommendation: str
    reason: str
    recommended_tensor_split: str | None
    ctx: int


class VerifyResult(_Part):
    exit_code: int
    verdict: str | None
    summary: str | None
    elapsed_s: float | None


class Measured(_Part):
    split_decode_tok_s: float
    median_decode_tok_s: float
    runs_tok_s: list[float]
    tokens_generated: int
    prompt_tokens: int


class StepInfo(_Part):
    step: str  # its title
    result: str | None = None  # what its progress line said (left out when nothing)
    seconds: float


class DemoReport(_Part):
    """Every section is filled in by the step that measured it; a run that stopped
    midway has the sections of the steps that finished (and the runner's last four)."""

    profile: str | None = None
    lab: LabInfo | None = None
    hosts: list[HostInfo] | None = None
    shaping: Shaping | None = None
    probe_limits: ProbeLimits | None = None
    link: list[LinkResult] | None = None  # by rpc host, in profile order
    model: ModelInfo | None = None
    calibration: dict[str, Calibration] | None = None  # by host
    doctor: DoctorSummary | None = None
    predicted: Predicted | None = None
    verify: VerifyResult | None = None
    measured: Measured | None = None
    error_pct: float | None = None  # predicted vs measured decode speed
    left_behind: list[str] | None = None
    outcome: str | None = None  # ok, interrupted, failed: REASON
    total_s: float | None = None
    steps: list[StepInfo] | None = None

    def as_json(self) -> dict[str, Any]:
        """The report's JSON: only what was set (a section the demo never reached is
        left out, not null), under the keys the demo writes."""
        return self.model_dump(mode="json", exclude_unset=True, by_alias=True)


# ---- the context ------------------------------------------------------------------


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
    lab: netns.Lab | None = None
    prof_path: Path = Path()  # the lab profile with the demo's model, threads and ctx
    head_prof_path: Path = Path()  # the head's copy (rpc ports at the delay proxies)
    model_path: Path = Path()
    prof: dict[str, Any] = field(default_factory=dict)  # prof_path, parsed
    head_prof: dict[str, Any] = field(default_factory=dict)  # head_prof_path, parsed
    background: list[Background] = field(default_factory=list)
    cal_files: list[str] = field(default_factory=list)  # the rpc hosts' calibrations
    rtts: list[float] = field(default_factory=list)  # RPC round trip p50 per rpc host
    report: DemoReport = field(default_factory=DemoReport)

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
        argv, env = netns.exec_argv(self.lab, host, argv)
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

    def wait_port(
        self, host: str, addr: str, port: int, bg: Background, timeout: float = 30.0
    ) -> None:
        assert self.lab is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            _check_alive(bg)
            with netns.inside(self.lab.host(host).netns), socket.socket() as s:
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
