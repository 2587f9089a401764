"""The lab's own commands: `lab exec` stops its command when it is stopped; every
command that changes the machine has a --dry-run that changes and writes nothing."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from linkctl.lab.rootfs import WORK
from support.cli import linkctl, need_root_netns

pytestmark = pytest.mark.netns
NAME = "d" + uuid.uuid4().hex[:6]  # a lab name no test makes

DRY_RUNS = [
    ("lab", "up", "--name", NAME),
    ("lab", "up", "--name", NAME, "--profile", "dgx2-mac-switch"),
    ("lab", "down", "--name", NAME),
    ("lab", "demo", "--name", NAME, "--rate", "1gbit", "--delay-ms", "0.5"),
    ("lab", "boot", "--name", NAME, "--install"),
    ("responder", "--host", "dgx"),
    ("verify", "--host", "mac"),
    ("serve", "--host", "mac"),
    ("serve", "--host", "dgx"),
    ("calibrate", "--host", "dgx"),
    ("route", "--host", "mac"),
    ("kv-agent", "--host", "dgx"),
]


def _netns_list() -> str:
    return subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout


@pytest.mark.parametrize("argv", DRY_RUNS, ids=lambda a: " ".join(a[:2]))
def test_a_dry_run_changes_and_writes_nothing(tmp_path, argv):
    """Each with an empty state dir and an empty TMPDIR: both stay empty, no namespace
    appears or goes, no container directory is made (verify --dry-run used to write
    its 5 MB model into the state dir; the lab commands had no dry run)."""
    need_root_netns()
    state, tmp = tmp_path / "state", tmp_path / "tmp"
    state.mkdir()
    tmp.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("LINKCTL_PROFILE", "LINKCTL_HOST")}
    env.update(LINKCTL_STATE_DIR=str(state), TMPDIR=str(tmp))
    before = _netns_list()
    for json_ in ((), ("--json",)):
        r = linkctl(*argv, "--dry-run", *json_, env=env)
        assert r.returncode == 0, r.stderr
        if json_:
            out = json.loads(r.stdout)
            assert out.get("dry_run") is not False, out
        else:
            assert r.stdout.strip(), r.stderr
        assert _netns_list() == before
        assert not list(state.iterdir()), list(state.rglob("*"))
        assert not list(tmp.iterdir()), list(tmp.rglob("*"))
        assert not [p for p in (WORK.iterdir() if WORK.is_dir() else ()) if NAME in p.name]


def test_lab_down_dry_run_names_what_it_would_remove_and_removes_nothing(lab):
    ns = sorted(n.split()[0] for n in _netns_list().splitlines() if f"-{lab.name}-" in n)
    r = linkctl("lab", "down", "--name", lab.name, "--dry-run", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    root = Path(lab.info["root"])
    assert out["dry_run"] is True and out["removed"] == [*ns, str(root)]
    assert set(out["processes"]) == set(ns)
    assert sorted(n.split()[0] for n in _netns_list().splitlines() if lab.name in n) == ns
    assert (root / "lab.json").is_file()
    r = linkctl("lab", "down", "--name", lab.name, "--dry-run")
    assert r.returncode == 0 and "would stop 0 process(es) and remove" in r.stdout, r.stdout


def _pids_in(netns: str) -> set[int]:
    out = subprocess.run(["ip", "netns", "pids", netns], capture_output=True, text=True).stdout
    return {int(p) for p in out.split()}


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_lab_exec_passes_a_stop_signal_on_to_its_command(lab, sig):
    """Killing `linkctl lab exec HOST -- CMD` stops CMD inside the namespace (it used to
    keep running there, e.g. a responder); lab exec exits as a shell would, 128 + N."""
    argv = [sys.executable, "-m", "linkctl", "lab", "exec", "dgx", "--name", lab.name]
    proc = subprocess.Popen(
        [*argv, "--", "sleep", "300"],
        stdin=subprocess.DEVNULL,  # not a terminal's Ctrl-C: SIGINT is passed on too
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        deadline = time.monotonic() + 30
        sleeping: set[int] = set()
        while not sleeping and time.monotonic() < deadline:
            sleeping = {p for p in _pids_in(lab.netns("dgx")) if _cmdline(p) == b"sleep\x00300\x00"}
            time.sleep(0.05)
        assert sleeping, "sleep never started in the namespace"
        t0 = time.monotonic()
        proc.send_signal(sig)
        code = proc.wait(10)
        assert code == 128 + sig, (code, proc.stderr.read() if proc.stderr else "")
        while time.monotonic() - t0 < 5 and any(os.path.exists(f"/proc/{p}") for p in sleeping):
            time.sleep(0.05)
        assert not [p for p in sleeping if _cmdline(p) == b"sleep\x00300\x00"], "sleep survived"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for p in _pids_in(lab.netns("dgx")):
            if _cmdline(p) == b"sleep\x00300\x00":
                os.kill(p, signal.SIGKILL)
