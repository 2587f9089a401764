"""serve: plan argv lines, the bind refusal, the probe gate, the supervisor, the tiny model."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from linkctl.core.errors import CheckFailed, InputError
from linkctl.core.profile import RpcSpec, load_profile
from linkctl.llama.bins import Binary, LlamaBins, compatible
from linkctl.serve import plan as sv
from linkctl.serve import run
from support.cli import error_lines, linkctl
from support.paths import PROFILES

BINS = LlamaBins(
    rpc_server=Binary("rpc-server", "/opt/llama/bin/ggml-rpc-server", "test"),
    llama_server=Binary("llama-server", "/opt/llama/bin/llama-server", "test"),
)


def test_plan_rpc_and_head_argv():
    prof, _ = load_profile("dgx-mac")
    plan = sv.build_plan(prof, prof.host("dgx"), BINS)
    assert plan.role == "rpc"
    assert plan.invocation.argv() == [
        "/opt/llama/bin/ggml-rpc-server",
        "-H",
        "192.168.100.2",
        "-p",
        "50052",
        "-c",
    ]
    # the head line names the binary by name: it is resolved on the head
    assert plan.head.argv() == [
        "llama-server",
        "-m",
        "/Users/Shared/models/model.gguf",
        "--rpc",
        "192.168.100.2:50052",
        "-ngl",
        "99",
        "-c",
        "4096",
        "--host",
        "127.0.0.1",
        "--port",
        "9999",
    ]
    head = sv.build_plan(prof, prof.host("mac"), BINS, model="/m/x.gguf")
    assert head.invocation.argv()[0] == "/opt/llama/bin/llama-server"
    assert head.invocation.argv()[1:3] == ["-m", "/m/x.gguf"]
    assert head.health_url == "http://127.0.0.1:9999/health"


def test_plan_two_rpc_hosts_tensor_split_and_options(tmp_path):
    prof, _ = load_profile("dgx2-mac-switch")
    data = prof.to_toml_dict()
    data["serve"]["tensor_split"] = [3, 1, 2]  # dgx1, dgx2, mac (profile order)
    data["serve"]["extra_args"] = ["--no-mmap"]
    data["hosts"][1]["rpc"] |= {
        "threads": 8,
        "device": "CUDA0",
        "cache": True,
        "extra_args": ["--foo"],
    }
    from linkctl.core.profile import parse_profile

    prof = parse_profile(data)
    plan = sv.build_plan(prof, prof.head, BINS, model="/m.gguf")
    assert plan.endpoints == ["192.168.100.2:50052", "192.168.100.3:50052"]
    a = plan.head.argv()
    assert a[a.index("--rpc") + 1] == "192.168.100.2:50052,192.168.100.3:50052"
    # RPC devices first in --rpc order, then the head's own
    assert a[a.index("-ts") + 1] == "3,1,2"
    assert a[-1] == "--no-mmap"
    assert plan.rpc["dgx2"].argv() == [
        "ggml-rpc-server",
        "-H",
        "192.168.100.3",
        "-p",
        "50052",
        "-t",
        "8",
        "-d",
        "CUDA0",
        "-c",
        "--foo",
    ]


def test_wildcard_bind_refused_by_profile_and_by_plan(tmp_path):
    src = (PROFILES / "dgx-mac.toml").read_text()
    bad = tmp_path / "wild.toml"
    bad.write_text(src.replace("port = 50052", 'port = 50052\nbind = "0.0.0.0"'))
    r = linkctl("serve", "--profile", str(bad), "--host", "dgx", "--dry-run")
    assert r.returncode == 2
    assert "rpc.bind" in r.stderr and "wildcard" in r.stderr and "Traceback" not in r.stderr
    # the plan refuses too, should a host spec ever bypass profile validation
    prof, _ = load_profile("dgx-mac")
    dgx = prof.host("dgx")
    for bind, what in (("0.0.0.0", "wildcard"), ("192.168.100.1", "link address")):
        forged = dgx.model_copy(
            update={
                "rpc": RpcSpec.model_construct(
                    port=50052,
                    bind=__import__("ipaddress").IPv4Address(bind),
                    threads=None,
                    device=None,
                    cache=False,
                    extra_args=[],
                )
            }
        )
        with pytest.raises(InputError, match=what):
            sv.rpc_invocation(forged, "ggml-rpc-server")


def test_dry_run_prints_both_lines():
    r = linkctl(
        "serve", "--profile", "dgx-mac", "--host", "mac", "--dry-run", "--model", "/tmp/m.gguf"
    )
    assert r.returncode == 0, r.stderr
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith(("rpc ", "head "))]
    assert lines[0].startswith("rpc  dgx: ") and "-H 192.168.100.2 -p 50052" in lines[0]
    assert lines[1].startswith("head mac: ") and "--rpc 192.168.100.2:50052" in lines[1]
    r = linkctl("serve", "--profile", "dgx-mac", "--host", "dgx", "--dry-run", "--json")
    plan = json.loads(r.stdout)
    assert plan["role"] == "rpc" and plan["bind"] == "192.168.100.2"


@pytest.fixture
def split_env(tmp_path):
    """A state dir holding a saved probe report, and a header-only 235B MoE: the
    inputs `serve` estimates the recommended split from."""
    import os

    from support.ggufshapes import QWEN3_235B_A22B, write_header_only

    state = tmp_path / "state"
    (state / "probe").mkdir(parents=True)
    (state / "probe" / "latest.json").write_text(
        json.dumps(
            {
                "latency": {"tcp": {"1": {"p50_us": 90.0}}},
                "throughput": {"fwd_p1": {"gbps": 9.4}},
            }
        )
    )
    model = write_header_only(tmp_path / "moe.gguf", QWEN3_235B_A22B)
    return dict(os.environ, LINKCTL_STATE_DIR=str(state)), str(model)


def _dry(env, *args):
    r = linkctl("serve", "--profile", "dgx-mac", "--host", "mac", "--dry-run", *args, env=env)
    return r


def _flag(argv, name):
    return argv[argv.index(name) + 1] if name in argv else None


def test_dry_run_argv_carries_the_recommended_split(split_env):
    env, model = split_env
    est = json.loads(
        linkctl("estimate", "--profile", "dgx-mac", "--model", model, "--json", env=env).stdout
    )
    r = _dry(env, "--model", model, "--json")
    assert r.returncode == 0, r.stderr
    plan = json.loads(r.stdout)
    # The same recommended split the estimate prints, as -ts, and llama.cpp's
    # automatic fitting off so nothing re-places the layers.
    assert _flag(plan["head_argv"], "-ts") == est["recommended_tensor_split"]
    assert _flag(plan["head_argv"], "-fit") == "off"
    sp = plan["split"]
    assert sp["mode"] == "recommended" and sp["source"] == "default"
    assert sp["order"] == ["dgx", "mac"] and sp["recommendation"] == "split needed"
    assert sp["predicted_decode_tok_s"] == pytest.approx(est["recommended"]["decode_tok_s"])
    assert sp["predicted_prefill_tok_s"] == pytest.approx(est["recommended"]["prefill_tok_s"])
    assert "latest.json" in sp["estimate_source"]
    # Text: the split, where it came from and its predictions.
    r = _dry(env, "--model", model)
    line = next(ln for ln in r.stdout.splitlines() if ln.startswith("split: "))
    assert f"recommended -ts {est['recommended_tensor_split']}" in line
    assert "from default" in line and "predicted decode" in line and "prefill" in line


def test_recommended_weights_place_layers_exactly_as_predicted(split_env):
    """llama.cpp's rule (float32 cumulative split points) applied to the weights serve
    passes gives back the per-device layer counts the estimate scored."""
    from linkctl.estimate.layers import llama_slot_devices

    env, model = split_env
    plan = json.loads(_dry(env, "--model", model, "--json").stdout)
    weights = [float(w) for w in _flag(plan["head_argv"], "-ts").split(",")]
    n_layer = len(weights) and int(sum(weights)) - 1
    slots = llama_slot_devices(n_layer, weights)
    assert [slots.count(i) for i in range(len(weights))] == [int(w) for w in weights]


def test_split_llama_weights_and_bad_values(split_env):
    env, model = split_env
    plan = json.loads(_dry(env, "--model", model, "--split", "llama", "--json").stdout)
    assert "-ts" not in plan["head_argv"] and "-fit" not in plan["head_argv"]
    assert plan["split"]["mode"] == "llama" and plan["split"]["source"] == "--split"
    assert plan["split"]["predicted_decode_tok_s"] > 0
    plan = json.loads(_dry(env, "--model", model, "--split", "40,55", "--json").stdout)
    assert _flag(plan["head_argv"], "-ts") == "40,55"
    assert plan["split"]["mode"] == "weights" and plan["split"]["predicted_decode_tok_s"] > 0
    for bad, msg in (
        ("fastest", "--split 'fastest': not recommended, llama or"),
        ("0,0", "not all zero"),
        ("1,2,3", "--split 1,2,3: 3 weights"),
    ):
        r = _dry(env, "--model", model, "--split", bad)
        assert r.returncode == 2, (bad, r.stdout)
        assert msg in r.stderr and len(error_lines(r.stderr)) == 1, r.stderr
        assert "Traceback" not in r.stderr


def test_recommended_without_a_probe_report(tmp_path, split_env):
    """The profile's default falls back to llama.cpp's split and says why; asked for
    explicitly, recommended refuses (exit 2)."""
    import os

    _, model = split_env
    env = dict(os.environ, LINKCTL_STATE_DIR=str(tmp_path / "empty"))
    r = _dry(env, "--model", model, "--json")
    assert r.returncode == 0, r.stderr
    plan = json.loads(r.stdout)
    assert "-ts" not in plan["head_argv"] and plan["split"]["mode"] == "llama"
    assert any(
        "recommended split unavailable" in n and "no probe report" in n for n in plan["notes"]
    )
    r = _dry(env, "--model", model, "--split", "recommended")
    assert r.returncode == 2 and "--split recommended needs the estimate" in r.stderr
    assert len(error_lines(r.stderr)) == 1


def test_profile_serve_split_is_used(tmp_path, split_env):
    env, model = split_env
    src = (PROFILES / "dgx-mac.toml").read_text()
    prof = tmp_path / "p.toml"
    prof.write_text(src.replace("ngl = 99", 'ngl = 99\nsplit = "3,1"'))
    r = linkctl(
        "serve",
        "--profile",
        str(prof),
        "--host",
        "mac",
        "--dry-run",
        "--json",
        "--model",
        model,
        env=env,
    )
    plan = json.loads(r.stdout)
    assert _flag(plan["head_argv"], "-ts") == "3,1"
    assert plan["split"]["source"] == "serve.split in the profile"


def _report(d: Path, name: str, **kw) -> None:
    base = {
        "profile": "dgx-mac",
        "host": "mac",
        "peer": "dgx",
        "peer_address": "192.168.100.2",
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "ok": True,
        "exit_code": 0,
        "checks": [],
    }
    d.mkdir(parents=True, exist_ok=True)
    (d / name).write_text(json.dumps(base | kw))


def test_probe_gate(tmp_path):
    prof, _ = load_profile("dgx-mac")
    d = tmp_path / "probe"
    with pytest.raises(CheckFailed, match="no probe report"):
        run.probe_gate(prof, prof.head, directory=d)
    _report(d, "other.json", profile="dgx2-mac-switch")
    with pytest.raises(CheckFailed, match="no probe report"):
        run.probe_gate(prof, prof.head, directory=d)
    _report(d, "latest.json", ok=False, checks=[{"name": "throughput", "verdict": "FAIL"}])
    with pytest.raises(CheckFailed, match=r"failed \(throughput\)"):
        run.probe_gate(prof, prof.head, directory=d)
    _report(d, "latest.json", time="2020-01-01T00:00:00Z")
    with pytest.raises(CheckFailed, match="h old"):
        run.probe_gate(prof, prof.head, directory=d)
    _report(d, "latest.json")
    lines = run.probe_gate(prof, prof.head, directory=d)
    assert len(lines) == 1 and "ok" in lines[0]


def test_probe_gate_probes_an_aged_report_again(tmp_path):
    """A report that has only aged is probed again when the gate may (serve as root, or
    the unit's privileged pre-step); the fresh report decides, its reason on failure."""
    from linkctl.core.checks import Verdict
    from linkctl.probe.report import ProbeReport

    prof, _ = load_profile("dgx-mac")
    d = tmp_path / "probe"
    _report(d, "latest.json", time="2020-01-01T00:00:00Z")
    asked: list[str] = []

    def passing(peer):
        asked.append(peer.name)
        return ProbeReport(prof.name, "mac", peer.name, peer.ip), d / "fresh.json"

    lines = run.probe_gate(prof, prof.head, directory=d, reprobe=passing)
    assert asked == ["dgx"]
    assert "h old: probed again, ok (fresh.json)" in lines[0]

    def failing(peer):
        r = ProbeReport(prof.name, "mac", peer.name, peer.ip)
        r.add("throughput -> P1", Verdict.FAIL, 0.9, 8.0, "0.90 Gbit/s (below the minimum)")
        return r, d / "fresh.json"

    with pytest.raises(CheckFailed) as e:
        run.probe_gate(prof, prof.head, directory=d, reprobe=failing)
    assert "and probing it again failed: throughput -> P1 (0.9 vs limit 8)" in e.value.message
    # A failed report is not probed again: the link unit's gate owns that.
    _report(d, "latest.json", ok=False, checks=[{"name": "rpc", "verdict": "FAIL"}])
    asked.clear()
    with pytest.raises(CheckFailed, match=r"failed \(rpc\)"):
        run.probe_gate(prof, prof.head, directory=d, reprobe=passing)
    assert asked == []


def test_protocol_compatibility_rule():
    assert compatible((7, 0, 0), (7, 0, 0))
    assert compatible((7, 1, 0), (7, 0, 3))
    assert not compatible((7, 0, 0), (7, 1, 0))  # server newer minor
    assert not compatible((7, 0, 0), (3, 0, 0))
    assert not compatible((3, 6, 0), (7, 0, 0))


# ---- supervisor ------------------------------------------------------------------


def _sup(argv, tmp_path, **kw):
    import io

    from linkctl.serve.supervise import ChildSpec, Policy, Supervisor

    pol = Policy(
        backoff_initial=0.1,
        backoff_max=0.4,
        max_starts=kw.pop("max_starts", 4),
        window=60,
        stop_timeout=2,
        poll_s=0.05,
    )
    out = io.StringIO()
    sup = Supervisor(
        ChildSpec("child", argv, **kw), policy=pol, log=out, status_path=tmp_path / "status.json"
    )
    return sup, out


def test_supervisor_restarts_with_backoff_then_gives_up(tmp_path):
    sup, out = _sup(
        [sys.executable, "-c", "print('hi', flush=True); raise SystemExit(3)"],
        tmp_path,
        max_starts=4,
    )
    t0 = time.monotonic()
    assert sup.run(install_signals=False) == 1
    took = time.monotonic() - t0
    log = out.getvalue()
    assert sup.status.starts == 4 and sup.status.state == "stopped"
    assert log.count("(exit 3)") == 4 and "gave up: 4 starts" in log
    assert "child| hi" in log
    # backoff 0.1, 0.2, 0.4, 0.4 between the starts
    assert took >= 1.0
    for line in log.splitlines():  # every line timestamped
        assert line[:4].isdigit() and line[10] == "T", line
    st = json.loads((tmp_path / "status.json").read_text())
    assert [e["event"] for e in st["events"]].count("start") == 4


def test_what_a_supervised_server_writes_is_private(tmp_path):
    """llama-server writes slot files (a user's prompt) with its own umask: the
    supervisor gives it 077, whatever the caller's."""
    made = tmp_path / "slot.bin"
    sup, _ = _sup(
        [sys.executable, "-c", f"open({str(made)!r}, 'w').write('x'); raise SystemExit(3)"],
        tmp_path,
        max_starts=1,
    )
    old = os.umask(0o022)
    try:
        sup.run(install_signals=False)
    finally:
        os.umask(old)
    assert made.stat().st_mode & 0o777 == 0o600


def test_a_killed_supervisor_leaves_no_orphan(tmp_path):
    """SIGKILL the process that supervises a server: the server dies with it (nothing
    keeps holding the port for a restarted supervisor to mistake for its own)."""
    pidfile = tmp_path / "child.pid"
    script = (
        "import subprocess, sys, time\n"
        "from linkctl.core.runner import Runner\n"
        "p = Runner().spawn([sys.executable, '-c', 'import time; time.sleep(120)'],"
        " die_with_parent=True)\n"
        f"open({str(pidfile)!r}, 'w').write(str(p.pid))\n"
        "time.sleep(120)\n"
    )
    sup = subprocess.Popen([sys.executable, "-c", script])
    try:
        deadline = time.monotonic() + 30
        while not pidfile.exists() or not pidfile.read_text():
            assert time.monotonic() < deadline, "the child never started"
            time.sleep(0.05)
        child = int(pidfile.read_text())
        os.kill(child, 0)  # alive while its parent is
        sup.kill()
        sup.wait()
        deadline = time.monotonic() + 10
        while True:
            try:
                os.kill(child, 0)
            except ProcessLookupError:
                break
            # A zombie until reaped by init counts as gone: it holds no port.
            if Path(f"/proc/{child}/stat").read_text().split()[2] == "Z":
                break
            assert time.monotonic() < deadline, "the server outlived its supervisor"
            time.sleep(0.05)
    finally:
        sup.kill()


def test_a_server_on_its_port_that_it_did_not_start_is_not_adopted():
    import socket

    from linkctl.llama.invocation import ServerInvocation
    from linkctl.serve.run import llama_server_child

    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen()
        port = other.getsockname()[1]
        spec = llama_server_child(ServerInvocation("llama-server", "m.gguf", port=port))
        assert spec.before_start is not None
        why = spec.before_start()
        assert why and f"127.0.0.1:{port} is held by another process" in why
    assert spec.before_start() is None  # free again: it may start


def test_supervisor_ready_health_restart_and_stop(tmp_path):
    flag = tmp_path / "ready"
    script = f"import pathlib,time; pathlib.Path({str(flag)!r}).write_text('1'); time.sleep(60)"
    unhealthy = {"n": 0}

    def healthy(pid: int):
        # unhealthy once, on the first start's first check
        if unhealthy["n"] == 0:
            unhealthy["n"] = 1
            return "test says so"
        return None

    sup, out = _sup(
        [sys.executable, "-c", script],
        tmp_path,
        ready=flag.exists,
        healthy=healthy,
        health_interval=0.1,
    )
    t = threading.Thread(target=sup.run, kwargs={"install_signals": False})
    t.start()
    deadline = time.monotonic() + 20
    while sup.status.starts < 2 or sup.status.state != "ready":
        assert time.monotonic() < deadline, out.getvalue()
        time.sleep(0.05)
    pid = sup.status.child_pid
    sup.request_stop()
    t.join(10)
    assert not t.is_alive()
    log = out.getvalue()
    assert "unhealthy: test says so" in log and "ready after" in log
    assert subprocess.run(["kill", "-0", str(pid)], capture_output=True).returncode != 0


def test_tiny_model_deterministic_and_readable(tmp_path):
    import gguf

    from linkctl.gguf.tiny import N_VOCAB, TinySpec, write_tiny_llama

    a = write_tiny_llama(tmp_path / "a.gguf", TinySpec(n_layer=3, seed=7))
    write_tiny_llama(tmp_path / "b.gguf", TinySpec(n_layer=3, seed=7))
    write_tiny_llama(tmp_path / "c.gguf", TinySpec(n_layer=3, seed=8))
    ra, rb, rc = ((tmp_path / n).read_bytes() for n in ("a.gguf", "b.gguf", "c.gguf"))
    assert ra == rb and ra != rc and a["tensors"] == 3 + 9 * 3
    r = gguf.GGUFReader(str(tmp_path / "a.gguf"))
    kv = {f.name: f for f in r.fields.values()}
    assert kv["general.architecture"].contents() == "llama"
    assert kv["llama.block_count"].contents() == 3
    assert kv["tokenizer.ggml.model"].contents() == "llama"
    assert len(kv["tokenizer.ggml.tokens"].contents()) == N_VOCAB
    names = {t.name for t in r.tensors}
    assert "blk.2.ffn_down.weight" in names and "output.weight" in names


def test_binary_discovery_order(tmp_path, monkeypatch):
    from linkctl.llama.bins import find_bins

    def make(d: Path, *names: str) -> Path:
        d.mkdir(parents=True)
        for n in names:
            f = d / n
            f.write_text("#!/bin/sh\necho 'version: 42 (test)' >&2\n")
            f.chmod(0o755)
        return d

    prof_dir = make(tmp_path / "prof", "rpc-server")  # older name
    env_dir = make(tmp_path / "env", "ggml-rpc-server", "llama-server")
    monkeypatch.setenv("LINKCTL_LLAMA_BIN", str(env_dir))
    monkeypatch.setenv("PATH", str(make(tmp_path / "path", "llama-server")))
    b = find_bins(str(prof_dir))
    assert b.rpc_server.path == str(prof_dir / "rpc-server")
    assert b.rpc_server.found_via == "profile llama_bin_dir"
    assert b.llama_server.path == str(env_dir / "llama-server")
    assert b.llama_server.version == "version: 42 (test)"
    monkeypatch.delenv("LINKCTL_LLAMA_BIN")
    b = find_bins(None)
    assert b.llama_server.found_via == "PATH"
