"""An outage longer than the head's FIN: the split comes back without touching the rpc host.

rpc-server serves one client at a time and never learns that a client went away if the
client's FIN (and its retries) were lost: it waits on that connection for good, and the
head's next llama-server waits behind it. Here the head's packets are dropped (a tbf
that passes nothing), the head's watch takes it alone, its old llama-server goes, and
the head's kernel gives up its FIN (net.ipv4.tcp_orphan_retries = 1 in its namespace,
where Linux's default retries for minutes); then the link comes back. The head's serve
frees the rpc-server with a SYN from its old connection's end (linkctl.net.halfopen) and
returns to the split; rpc-server is not restarted.
"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest

from linkctl.gguf.tiny import TinySpec, write_tiny_llama
from support.boot_kit import wait_for
from support.llama_util import need_llama
from support.serve_lab import Serve
from support.watch_client import Client

pytestmark = [pytest.mark.netns, pytest.mark.llama]

INTERVAL = 1.0
HOLD = 4.0
RPC_PORT = 50052  # the dgx-mac profile's


def mode(s: dict) -> str | None:
    return (s.get("watch") or {}).get("mode")


def test_the_split_returns_after_an_outage_longer_than_the_heads_fin(make_lab, tmp_path):
    import tomllib

    import tomli_w

    need_llama()
    lab = make_lab("dgx-mac")
    for h in ("dgx", "mac"):
        assert lab.run(h, "setup").returncode == 0
    model = write_tiny_llama(tmp_path / "tiny.gguf", TinySpec(n_layer=4, n_embd=128, n_ff=256))
    data = tomllib.loads(Path(lab.profile_path).read_text())
    data["serve"] |= {
        "ctx": 512,
        "model": model["path"],
        "watch_interval_s": INTERVAL,
        "watch_stall_s": 1.0,
        "on_fail": "fallback",
        "fallback_hold_s": HOLD,
    }
    prof = tmp_path / "p.toml"
    prof.write_text(tomli_w.dumps(data))
    mac_ns, iface = lab.netns("mac"), lab.host("mac")["interface"]
    orphan = "/proc/sys/net/ipv4/tcp_orphan_retries"
    mine = Path(orphan).read_text()
    rpc = Serve(lab, "dgx", "rpc", ["--profile", str(prof)], tmp_path / "dgx.log")
    head = client = None
    try:
        rpc.wait(lambda s: s["state"] == "ready", 60, "rpc-server ready")
        args = ["--profile", str(prof), "--skip-probe"]
        head = Serve(lab, "mac", "head", args, tmp_path / "mac.log")
        head.wait(lambda s: s["state"] == "ready" and mode(s) == "split", 90, "the split")
        client = Client(lab, tmp_path / "client.jsonl")
        client.wait_ok(3, 30)
        # The cut comes while the split is idle: rpc-server has nothing in flight, so
        # no retransmission of its own would reach the head later and end the
        # connection (the head's reset to it): only the head's FIN could, and it is lost.
        client.proc.terminate()
        client.proc.wait(10)
        dgx_ns = ["ip", "netns", "exec", lab.netns("dgx")]
        rpc_end = f"{lab.host('dgx')['address'].split('/')[0]}:{RPC_PORT}"
        held = [*dgx_ns, "ss", "-Htn", "state", "established", "src", rpc_end]
        quiet_since = [time.monotonic()]

        def quiet() -> bool:
            """rpc-server's connection with nothing unacknowledged for a second (the
            state filter drops ss's State column: Recv-Q, Send-Q, local, peer)."""
            out = subprocess.run(held, capture_output=True, text=True).stdout
            send_q = [int(row.split()[1]) for row in out.splitlines() if row.strip()]
            if not send_q or any(send_q):
                quiet_since[0] = time.monotonic()
            return time.monotonic() - quiet_since[0] >= 1.0

        wait_for(quiet, 30, "the split idle, nothing in flight")
        starts = rpc.status()["starts"]
        ns = ["ip", "netns", "exec", mac_ns]
        subprocess.run([*ns, "sh", "-c", f"echo 1 > {orphan}"], check=True)
        drop = ["tc", "qdisc", "add", "dev", iface, "root", "tbf", "rate", "8bit", "burst", "10",
                "limit", "1"]  # fmt: skip
        subprocess.run([*ns, *drop], check=True)
        t0 = time.monotonic()
        st = head.wait(lambda s: mode(s) == "alone", 30, "the head alone")
        print(f"\nhead alone after {time.monotonic() - t0:.1f} s: {st['watch']['mode_reason']}")
        client = Client(lab, tmp_path / "client-alone.jsonl")
        client.wait_ok(2, 30)  # the head alone serves
        # The old llama-server's FIN retries run out (one retry here, after the backoff
        # its unanswered RPC data already built up): nothing of it left on the head.
        closing = [*ns, "ss", "-Htn", "state", "fin-wait-1", "state", "fin-wait-2", "state",
                   "closing", "state", "last-ack", "dst", rpc_end]  # fmt: skip
        wait_for(
            lambda: not subprocess.run(closing, capture_output=True, text=True).stdout.strip(),
            60,
            "the old connection gone from the head",
        )
        subprocess.run([*ns, "tc", "qdisc", "del", "dev", iface, "root"], check=True)
        t1 = time.monotonic()
        st = head.wait(
            lambda s: s["state"] == "ready" and mode(s) == "split", HOLD + 40, "the split back"
        )
        back, why = time.monotonic() - t1, st["watch"]["mode_reason"]
        print(f"split back {back:.1f} s after the link: {why}")
        # The hold counts from the last echo lost (off the split the head echoes each
        # interval, busy or not), so not before the link has held HOLD s.
        assert back >= HOLD - INTERVAL, back
        said = [ln for ln in head.text().splitlines() if "reset what llama-server left" in ln]
        assert said, head.text()[-3000:]
        print(said[0])
        client.wait_ok(3, 30)
        assert rpc.status()["starts"] == starts, rpc.status()  # freed, not restarted
        client.no_hang()
    finally:
        if client is not None:
            client.proc.terminate()
        if head is not None:
            head.stop()
        rpc.stop()
    assert Path(orphan).read_text() == mine  # this machine's own setting untouched
