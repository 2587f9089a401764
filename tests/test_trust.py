"""Trust on the link, tried as an attacker would (issue 25), in a lab of three hosts on
one switch (dgx2-mac-switch: dgx1 198.18.100.2 runs the kv-agent as the prefill host
would, mac .1 is the head, dgx2 .3 is the third host on the segment): the third host,
holding a secret of its own, and user nobody on the agent's own host, reading none,
are refused by the kv-agent and the responder before any command; the files on disk
are unchanged (hash before and after); the head, holding the pair's secret, is served
throughout."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys

import pytest

from support.lab import LabHandle, read_line
from support.llama_util import stop
from support.paths import REPO

pytestmark = pytest.mark.netns
PARTY = str(REPO / "tests" / "support" / "trust_party.py")
NOBODY = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]


def digest(d) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.iterdir())}


def party(lab: LabHandle, host: str, role: str, args: dict, *prefix: str) -> dict:
    r = lab.exec(host, *prefix, sys.executable, PARTY, role, json.dumps(args), timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.splitlines()[-1])


@pytest.fixture
def segment(make_lab, tmp_path):
    from linkctl.lab import netns

    lab = make_lab("dgx2-mac-switch")
    for h in ("dgx1", "dgx2", "mac"):
        r = lab.run(h, "setup")
        assert r.returncode == 0, r.stderr
    areas = {"kv": tmp_path / "kv", "models": tmp_path / "models"}
    for d in areas.values():
        d.mkdir(mode=0o700)
    (areas["models"] / "model.gguf").write_bytes(b"GGUF" + bytes(range(256)) * 64)
    (areas["kv"] / "slot.kv").write_bytes(b"a user's prompt")
    profile = f"{lab.profile}-lab"
    argv, env = netns.exec_argv(
        netns.load_lab(lab.name),
        "dgx1",
        [sys.executable, PARTY, "agent", json.dumps({
            "profile": profile, "bind": lab.host("dgx1")["address"].split("/")[0],
            "subnet": "198.18.100.0/24", "areas": {k: str(v) for k, v in areas.items()},
        })],
    )  # fmt: skip
    agent = subprocess.Popen(
        argv, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        line = read_line(agent.stdout, 30)
        assert line.startswith("ready "), line
        yield lab, areas, profile, int(line.split()[1])
    finally:
        stop(agent)


def test_the_third_host_and_a_local_user_are_refused_and_the_pair_is_served(segment):
    from support.lab import responder

    lab, areas, profile, port = segment
    ip = {h: lab.host(h)["address"].split("/")[0] for h in ("dgx1", "dgx2", "mac")}
    # The third host holds a secret, but not the pair's.
    r = lab.run("dgx2", "key", "new", "--force", "--profile", lab.profile_path)
    assert r.returncode == 0, r.stderr
    before = {k: digest(d) for k, d in areas.items()}
    base = {"profile": profile, "agent": ip["dgx1"], "port": port}
    with responder(lab, "mac") as (_proc, ready):
        at = base | {"responder": ip["mac"], "responder_port": ready["port"]}
        third = party(lab, "dgx2", "attack", at | {"source": ip["dgx2"], "key": "own"})
        local = party(lab, "dgx1", "attack", at | {"source": ip["dgx1"], "key": "random"}, *NOBODY)
        head = party(lab, "mac", "pair", at | {"source": ip["mac"]})
    print("third host:", third, "\nuser nobody:", local, "\nhead:", head)
    for who in (third, local):
        for op in ("put_model", "get_delete", "stat", "responder"):
            assert who[op].startswith("refused: ") and "refused this host" in who[op], (op, who)
    assert third["read_secret"] == "done"  # its own, which proves nothing here
    assert local["read_secret"].startswith("refused: cannot read the pair secret")
    after = {k: digest(d) for k, d in areas.items()}
    # The attackers changed nothing; the head's put and get went through.
    assert after["models"] == before["models"]
    assert {k: v for k, v in after["kv"].items() if k != "planted-pair.kv"} == before["kv"]
    assert after["kv"]["planted-pair.kv"] == hashlib.sha256(b"planted").hexdigest()
    assert head == {"put_model": "done", "get_delete": "done", "stat": "done", "responder": "done"}
