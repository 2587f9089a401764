"""The lab's own commands: `lab exec` stops its command when it is stopped."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.netns


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
