"""Running the real CLI as a user would, and what a test needs of the machine."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")
# User nobody, no groups, no capabilities: what someone without sudo runs as.
NOBODY = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]


def need_root_netns() -> None:
    """Fail under CI, skip elsewhere, when this machine cannot make namespaces."""
    why = None
    if os.geteuid() != 0:
        why = "needs root"
    elif not shutil.which("ip"):
        why = "needs iproute2 (ip)"
    if why:
        if IN_CI:
            pytest.fail(f"{why}; CI must run as root with iproute2")
        pytest.skip(why)


def need_tool(name: str) -> str:
    path = shutil.which(name)
    if not path:
        if IN_CI:
            pytest.fail(f"{name} is not installed; scripts/bootstrap.sh installs it")
        pytest.skip(f"needs {name}")
    return path


def error_lines(stderr: str) -> list[str]:
    """stderr's lines without the profile line a command that reads a profile says first
    (linkctl.core.profile.announce): what a bad-input test counts as its one line."""
    lines = stderr.strip().splitlines()
    return lines[1:] if lines and lines[0].startswith("linkctl: profile ") else lines


def linkctl(
    *args: str, env: dict[str, str] | None = None, timeout: float = 120, input: str | None = None
) -> subprocess.CompletedProcess:
    """Run the real CLI as a user would (a new process)."""
    return subprocess.run(
        [sys.executable, "-m", "linkctl", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        input=input,
    )


def linkctl_as_nobody(
    *args: str, env: dict[str, str] | None = None, netns: str | None = None, timeout: float = 120
) -> subprocess.CompletedProcess:
    """The real CLI run by user nobody (HOME /nonexistent), inside ``netns`` when given
    (`ip netns exec` enters it as root, then setpriv drops to nobody). Needs root."""
    need_tool("setpriv")
    argv = [*NOBODY, sys.executable, "-m", "linkctl", *args]
    if netns:
        argv = ["ip", "netns", "exec", netns, *argv]
    return subprocess.run(
        argv,
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd="/",
        env={**(os.environ if env is None else env), "HOME": "/nonexistent"},
    )
