"""route asks the kv-agent (over the authenticated channel) whether the prefill port is
held by the llama-server serve started, before it sends that server a key or a
prompt: a process that took the port while serve was down is not vouched for."""

from __future__ import annotations

import ipaddress
import os
import socket
import subprocess
import sys
import time
from types import SimpleNamespace

from linkctl.disagg import kvagent, kvxfer
from linkctl.disagg.run import listening_child
from linkctl.trust.secret import PairSecret

LO = ipaddress.IPv4Network("127.0.0.0/8")
KEY = PairSecret(os.urandom(32), "test")
LISTEN = "import socket,sys,time; s=socket.socket(); s.bind(('127.0.0.1', int(sys.argv[1])));" \
    "s.listen(); print('up', flush=True); time.sleep(60)"  # fmt: skip


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def listener(port: int) -> subprocess.Popen:
    p = subprocess.Popen([sys.executable, "-c", LISTEN, str(port)], stdout=subprocess.PIPE)
    assert p.stdout is not None and p.stdout.readline() == b"up\n"
    return p


def test_the_agent_vouches_only_for_the_server_serve_started(tmp_path):
    port = free_port()
    sup = SimpleNamespace(proc=None)  # what run_prefill's Supervisor holds
    with kvagent.Agent(
        "127.0.0.1",
        0,
        {"kv": tmp_path},
        LO,
        KEY,
        server_check=lambda: listening_child(sup, "127.0.0.1", port),  # type: ignore[arg-type]
    ) as a:

        def ask() -> str | None:
            return kvxfer.prefill_server_is_ours("127.0.0.1", a.port, secret=KEY)

        assert "not running" in (ask() or "")
        squatter = listener(port)  # took the port while serve's server was down
        ours = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        try:
            sup.proc = ours
            assert "is not held by the llama-server serve started" in (ask() or "")
        finally:
            squatter.kill()
            squatter.wait()
            ours.kill()
            ours.wait()
        sup.proc = listener(port)
        try:
            time.sleep(0.1)
            assert ask() is None
        finally:
            sup.proc.kill()
            sup.proc.wait()
