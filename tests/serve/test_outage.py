"""An outage longer than the head's FIN: the split comes back without touching the rpc host.

rpc-server serves one client at a time and never learns that a client went away if the
client's FIN (and its retries) were lost: it waits on that connection for good, and the
head's next llama-server waits behind it. Here the head's packets are dropped (a tbf
that passes nothing) while the split is idle, its old llama-server goes, and the head's
kernel gives up its FIN (net.ipv4.tcp_orphan_retries = 1 in its namespace, where Linux's
default retries for minutes); then the link comes back. The head's serve frees the
rpc-server with a SYN from its old connection's end (linkctl.net.halfopen) and serves
the split again; rpc-server is not restarted. Twice: the same serve, gone alone under
its watch; and a serve started again (the ends kept in its status).
"""

from __future__ import annotations

import contextlib
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
ORPHAN = "/proc/sys/net/ipv4/tcp_orphan_retries"
SAID = "reset what llama-server left"


def mode(s: dict) -> str | None:
    return (s.get("watch") or {}).get("mode")


def on_split(s: dict) -> bool:
    return s["state"] == "ready" and mode(s) == "split"


class Pair:
    """rpc serve on dgx, head serve on mac (watch every second, fallback, a 4 s hold)."""

    def __init__(self, lab, tmp: Path):
        import tomllib

        import tomli_w

        self.lab, self.tmp = lab, tmp
        for h in ("dgx", "mac"):
            assert lab.run(h, "setup").returncode == 0
        model = write_tiny_llama(tmp / "tiny.gguf", TinySpec(n_layer=4, n_embd=128, n_ff=256))
        data = tomllib.loads(Path(lab.profile_path).read_text())
        data["serve"] |= {
            "ctx": 512,
            "model": model["path"],
            "watch_interval_s": INTERVAL,
            "watch_stall_s": 1.0,
            "on_fail": "fallback",
            "fallback_hold_s": HOLD,
        }
        self.prof = tmp / "p.toml"
        self.prof.write_text(tomli_w.dumps(data))
        self.mac = ["ip", "netns", "exec", lab.netns("mac")]
        self.iface = lab.host("mac")["interface"]
        self.rpc_end = f"{lab.host('dgx')['address'].split('/')[0]}:{RPC_PORT}"
        self.rpc = Serve(lab, "dgx", "rpc", ["--profile", str(self.prof)], tmp / "dgx.log")
        self.head: Serve | None = None
        self.client: Client | None = None
        self.rpc.wait(lambda s: s["state"] == "ready", 60, "rpc-server ready")

    def start_head(self, log: str, fresh: bool = True) -> Serve:
        args = ["--profile", str(self.prof), "--skip-probe"]
        self.head = Serve(self.lab, "mac", "head", args, self.tmp / log, fresh=fresh)
        self.head.wait(on_split, 90, "the split")
        return self.head

    def start_client(self, log: str) -> Client:
        self.client = Client(self.lab, self.tmp / log)
        return self.client

    def stop_client(self) -> None:
        if self.client is not None:
            self.client.proc.terminate()
            self.client.proc.wait(10)

    def cut_while_idle(self) -> None:
        """Every packet the head sends dropped (a tbf whose burst is smaller than any
        packet), once rpc-server's connection has had nothing unacknowledged for a
        second: a reply still in flight would be retransmitted after the link returns,
        and the head's reset to it would end the connection without the SYN."""
        self.stop_client()
        dgx = ["ip", "netns", "exec", self.lab.netns("dgx")]
        held = [*dgx, "ss", "-Htn", "state", "established", "src", self.rpc_end]
        quiet_since = [time.monotonic()]

        def quiet() -> bool:
            # A state filter drops ss's State column: Recv-Q, Send-Q, local, peer.
            out = subprocess.run(held, capture_output=True, text=True).stdout
            send_q = [int(row.split()[1]) for row in out.splitlines() if row.strip()]
            if not send_q or any(send_q):
                quiet_since[0] = time.monotonic()
            return time.monotonic() - quiet_since[0] >= 1.0

        wait_for(quiet, 30, "the split idle, nothing in flight")
        subprocess.run([*self.mac, "sh", "-c", f"echo 1 > {ORPHAN}"], check=True)
        drop = ["tc", "qdisc", "add", "dev", self.iface, "root", "tbf", "rate", "8bit",
                "burst", "10", "limit", "1"]  # fmt: skip
        subprocess.run([*self.mac, *drop], check=True)

    def restore_once_forgotten(self) -> float:
        """The link back once nothing of the old connection is left on the head (its
        FIN's one retry, after the backoff its unanswered data built up); the time."""
        closing = [*self.mac, "ss", "-Htn", "state", "fin-wait-1", "state", "fin-wait-2",
                   "state", "closing", "state", "last-ack", "dst", self.rpc_end]  # fmt: skip
        wait_for(
            lambda: not subprocess.run(closing, capture_output=True, text=True).stdout.strip(),
            60,
            "the old connection gone from the head",
        )
        subprocess.run([*self.mac, "tc", "qdisc", "del", "dev", self.iface, "root"], check=True)
        return time.monotonic()

    def stop(self) -> None:
        with contextlib.suppress(Exception):
            self.stop_client()
        if self.head is not None:
            self.head.stop()
        self.rpc.stop()


def freed(head: Serve) -> str:
    said = [ln for ln in head.text().splitlines() if SAID in ln]
    assert said, head.text()[-3000:]
    print(said[0])
    return said[0]


def test_the_split_returns_after_an_outage_longer_than_the_heads_fin(make_lab, tmp_path):
    need_llama()
    mine = Path(ORPHAN).read_text()
    pair = Pair(make_lab("dgx-mac"), tmp_path)
    try:
        head = pair.start_head("mac.log")
        pair.start_client("client.jsonl").wait_ok(3, 30)
        starts = pair.rpc.status()["starts"]
        pair.cut_while_idle()
        t0 = time.monotonic()
        st = head.wait(lambda s: mode(s) == "alone", 30, "the head alone")
        print(f"\nhead alone after {time.monotonic() - t0:.1f} s: {st['watch']['mode_reason']}")
        client = pair.start_client("client-alone.jsonl")
        client.wait_ok(2, 30)  # the head alone serves
        t1 = pair.restore_once_forgotten()
        st = head.wait(on_split, HOLD + 40, "the split back")
        back, why = time.monotonic() - t1, st["watch"]["mode_reason"]
        print(f"split back {back:.1f} s after the link: {why}")
        # The hold counts from the last echo lost (off the split the head echoes each
        # interval, busy or not), so not before the link has held HOLD s.
        assert back >= HOLD - INTERVAL, back
        freed(head)
        client.wait_ok(3, 30)
        assert pair.rpc.status()["starts"] == starts, pair.rpc.status()  # not restarted
        client.no_hang()
    finally:
        pair.stop()
    assert Path(ORPHAN).read_text() == mine  # this machine's own setting untouched


def test_a_head_serve_started_again_frees_what_the_last_one_left(make_lab, tmp_path):
    """The head's serve itself goes while the link is out (a crash, the head rebooted):
    the serve started again reads the ends the last one kept in its status."""
    need_llama()
    pair = Pair(make_lab("dgx-mac"), tmp_path)
    try:
        head = pair.start_head("mac.log")
        pair.start_client("client.jsonl").wait_ok(3, 30)
        # The health poll (every 0.5 s) keeps the end llama-server connected from.
        kept = head.wait(lambda s: s.get("rpc_ends"), 10, "the end kept")["rpc_ends"]
        assert list(kept) == [pair.rpc_end] and len(kept[pair.rpc_end]) == 1, kept
        starts = pair.rpc.status()["starts"]
        pair.cut_while_idle()
        head.stop()
        t1 = pair.restore_once_forgotten()
        head = pair.start_head("mac-again.log", fresh=False)
        print(f"\nsplit again {time.monotonic() - t1:.1f} s after the link")
        assert kept[pair.rpc_end][0] in freed(head)
        pair.start_client("client-again.jsonl").wait_ok(3, 30)
        assert pair.rpc.status()["starts"] == starts, pair.rpc.status()  # not restarted
    finally:
        pair.stop()
