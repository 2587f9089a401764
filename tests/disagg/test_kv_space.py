"""A put that does not fit: the kv-agent's area on a real 2 MiB tmpfs (mounted in a
mount namespace of the agent's own, so this machine's mounts are untouched) refuses a
3 MiB model by name, with the space it needs and has, and keeps nothing."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from linkctl.disagg import kvxfer
from linkctl.trust.secret import PairSecret
from support.cli import need_root_netns, need_tool

KEY = PairSecret(os.urandom(32), "space")

# In the agent's mount namespace: a 2 MiB tmpfs on the area, the agent on loopback until
# stdin closes, then what the area holds.
AGENT = r"""
import ipaddress, json, os, subprocess, sys
from pathlib import Path
from linkctl.disagg.kvagent import Agent
from linkctl.trust.secret import PairSecret
area, key = Path(sys.argv[1]), bytes.fromhex(sys.argv[2])
subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m,mode=0700", "tmpfs", str(area)], check=True)
(area / "keep.gguf").write_bytes(b"x" * 1000)
a = Agent("127.0.0.1", 0, {"models": area}, ipaddress.IPv4Network("127.0.0.0/8"),
          PairSecret(key, "space"), log=lambda m: print(m, file=sys.stderr, flush=True))
a.start()
print(json.dumps({"port": a.port}), flush=True)
sys.stdin.read()
a.stop()
print(json.dumps({p.name: p.stat().st_size for p in sorted(area.iterdir())}), flush=True)
"""


def test_a_put_that_does_not_fit_is_refused_by_name_and_keeps_nothing(tmp_path):
    need_root_netns()
    need_tool("unshare")
    area = tmp_path / "area"
    area.mkdir()
    p = subprocess.Popen(
        ["unshare", "--mount", "--propagation", "private", sys.executable, "-c", AGENT,
         str(area), KEY.key.hex()],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert p.stdout is not None and p.stdin is not None
        line = p.stdout.readline()
        assert line, p.stderr.read() if p.stderr else ""
        port = json.loads(line)["port"]
        src = tmp_path / "big.gguf"
        src.write_bytes(os.urandom(3 << 20))
        with pytest.raises(kvxfer.TransferError) as e:
            kvxfer.put("127.0.0.1", port, "models", src, secret=KEY)
        msg = e.value.message
        assert "no space left on" in msg and f"need {3 << 20} bytes, have " in msg, msg
        p.stdin.close()
        held = json.loads(p.stdout.readline())
    finally:
        if p.poll() is None:
            p.kill()
        p.wait(10)
    assert held == {"keep.gguf": 1000}  # nothing added, nothing partial
    assert list(area.iterdir()) == []  # the tmpfs was the agent's alone
