"""`linkctl lab demo` end to end: both shipped profiles, real figures, nothing left
behind after a normal run, after Ctrl-C in the middle, and after bad input."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from support.cli import error_lines, need_root_netns
from support.llama_util import need_llama

pytestmark = [pytest.mark.netns, pytest.mark.llama]


class DemoRun:
    """`linkctl lab demo` as a user starts it, with its own state dir, HOME and TMPDIR
    (so "no files outside the state directory" can be checked), watched line by line."""

    def __init__(self, tmp_path: Path, *args: str):
        need_root_netns()
        need_llama()
        self.name = "d" + uuid.uuid4().hex[:6]
        self.state = tmp_path / "state"
        self.home, self.tmp = tmp_path / "home", tmp_path / "tmp"
        for d in (self.home, self.tmp):
            d.mkdir()
        env = dict(os.environ, LINKCTL_STATE_DIR=str(self.state), HOME=str(self.home))
        env["TMPDIR"] = str(self.tmp)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "linkctl", "lab", "demo", "--name", self.name, *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        self.progress: list[str] = []
        self.ns_inodes: dict[str, int] = {}

    def read_until(self, marker: str | None) -> None:
        """Read progress lines up to one containing ``marker`` (None: to the end), noting
        the inode of every lab namespace while it exists."""
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.progress.append(line.rstrip())
            for ns in Path("/run/netns").glob(f"lk-{self.name}-*"):
                # The demo's own cleanup may remove it between the glob and the stat.
                with contextlib.suppress(FileNotFoundError):
                    self.ns_inodes.setdefault(ns.name, ns.stat().st_ino)
            if marker and marker in line:
                return
        if marker:
            raise AssertionError(f"{marker!r} never printed:\n" + "\n".join(self.progress))

    def finish(self, timeout: float = 600) -> tuple[int, str]:
        self.read_until(None)
        out = self.proc.stdout.read() if self.proc.stdout else ""
        return self.proc.wait(timeout), out

    def assert_nothing_left(self) -> None:
        assert self.ns_inodes, "the lab's namespaces were never seen"
        left_ns = [n.name for n in Path("/run/netns").glob(f"lk-{self.name}-*")]
        assert not left_ns, left_ns
        # A process still in one of the lab's namespaces keeps that namespace alive.
        inodes = set(self.ns_inodes.values())
        stray = []
        for p in Path("/proc").iterdir():
            if p.name.isdigit():
                try:
                    if os.stat(p / "ns" / "net").st_ino in inodes:
                        stray.append((p.name, (p / "cmdline").read_bytes()[:120]))
                except OSError:
                    continue
        assert not stray, stray
        assert not (self.state / "lab" / self.name).exists()
        # Nothing written outside the state directory: HOME and TMPDIR stayed empty.
        assert list(self.home.iterdir()) == [] and list(self.tmp.iterdir()) == [], list(
            self.home.rglob("*")
        ) + list(self.tmp.rglob("*"))


def check_report(r: dict, rpc_hosts: list[str]) -> None:
    assert r["outcome"] == "ok" and r["left_behind"] == []
    assert [lk["peer"] for lk in r["link"]] == rpc_hosts
    for lk in r["link"]:
        assert lk["ok"] and lk["path_mtu"] == 9000
        assert lk["rtt_p50_us"] > 0 and lk["rpc_rtt_p50_us"] > 0 and lk["throughput_gbps"] > 0
    me, p = r["measured"], r["predicted"]
    assert me["tokens_generated"] > 0 and me["split_decode_tok_s"] > 0
    assert len(me["runs_tok_s"]) == 3 and all(x > 0 for x in me["runs_tok_s"])
    assert p["split_decode_tok_s"] > 0 and p["network_per_token_us"] > 0
    assert p["recommendation"]
    err = (p["split_decode_tok_s"] - me["split_decode_tok_s"]) / me["split_decode_tok_s"] * 100
    assert r["error_pct"] == pytest.approx(err, abs=0.1)
    for host in [*rpc_hosts, "mac"]:
        assert r["calibration"][host]["decode_tok_s"] > 0


def test_demo_two_hosts(tmp_path):
    run = DemoRun(tmp_path, "--json")
    code, out = run.finish()
    assert code == 0, "\n".join(run.progress[-20:])
    report = json.loads(out)
    check_report(report, ["dgx"])
    assert report["shaping"] == {"rate_bps": None, "delay_ms": 0.0}
    # The same report is kept in the state directory, beside the step logs.
    saved = json.loads((run.state / "demo" / run.name / "report.json").read_text())
    assert saved["measured"] == report["measured"]
    assert any("teardown on mac" in line for line in run.progress)
    run.assert_nothing_left()


def test_demo_three_hosts_shaped_and_delayed(tmp_path):
    """dgx1 + dgx2 + mac on a bridge; tbf at 2 Gbit/s; 0.5 ms each way on the RPC path."""
    run = DemoRun(
        tmp_path, "--profile", "dgx2-mac-switch", "--rate", "2gbit", "--delay-ms", "0.5", "--json"
    )
    code, out = run.finish()
    assert code == 0, "\n".join(run.progress[-20:])
    r = json.loads(out)
    check_report(r, ["dgx1", "dgx2"])
    for lk in r["link"]:
        # tbf holds each direction to 2 Gbit/s: measured below it, and not far below.
        assert 1.0 < lk["throughput_gbps"] <= 2.1, lk
        # Two proxy delays of 0.5 ms per RPC round trip.
        assert lk["rpc_rtt_p50_us"] >= 1000, lk
    # The estimate used the round trip through the proxies, not the probe's (undelayed) one.
    mean_rpc = sum(lk["rpc_rtt_p50_us"] for lk in r["link"]) / 2
    assert r["predicted"]["rtt_us"] == pytest.approx(mean_rpc, abs=0.2)
    run.assert_nothing_left()


def test_demo_ctrl_c_midway_leaves_nothing(tmp_path):
    run = DemoRun(tmp_path)
    # rpc-server, the responder and the lab are all up once the head's serve starts.
    run.read_until("serve on mac")
    run.proc.send_signal(signal.SIGINT)
    code, _ = run.finish(timeout=120)
    assert code == 130, "\n".join(run.progress[-20:])
    assert "interrupted" in run.progress[-1]
    saved = json.loads((run.state / "demo" / run.name / "report.json").read_text())
    assert saved["outcome"] == "interrupted" and saved["left_behind"] == []
    run.assert_nothing_left()


@pytest.mark.parametrize(
    "args, field",
    [
        (["--rate", "fast"], "--rate 'fast'"),
        (["--delay-ms", "-1"], "--delay-ms -1"),
        (["--tokens", "2"], "--tokens 2"),
        (["--threads", "999"], "--threads 999"),
    ],
)
def test_demo_bad_input_changes_nothing(tmp_path, args, field):
    run = DemoRun(tmp_path, *args)
    code, _ = run.finish(timeout=60)
    err = error_lines("\n".join(line for line in run.progress if line.strip()))
    assert code == 2 and len(err) == 1 and field in err[0] and "fix:" in err[0], err
    assert not list(Path("/run/netns").glob(f"lk-{run.name}-*"))
    assert not (run.state / "lab").exists() and not (run.state / "demo").exists()


def test_demo_refuses_a_lab_that_is_already_up(tmp_path):
    run = DemoRun(tmp_path, "--json")
    run.proc.kill()  # only its name and directories are wanted here
    run.proc.wait()
    env = dict(os.environ, LINKCTL_STATE_DIR=str(run.state))
    up = subprocess.run(
        [sys.executable, "-m", "linkctl", "lab", "up", "--name", run.name],
        capture_output=True,
        text=True,
        env=env,
    )
    assert up.returncode == 0, up.stderr
    try:
        r = subprocess.run(
            [sys.executable, "-m", "linkctl", "lab", "demo", "--name", run.name],
            capture_output=True,
            text=True,
            env=env,
            timeout=60,
        )
        assert r.returncode == 2 and "already up" in r.stderr, r.stderr
        # The existing lab is untouched: its namespaces and files are still there.
        assert len(list(Path("/run/netns").glob(f"lk-{run.name}-*"))) == 3
        assert (run.state / "lab" / run.name / "lab.json").is_file()
    finally:
        subprocess.run(
            [sys.executable, "-m", "linkctl", "lab", "down", "--name", run.name], env=env
        )


def test_interrupt_in_a_fork_never_runs_the_parents_cleanup(tmp_path):
    """pyroute2 forks children and stops them with SIGTERM. With a handler like the
    demo's installed, a fork must die of the signal, not unwind its copy of the stack
    into the parent's cleanup (which once deleted a lab's namespaces under the running
    demo in CI). linkctl.lab.netns resets such handlers in every fork."""
    import linkctl.lab.netns  # noqa: F401  (registers the at-fork reset)

    def raise_interrupt(_sig, _frame):
        raise KeyboardInterrupt

    unwound = tmp_path / "unwound"
    ready_r, ready_w = os.pipe()
    old = signal.signal(signal.SIGTERM, raise_interrupt)
    try:
        pid = os.fork()
        if pid == 0:
            try:
                os.write(ready_w, b"x")
                time.sleep(10)
            finally:
                unwound.write_text("the fork ran its parent's cleanup")
                os._exit(0)
        os.read(ready_r, 1)
        os.kill(pid, signal.SIGTERM)
        _, status = os.waitpid(pid, 0)
        # The parent keeps its handler.
        assert signal.getsignal(signal.SIGTERM) is raise_interrupt
    finally:
        signal.signal(signal.SIGTERM, old)
    assert os.waitstatus_to_exitcode(status) == -signal.SIGTERM
    assert not unwound.exists()
