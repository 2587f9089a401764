"""Shared fixtures: real lab namespaces, the CLI run inside them, state snapshots.

Tests that need root and namespaces fail (not skip) when CI=true.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PROFILES = REPO / "linkctl" / "data" / "profiles"  # the shipped profiles
IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")


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


class LabHandle:
    """A lab made for one test: unique name, torn down afterwards."""

    def __init__(self, profile: str, name: str):
        self.name = name
        self.profile = profile
        self.state = Path(os.environ["LINKCTL_STATE_DIR"])

    def up(self) -> dict:
        r = linkctl("lab", "up", "--profile", self.profile, "--name", self.name, "--json")
        assert r.returncode == 0, r.stderr
        self.info = json.loads(r.stdout)
        return self.info

    def exec(
        self, host: str, *argv: str, timeout: float = 120, input: str | None = None
    ) -> subprocess.CompletedProcess:
        return linkctl(
            "lab", "exec", host, "--name", self.name, "--", *argv, timeout=timeout, input=input
        )

    def run(self, host: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
        """`linkctl ARGS` inside the host's namespace."""
        return self.exec(host, "linkctl", *args, timeout=timeout)

    def netns(self, host: str) -> str:
        return f"lk-{self.name}-{host}"

    @property
    def profile_path(self) -> str:
        return self.info["profile_path"]

    def host(self, name: str) -> dict:
        return next(h for h in self.info["hosts"] if h["name"] == name)

    def down(self) -> None:
        linkctl("lab", "down", "--name", self.name)


def ns_snapshot(netns: str) -> dict:
    """Addresses, links (MTU, flags) and routes of a namespace, read with `ip -j`
    (an independent reader, not linkctl's own pyroute2 code)."""

    def ip(*args: str):
        out = subprocess.run(
            ["ip", "-n", netns, "-j", *args], capture_output=True, text=True, check=True
        ).stdout
        return json.loads(out or "[]")

    links = [
        {k: link.get(k) for k in ("ifname", "mtu", "flags", "operstate", "address")}
        for link in ip("link", "show")
    ]
    addrs = sorted(
        (a["ifname"], i["local"], i["prefixlen"])
        for a in ip("addr", "show")
        for i in a.get("addr_info", [])
        if i.get("family") == "inet"
    )
    routes = ip("-4", "route", "show", "table", "all")
    return {"links": links, "addrs": addrs, "routes": routes}


@pytest.fixture(autouse=True, scope="session")
def _state_dir(tmp_path_factory):
    """Every test run keeps its state (setup records, labs) in a temporary directory."""
    d = tmp_path_factory.mktemp("state")
    os.environ["LINKCTL_STATE_DIR"] = str(d)
    yield d


@pytest.fixture
def make_lab():
    """make_lab(profile) -> LabHandle, already up; all labs are torn down after the test."""
    need_root_netns()
    labs: list[LabHandle] = []

    def _make(profile: str = "dgx-mac") -> LabHandle:
        lab = LabHandle(profile, "t" + uuid.uuid4().hex[:8])
        labs.append(lab)
        lab.up()
        return lab

    yield _make
    for lab in labs:
        lab.down()


@pytest.fixture
def lab(make_lab) -> LabHandle:
    return make_lab("dgx-mac")
