"""A lab made for one test (`linkctl lab up`), and an independent reader of a
namespace's network state."""

from __future__ import annotations

import json
import os
import select
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO

from support.cli import linkctl
from support.llama_util import stop


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


def read_line(stream: IO[str] | None, timeout: float) -> str:
    """The next line of a child's stdout or stderr pipe, failing after ``timeout`` s."""
    assert stream is not None
    ready, _, _ = select.select([stream], [], [], timeout)
    if not ready:
        raise AssertionError(f"no output within {timeout} s")
    return stream.readline()


@contextmanager
def responder(lab: LabHandle, host: str) -> Iterator[tuple[subprocess.Popen, dict]]:
    """`linkctl responder --json` in the host's namespace (the argv lab exec uses):
    (the process, its ready line), stopped when the block ends."""
    from linkctl.lab import netns

    argv, env = netns.exec_argv(netns.load_lab(lab.name), host, ["linkctl", "responder", "--json"])
    proc = subprocess.Popen(
        argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        line = read_line(proc.stdout, 30)
        assert line, proc.stderr.read() if proc.stderr else ""
        yield proc, json.loads(line)
    finally:
        stop(proc)


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
