"""`linkctl serve` in a lab host, in the background, and a completion from inside one."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

COMPLETE = r"""
import json, sys, urllib.request
body = json.dumps({"prompt": sys.argv[2], "n_predict": int(sys.argv[3]), "ignore_eos": True,
                   "temperature": 0, "cache_prompt": False}).encode()
req = urllib.request.Request(sys.argv[1], body, {"Content-Type": "application/json"})
with urllib.request.urlopen(req, timeout=float(sys.argv[4])) as r:
    print(r.read().decode())
"""


class Serve:
    """`linkctl serve` running in the background inside a lab host."""

    def __init__(self, lab, host: str, role: str, args: list[str], log: Path, fresh: bool = True):
        """``fresh``: the last serve's status removed first (else kept: what a serve
        started again reads of the last one's)."""
        self.lab, self.host, self.role, self.log = lab, host, role, log
        self.status_path = Path(lab.info["root"]) / "hosts" / host / "serve" / f"{role}.json"
        if fresh:
            self.status_path.unlink(missing_ok=True)
        self._stale = None if fresh else self._read().get("pid")  # the last serve's
        self._f = open(log, "w")  # noqa: SIM115 (closed in stop)
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "linkctl",
                "lab",
                "exec",
                host,
                "--name",
                lab.name,
                "--",
                "linkctl",
                "serve",
                *args,
            ],
            stdout=self._f,
            stderr=subprocess.STDOUT,
        )

    def _read(self) -> dict:
        try:
            return json.loads(self.status_path.read_text())
        except (OSError, ValueError):
            return {}

    def status(self) -> dict:
        """This serve's status ({} until it writes one: the last serve's is not it)."""
        st = self._read()
        return st if st.get("pid") != self._stale else {}

    def wait(self, pred, timeout: float, what: str) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            st = self.status()
            if st and pred(st):
                return st
            if self.proc.poll() is not None:
                break
            time.sleep(0.1)
        raise AssertionError(f"{self.host}: {what} not reached; log:\n{self.text()[-4000:]}")

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def stop(self) -> None:
        """SIGTERM the supervisor (it forwards to its child) and wait for both."""
        st = self.status()
        pid, child = st.get("pid"), st.get("child_pid")
        if pid:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self._f.close()
        if child:
            assert not _alive(child), f"{self.host}: child {child} outlived its supervisor"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is not alive
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


def complete(lab, n: int, timeout: float = 30) -> dict:
    r = lab.exec(
        "mac",
        sys.executable,
        "-c",
        COMPLETE,
        "http://127.0.0.1:9999/completion",
        "hello over the link",
        str(n),
        str(timeout),
        timeout=timeout + 10,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout)
