"""End to end in the lab namespaces with the real llama.cpp binaries.

dgx (rpc) runs `linkctl serve` -> ggml-rpc-server on its link address;
mac (head) runs `linkctl serve` -> llama-server --rpc 198.18.100.2:50052.
A completion goes through, the rpc-server holds the model's layers, a killed
rpc-server is brought back by the supervisors and a new completion succeeds.
Then the head refuses endpoints that speak another protocol or no HELLO.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from support.llama_util import need_llama, start_fake, stop
from support.serve_lab import Serve, complete

pytestmark = [pytest.mark.netns, pytest.mark.llama]


def test_serve_pair_completion_recovery_and_refusals(make_lab, tmp_path):
    need_llama()
    lab = make_lab("dgx-mac")
    from linkctl.gguf.tiny import TinySpec, write_tiny_llama

    model = write_tiny_llama(tmp_path / "tiny.gguf", TinySpec(n_layer=4, n_embd=128, n_ff=256))
    assert model["bytes"] > 0

    # Before setup the link address is not on enP7s7: rpc-server is not started.
    r = lab.run("dgx", "serve")
    assert r.returncode == 2 and "not on link interface enP7s7" in r.stderr, r.stderr
    for h in ("dgx", "mac"):
        r = lab.run(h, "setup")
        assert r.returncode == 0, r.stderr

    # The head gates on a probe report: none yet.
    r = lab.run("mac", "serve", "--model", model["path"])
    assert r.returncode == 1 and "no probe report" in r.stderr, r.stderr

    # The lab profile, with llama-server's info-level log (-lv 4 prints the buffers
    # per device) and a context that fits the tiny model.
    import tomllib

    import tomli_w

    data = tomllib.loads(Path(lab.profile_path).read_text())
    data["serve"] |= {"ctx": 512, "extra_args": ["-lv", "4"]}
    prof = tmp_path / "lab-verbose.toml"
    prof.write_text(tomli_w.dumps(data))

    # The real probe, with the real responder on dgx, writes the report the head gates on.
    responder = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "linkctl",
            "lab",
            "exec",
            "dgx",
            "--name",
            lab.name,
            "--",
            "linkctl",
            "responder",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        r = None
        for _ in range(20):  # until the responder listens
            r = lab.run("mac", "probe", "--no-throughput", "--json")
            if r.returncode != 2:
                break
            time.sleep(0.3)
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    finally:
        # stop the responder we started: the processes of dgx's namespace running it
        pids = subprocess.run(
            ["ip", "netns", "pids", lab.netns("dgx")], capture_output=True, text=True
        ).stdout.split()
        for pid in pids:
            with contextlib.suppress(OSError):
                if b"responder" in Path(f"/proc/{pid}/cmdline").read_bytes():
                    os.kill(int(pid), signal.SIGTERM)
        responder.wait(10)

    rpc_srv = Serve(lab, "dgx", "rpc", ["--profile", str(prof)], tmp_path / "dgx.log")
    head = None
    try:
        st = rpc_srv.wait(lambda s: s["state"] == "ready", 60, "rpc-server ready")
        rpc_pid = st["child_pid"]
        import psutil

        rss_before = psutil.Process(rpc_pid).memory_info().rss
        head = Serve(
            lab,
            "mac",
            "head",
            ["--profile", str(prof), "--model", model["path"]],
            tmp_path / "mac.log",
        )
        head.wait(lambda s: s["state"] == "ready", 120, "llama-server ready")

        out = complete(lab, 16)
        assert out["tokens_predicted"] == 16, out
        # The rpc-server really holds the layers: llama-server put a model buffer on the
        # RPC device, and the rpc-server process grew by at least the weights it holds.
        log = head.text()
        m = re.search(r"RPC\d*\[198\.18\.100\.2:50052\] model buffer size =\s*([\d.]+) MiB", log)
        assert m and float(m.group(1)) > 0, log[-3000:]
        grew = psutil.Process(rpc_pid).memory_info().rss - rss_before
        assert grew > 0.5 * model["bytes"], (grew, model["bytes"])
        assert re.search(r"probe report \S+ for dgx: ok", head.text()), head.text()[:2000]

        # Kill rpc-server: both supervisors bring the pair back.
        starts = head.status()["starts"]
        t0 = time.monotonic()
        os.kill(rpc_pid, signal.SIGKILL)
        rpc_srv.wait(lambda s: s["starts"] >= 2 and s["state"] == "ready", 60, "rpc restart")
        head.wait(lambda s: s["starts"] > starts and s["state"] == "ready", 120, "head restart")
        out = complete(lab, 8)
        recovery = time.monotonic() - t0
        assert out["tokens_predicted"] == 8
        assert "lost rpc endpoint 198.18.100.2:50052" in head.text()
        print(f"\nRECOVERY_S={recovery:.2f}")
        assert recovery < 90
    finally:
        if head:
            head.stop()
        rpc_srv.stop()

    # Endpoints that cannot work are refused with a clear message.
    ns_prefix = ["ip", "netns", "exec", lab.netns("dgx")]
    for mode, want in (
        ("v3", r"speaks RPC protocol 3\.0\.0 .*this head's build speaks 7\.\d+\.\d+"),
        ("nohello", "closed the connection on HELLO in both known shapes"),
    ):
        fake = start_fake(mode, 50052, host="198.18.100.2", prefix=ns_prefix)
        try:
            r = lab.run(
                "mac", "serve", "--skip-probe", "--model", model["path"], "--wait", "5", timeout=60
            )
        finally:
            stop(fake)
        assert r.returncode == 2, (mode, r.stderr)
        assert re.search(want, r.stderr), (mode, r.stderr)
        assert "Traceback" not in r.stderr
