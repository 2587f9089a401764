"""runner.stop_process against real children: one that stops on SIGTERM, one that
ignores it and must be SIGKILLed within the timeout, and one that already exited; and
Children's log files, readable by users whatever the umask."""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import time

from linkctl.core.runner import Children, Runner, stop_process

# Prints "ready" once SIGTERM is ignored, so the test never signals it too early.
IGNORES_TERM = (
    "import signal, sys, time\n"
    "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
    "print('ready', flush=True)\n"
    "time.sleep(600)\n"
)


def _spawn(code: str) -> subprocess.Popen:
    p = Runner().spawn([sys.executable, "-c", code], stdout=subprocess.PIPE)
    assert p.stdout is not None
    assert p.stdout.readline().strip() == b"ready"
    return p


def test_stops_on_sigterm_without_kill():
    p = _spawn("import time\nprint('ready', flush=True)\ntime.sleep(600)\n")
    said: list[str] = []
    t0 = time.monotonic()
    rc = stop_process(p, 30, kill_wait=5, say=said.append)
    assert rc == -signal.SIGTERM
    assert p.returncode == -signal.SIGTERM  # reaped
    assert time.monotonic() - t0 < 30
    assert said == []


def test_escalates_to_kill_after_timeout_and_reaps():
    p = _spawn(IGNORES_TERM)
    said: list[str] = []
    t0 = time.monotonic()
    rc = stop_process(p, 1.0, kill_wait=10, say=said.append)
    took = time.monotonic() - t0
    assert rc == -signal.SIGKILL
    assert p.returncode == -signal.SIGKILL  # reaped, not a zombie left to the caller
    assert 1.0 <= took < 15  # waited the whole timeout, then did not hang
    assert said == [f"pid {p.pid} ignored SIGTERM for 1 s; SIGKILL"]


def test_kill_wait_none_waits_until_reaped():
    p = _spawn(IGNORES_TERM)
    assert stop_process(p, 0.5) == -signal.SIGKILL


def test_already_exited_child_is_left_alone():
    p = _spawn("print('ready', flush=True)\n")
    p.wait(30)
    said: list[str] = []
    assert stop_process(p, 5, say=said.append) == 0
    assert said == []


def test_children_logs_are_0644_under_a_umask_077(tmp_path):
    # verify/ and calibrate/ keep their servers' logs in the state directory users read.
    log = tmp_path / "server.log"
    old = os.umask(0o077)
    try:
        with Children(Runner()) as ch:
            ch.spawn([sys.executable, "-c", "print('hello')"], log).wait(30)
    finally:
        os.umask(old)
    assert log.read_text() == "hello\n" and stat.S_IMODE(log.stat().st_mode) == 0o644
