"""An rpc-server held by a client (the head's llama-server) answers no one else, and
once its listen queue is full a connect gets no answer at all: probe says busy (WARN),
not "nothing listens" nor a FAIL. In a namespace of the test's own, on its loopback."""

from __future__ import annotations

import socket
import subprocess
import uuid
from collections.abc import Iterator

import pytest

from linkctl.core.checks import Verdict
from linkctl.core.profile import load_profile, parse_profile
from linkctl.lab import netns
from linkctl.probe import _check_rpc
from linkctl.probe.report import ProbeReport
from support.cli import need_root_netns

ADDR = "198.18.250.2"


@pytest.fixture
def ns() -> Iterator[None]:
    need_root_netns()
    name = "lk-rpcbusy-" + uuid.uuid4().hex[:6]
    subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        subprocess.run(["ip", "-n", name, "link", "set", "lo", "up"], check=True)
        subprocess.run(["ip", "-n", name, "addr", "add", f"{ADDR}/32", "dev", "lo"], check=True)
        with netns.inside(name):
            yield
    finally:
        subprocess.run(["ip", "netns", "del", name], check=True)


def test_a_full_listen_queue_is_busy_not_absent(ns):
    server = socket.socket()
    server.bind((ADDR, 0))
    server.listen(0)  # never accepts: a server whose one client holds it
    port = server.getsockname()[1]
    held = []
    try:
        for _ in range(8):  # fill the queue until a connect goes unanswered
            s = socket.socket()
            s.settimeout(0.3)
            try:
                s.connect((ADDR, port))
                held.append(s)
            except TimeoutError:
                s.close()
                break
        else:
            pytest.fail("the listen queue never filled")
        data = load_profile("dgx-mac")[0].to_toml_dict()
        data["link"]["subnet"] = "198.18.250.0/24"
        for h in data["hosts"]:
            h["address"] = f"{ADDR if h['name'] == 'dgx' else '198.18.250.1'}/24"
            if h["name"] == "dgx":
                h["rpc"]["port"] = port
        peer = parse_profile(data).host("dgx")
        rep = ProbeReport("dgx-mac", "mac", "dgx", ADDR)
        _check_rpc(rep, peer, timeout_s=0.5)
        (check,) = rep.checks
        assert check.verdict is Verdict.WARN and "busy" in check.detail, check
        assert rep.rpc is not None and rep.rpc.busy
    finally:
        for s in held:
            s.close()
        server.close()
