"""serve's watch, the canary and serve.on_fail, against real faults in the lab.

One pair for the module: dgx runs `linkctl serve` (ggml-rpc-server on :50052) with the
delay proxy in front of it on :50053 (python -m linkctl.lab.delayproxy, its delay and
corruption changed mid-serve through --control); mac runs `linkctl serve` (llama-server
--rpc 198.18.100.2:50053) under the watch every second, serve.on_fail = "fallback", a
4 s hold and the canary every 2 s. A client inside mac sends completions the whole time
and logs each one (tests/support/watch_client.py): what a client saw.

Each fault: injected, detected within two watch intervals (plus a second of margin; the
canary: within its own interval plus two), its verdict and reason in
`linkctl status --json`, the policy applied (WARN: the split keeps serving; FAIL: the
head alone), no request left hanging, and the pair back on the split once it clears.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from linkctl.gguf.tiny import TinySpec, write_tiny_llama
from support.boot_kit import wait_for
from support.disagg_lab import (
    DECODE,
    ROUTE,
    chat,
    disagg_profile,
    greedy,
    ops,
    route_stats,
    serving,
)
from support.lab import LabHandle
from support.llama_util import need_llama
from support.route_client import prompt_of
from support.serve_lab import Serve
from support.watch_client import Client

pytestmark = [pytest.mark.netns, pytest.mark.llama]

INTERVAL = 1.0
STALL = 1.0  # rpc-server silent this long while requests wait: a stall
HOLD = 4.0
CANARY = 2.0
SWITCH_S = 2.0  # a switch stops llama-server within this (linkctl.serve.guard)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    import tomllib

    import tomli_w

    from support.cli import need_root_netns

    need_root_netns()
    need_llama()
    tmp = tmp_path_factory.mktemp("watch")
    lab = LabHandle("dgx-mac", "w" + os.urandom(4).hex())
    lab.up()
    procs: list = []
    try:
        model = write_tiny_llama(tmp / "tiny.gguf", TinySpec(n_layer=4, n_embd=128, n_ff=256))
        for h in ("dgx", "mac"):
            assert lab.run(h, "setup").returncode == 0
        data = tomllib.loads(Path(lab.profile_path).read_text())
        data["serve"] |= {
            "ctx": 512,
            "model": model["path"],
            "watch_interval_s": INTERVAL,
            "watch_stall_s": STALL,
            "on_fail": "fallback",
            "fallback_hold_s": HOLD,
            "canary_interval_s": CANARY,
            "canary_tokens": 4,
            "metrics_textfile": str(tmp / "linkctl.prom"),
        }
        rpc_prof = tmp / "rpc.toml"  # its own textfile: in the lab both hosts share one disk
        rpc_prof.write_text(
            tomli_w.dumps(
                data | {"serve": data["serve"] | {"metrics_textfile": str(tmp / "rpc.prom")}}
            )
        )
        for h in data["hosts"]:
            if h["name"] == "dgx":
                h["rpc"]["port"] = 50053  # the head reaches rpc-server through the proxy
        head_prof = tmp / "head.toml"
        head_prof.write_text(tomli_w.dumps(data))
        control = tmp / "proxy-control.json"
        control.write_text(json.dumps({"delay_ms": 0, "corrupt": False}))
        rpc = Serve(lab, "dgx", "rpc", ["--profile", str(rpc_prof)], tmp / "dgx.log")
        procs.append(rpc)
        rpc.wait(lambda s: s["state"] == "ready", 60, "rpc-server ready")
        proxy = subprocess.Popen(
            ["ip", "netns", "exec", lab.netns("dgx"), sys.executable, "-m",
             "linkctl.lab.delayproxy", "--listen", "198.18.100.2:50053", "--target",
             "198.18.100.2:50052", "--corrupt", "get_tensor", "--corrupt-rate", "1e-3",
             "--control", str(control)],
            stdout=subprocess.DEVNULL,
            stderr=open(tmp / "proxy.log", "w"),  # noqa: SIM115 (lives with the module)
        )  # fmt: skip
        procs.append(proxy)
        time.sleep(1)
        # verify records the canary's fingerprint; then serve under the watch.
        r = lab.run("mac", "verify", "--profile", str(head_prof), "--model", model["path"])
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
        head = Serve(
            lab, "mac", "head", ["--profile", str(head_prof), "--skip-probe"], tmp / "mac.log"
        )
        procs.append(head)
        head.wait(lambda s: (s.get("watch") or {}).get("canary"), 60, "the first canary")
        client = Client(lab, tmp / "client.jsonl")
        procs.append(client)
        # The rates' references are learned from the first intervals with traffic: every
        # test, run alone or not, starts with them in place.
        head.wait(
            lambda s: (
                {"decode_ref_tok_s", "prefill_ref_tok_s"}
                <= set((s.get("watch") or {}).get("figures") or {})
            ),
            60,
            "the decode and prefill references",
        )
        yield {
            "lab": lab, "rpc": rpc, "head": head, "client": client, "control": control,
            "head_prof": head_prof, "tmp": tmp, "proxy": proxy,
        }  # fmt: skip
    finally:
        errors = []
        for p in reversed(procs):
            try:
                if isinstance(p, subprocess.Popen):
                    p.send_signal(signal.SIGCONT)  # a test may have left it stopped
                    p.terminate()
                    p.wait(10)
                else:
                    p.stop()
            except Exception as e:  # every one is stopped and the lab goes, come what may
                errors.append(e)
        lab.down()
        if errors:
            raise errors[0]


def watch_of(st: dict) -> dict:
    return st.get("watch") or {}


def settled(pair, timeout: float = 40) -> dict:
    """Back on the split, the watch PASS, requests going through."""
    head, client = pair["head"], pair["client"]
    try:
        st = head.wait(
            lambda s: (
                s["state"] == "ready"
                and watch_of(s).get("mode") == "split"
                and watch_of(s).get("verdict") == "PASS"
            ),
            timeout,
            "the split back, watch PASS",
        )
    except AssertionError:
        w = json.dumps(head.status().get("watch"), indent=1)
        raise AssertionError(f"not settled within {timeout} s; the watch: {w}") from None
    client.wait_ok(3, 20)
    return st


def fault(pair, inject, pred, within: float, what: str, then=None) -> dict:
    """Inject, then the time until the head's status says ``pred`` (the detection);
    with ``then``, the time after that until the policy took (``then`` holds), which a
    switch bounds: llama-server stopped within SWITCH_S, the supervisor's health poll.
    What `linkctl status --json` says right after is returned."""
    head = pair["head"]
    t0 = time.monotonic()
    inject()
    st = head.wait(pred, within + 30, what)
    took = time.monotonic() - t0
    print(f"\n{what}: detected in {took:.2f} s; reasons: {watch_of(st).get('reasons')}")
    assert took <= within, (what, took, watch_of(st))
    if then is not None:
        t1 = time.monotonic()
        st = head.wait(then, SWITCH_S + 30, f"{what}: the policy")
        acted = time.monotonic() - t1
        print(f"{what}: policy applied {acted:.2f} s later ({watch_of(st).get('mode_reason')})")
        assert acted <= SWITCH_S + 1, (what, acted, watch_of(st))
    w = status_json(pair)
    assert w["verdict"] != "PASS" or w["mode"] != "split", w  # the fault, as users read it
    print(f"status --json: {w['verdict']} since {w['since']}, mode {w['mode']} "
          f"({w['mode_reason']}); reasons {w['reasons']}")  # fmt: skip
    return {**st, "watch": watch_of(st) | {"cli": w}}


def failed(s: dict) -> bool:
    """Detected: the watch's verdict is FAIL, or the head already left the split (a
    llama-server that exits on a failed RPC call is seen before any reading)."""
    return watch_of(s).get("verdict") == "FAIL" or watch_of(s).get("mode", "split") != "split"


def alone(s: dict) -> bool:
    return watch_of(s).get("mode") == "alone"


def status_json(pair) -> dict:
    """What `linkctl status --json` says on the head, as a user would read it."""
    r = pair["lab"].run("mac", "status", "--json", "--profile", str(pair["head_prof"]))
    assert r.returncode in (0, 1), r.stderr
    return json.loads(r.stdout)["serve"]["watch"]


def control(pair, **kw) -> None:
    from linkctl.core.paths import write_atomic

    cur = json.loads(pair["control"].read_text())
    write_atomic(pair["control"], json.dumps(cur | kw))


def test_status_and_the_textfile_show_the_watch(pair):
    st = settled(pair)
    w = status_json(pair)
    assert w["verdict"] == "PASS" and w["mode"] == "split" and w["on_fail"] == "fallback", w
    assert w["since"] and w["interval_s"] == INTERVAL and w["canary"]["verdict"] == "PASS"
    figs = w["figures"]
    assert figs["carrier"] == 1 and figs["rpc_connections"] == 1, figs
    assert (figs["rtt_ms"] or figs["ping_ms"]) > 0, figs  # busy: the connection's; idle: echo
    assert figs["decode_tok_s"] is None or figs["decode_tok_s"] > 0
    # --watch --json: one JSON object per line, every interval, until stopped.
    p = subprocess.Popen(
        [sys.executable, "-m", "linkctl", "lab", "exec", "mac", "--name", pair["lab"].name,
         "--", "linkctl", "status", "--watch", "--json", "--profile", str(pair["head_prof"])],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )  # fmt: skip
    time.sleep(3.5 * INTERVAL)
    p.terminate()
    out, _ = p.communicate(timeout=10)
    lines = [json.loads(ln) for ln in out.splitlines() if ln.strip()]
    assert len(lines) >= 2, out
    checked = [ln["serve"]["watch"]["checked_at"] for ln in lines]
    assert checked == sorted(checked) and len(set(checked)) >= 2, checked
    prom = (pair["tmp"] / "linkctl.prom").read_text()
    labels = 'profile="dgx-mac-lab",host="mac",role="head"'
    assert f"linkctl_watch_verdict{{{labels}}} 0" in prom, prom
    assert f'linkctl_watch_mode{{{labels},mode="split"}} 1' in prom, prom
    assert f"linkctl_watch_canary_pass{{{labels}}} 1" in prom, prom
    labels = 'profile="dgx-mac-lab",host="dgx",role="rpc"'
    # The rpc host's own verdict: PASS, though a reading may WARN for a moment on this
    # shared machine (a veth drops under CPU starvation, and 3 retransmits in an interval
    # are a WARN); the textfile follows it.
    rpc_prom = pair["tmp"] / "rpc.prom"
    wait_for(
        lambda: f"linkctl_watch_verdict{{{labels}}} 0" in rpc_prom.read_text(),
        10 * INTERVAL,
        "the rpc host's textfile at PASS",
    )
    rpc = rpc_prom.read_text()
    assert f"linkctl_watch_rpc_connections{{{labels}}}" in rpc, rpc
    assert st["watch"]["ticks"] > 0


def test_a_shaped_link_is_a_warn_and_the_split_keeps_serving(pair):
    from linkctl.lab.netns import load_lab, shape

    settled(pair)
    lab = load_lab(pair["lab"].name)
    st = fault(
        pair,
        lambda: shape(lab, 100_000_000),
        lambda s: watch_of(s).get("verdict") == "WARN",
        2 * INTERVAL + 1,
        "link shaped to 100 Mbit/s",
    )
    w = status_json(pair)
    assert w["verdict"] in ("WARN", "PASS") and w["mode"] == "split", w
    assert any(
        r.split(":")[0] in ("prefill", "decode", "retransmits", "rtt")
        for r in watch_of(st)["reasons"]
    )
    time.sleep(2 * INTERVAL)
    assert pair["head"].status()["watch"]["mode"] == "split"  # a WARN changes nothing
    for h in lab.hosts:
        subprocess.run(["ip", "netns", "exec", h.netns, "tc", "qdisc", "del", "dev",
                        h.interface, "root"], check=True)  # fmt: skip
    settled(pair)
    pair["client"].no_hang()


def test_delay_on_the_rpc_path_is_a_warn_on_decode(pair):
    settled(pair)
    st = fault(
        pair,
        lambda: control(pair, delay_ms=2),
        lambda s: any(r.startswith("decode") for r in watch_of(s).get("reasons", [])),
        2 * INTERVAL + 1,
        "2 ms each way on the RPC path",
    )
    assert watch_of(st)["mode"] == "split"
    control(pair, delay_ms=0)
    settled(pair)
    pair["client"].no_hang()


def test_corruption_after_the_start_fails_the_canary_and_falls_back(pair):
    settled(pair)
    st = fault(
        pair,
        lambda: control(pair, corrupt=True),
        failed,
        CANARY + 2 * INTERVAL + 2,  # the canary's own run (~0.1-1 s) and a margin
        "corruption on the RPC path",
        then=alone,
    )
    assert "canary" in watch_of(st)["mode_reason"], watch_of(st)
    w = status_json(pair)
    assert w["mode"] == "alone" and w["canary"]["verdict"] == "FAIL", w
    pair["client"].wait_ok(3, 20)  # the head alone serves
    control(pair, corrupt=False)
    st = settled(pair)
    assert watch_of(st)["canary"]["verdict"] == "PASS"
    pair["client"].no_hang()


def test_rpc_server_killed_falls_back_and_returns(pair):
    settled(pair)
    rpc = pair["rpc"]
    pid = rpc.status()["child_pid"]
    st = fault(
        pair,
        lambda: os.kill(pid, signal.SIGKILL),
        failed,
        2 * INTERVAL + 1,
        "rpc-server killed -9",
        then=alone,
    )
    # Either the watch saw the endpoint go, or llama-server aborted on the failed RPC
    # call first (ggml-org/llama.cpp #25938): both take the head alone.
    why = watch_of(st)["mode_reason"]
    assert "rpc" in why or "llama-server exited" in why, why
    st = settled(pair)
    assert rpc.status()["child_pid"] != pid
    pair["client"].no_hang()


def test_rpc_server_stopped_is_restarted_by_its_host(pair):
    """SIGSTOP: the rpc host's watch sees the process stopped and restarts it; the head
    loses its endpoint and serves alone until the split is back."""
    settled(pair)
    rpc = pair["rpc"]
    pid = rpc.status()["child_pid"]
    st = fault(
        pair,
        lambda: os.kill(pid, signal.SIGSTOP),
        failed,
        2 * INTERVAL + 1,
        "rpc-server stopped (SIGSTOP)",
        then=alone,
    )
    why = watch_of(st)["mode_reason"]
    assert "rpc" in why or "llama-server exited" in why, why
    # The rpc host's own watch restarts it: within two of its intervals, and the stop
    # (SIGTERM then SIGCONT) at once; the head may have seen the fault first.
    rpc.wait(
        lambda s: any(
            e["event"] == "exit" and "is stopped" in (e.get("reason") or "") for e in s["events"]
        ),
        2 * INTERVAL + 5,
        "the rpc host restarting its stopped rpc-server",
    )
    settled(pair, 60)
    pair["client"].no_hang()


def test_a_peer_that_answers_nothing_is_a_stall(pair):
    """SIGSTOP on the proxy in front of rpc-server: the connection stays up and nothing
    comes back while llama-server waits; the head's watch calls it a stall."""
    settled(pair)
    proxy = pair["proxy"]
    st = fault(
        pair,
        lambda: os.kill(proxy.pid, signal.SIGSTOP),
        failed,
        2 * INTERVAL + 1,  # the stall limit is one interval here
        "no answer on the RPC connection",
        then=alone,
    )
    assert "stall" in watch_of(st)["mode_reason"], watch_of(st)
    pair["client"].wait_ok(3, 20)
    os.kill(proxy.pid, signal.SIGCONT)
    settled(pair, 60)
    pair["client"].no_hang()


def test_the_cable_deleted_and_restored(pair):
    from linkctl.lab.netns import load_lab, wire_link

    settled(pair)
    lab = load_lab(pair["lab"].name)
    mac = lab.host("mac")
    st = fault(
        pair,
        lambda: subprocess.run(["ip", "-n", mac.netns, "link", "del", mac.interface], check=True),
        failed,
        2 * INTERVAL + 1,
        "cable deleted",
        then=alone,
    )
    assert "carrier" in watch_of(st)["mode_reason"], watch_of(st)
    pair["client"].wait_ok(3, 20)
    wire_link(lab)
    for h in ("dgx", "mac"):
        assert pair["lab"].run(h, "setup").returncode == 0
    settled(pair, 60)
    pair["client"].no_hang()


# ---- a restore that reuses nothing (route, serve.mode = "disaggregated") -----------------
# llama-server's slot restore can report success and reuse nothing: for sliding-window,
# recurrent and hybrid models a slot file carries no context checkpoint, and the next
# request prefills the whole prompt again (llama.cpp #25913, #26676, #27813, #28194). A
# tiny gemma2 (sliding-window attention) makes that happen for real with the llama.cpp
# build pinned here: route reads the decode server's timings.cache_n, calls each such
# request a fallback, counts them, and after three in a row stops transferring for the
# model; every client gets the tokens the decode server alone gives, none hangs.


def test_a_restore_that_reuses_nothing_is_caught_counted_and_stops_transfers(make_lab, tmp_path):
    need_llama()
    lab = make_lab("dgx-mac")
    # A gemma2 with a 32-token window: llama.cpp b11434 restores its slot (n_restored is
    # the whole prompt) and then prefills the prompt again, as for the models of the
    # issues above.
    spec = TinySpec(n_layer=6, n_embd=256, n_ff=512, n_ctx=4096, sliding_window=32)
    path = write_tiny_llama(tmp_path / "swa.gguf", spec)["path"]
    prof = disagg_profile(lab, tmp_path, path, threshold=64)

    # Said before serving: by the estimate (its serving notes) and by doctor (a WARN).
    what_if = ["--rtt-us", "100", "--throughput-gbps", "10", "--json"]
    r = lab.run("mac", "estimate", "--profile", str(prof), "--model", path, *what_if)
    assert r.returncode == 0, r.stderr
    notes = json.loads(r.stdout)["serving"]["notes"]
    assert any("gemma2 is a sliding-window model" in n for n in notes), notes

    with serving(lab, prof, tmp_path) as (_, head):
        r = lab.run("mac", "doctor", "--profile", str(prof), "--json")
        lines = {ln["check"]: ln for ln in json.loads(r.stdout)["checks"]}
        assert lines["slot restores"]["verdict"] == "WARN", lines["slot restores"]
        assert "sliding-window" in lines["slot restores"]["detail"]
        assert lines["servers match"]["verdict"] == "PASS", lines["servers match"]

        prompts = [prompt_of(300, seed=s) for s in range(4)]
        refs = ops(
            lab,
            *[
                {"port": DECODE, "path": "/completion", "body": greedy(p, cache_prompt=False)}
                for p in (prompts[0], prompts[1], prompts[3])
            ],
            {
                "port": DECODE,
                "path": "/v1/chat/completions",
                "body": chat(prompts[2], cache_prompt=False),
            },
        )
        ref0, ref1, ref3, ref_chat = refs
        plain, streamed, chatted = ops(
            lab,
            {"port": ROUTE, "path": "/completion", "body": greedy(prompts[0])},
            {
                "port": ROUTE,
                "path": "/completion",
                "body": greedy(prompts[1], stream=True),
                "stream": True,
            },
            {"port": ROUTE, "path": "/v1/chat/completions", "body": chat(prompts[2])},
            timeout=300,
        )
        n_prompt = ref0["body"]["tokens_evaluated"]
        # Moved, restored, reused nothing: a fallback, with the tokens of the decode
        # server alone (it prefilled the prompt again).
        h = plain["headers"]
        assert plain["status"] == 200, plain
        assert (h["x-linkctl-route"], h["x-linkctl-cache-n"]) == ("fallback", "0"), h
        assert int(h["x-linkctl-transfer-bytes"]) > 0
        assert plain["body"]["tokens"] == ref0["body"]["tokens"]
        assert plain["body"]["timings"]["prompt_n"] == n_prompt
        # A stream's headers went out before its timings: stats say what happened.
        assert streamed["status"] == 200 and streamed["headers"]["x-linkctl-transfer-bytes"]
        pieces = [e["content"] for e in streamed["events"] if not e.get("stop")]
        assert "".join(pieces) == ref1["body"]["content"]
        assert chatted["headers"]["x-linkctl-route"] == "fallback", chatted["headers"]
        assert chatted["body"]["choices"] == ref_chat["body"]["choices"]

        st = route_stats(lab)
        model = st["served_model"]
        assert model == path, st
        assert st["restores"]["models"] == {
            model: {"took": 0, "noops": 3, "in_a_row": 3, "stopped": True}
        }
        recent = {o["id"]: o for o in st["recent"]}
        s = recent[streamed["headers"]["x-linkctl-request"]]
        assert (s["route"], s["restore_took"], s["cache_n"]) == ("fallback", False, 0), s
        assert s["reason"] == f"restore reused nothing (cache_n 0 of {n_prompt})"

        # Three in a row: no more transfers for this model; the answer is the same.
        (after,) = ops(lab, {"port": ROUTE, "path": "/completion", "body": greedy(prompts[3])})
        assert after["headers"]["x-linkctl-route"] == "direct", after["headers"]
        assert "x-linkctl-transfer-bytes" not in after["headers"]
        assert after["body"]["tokens"] == ref3["body"]["tokens"]
        why = route_stats(lab)["recent"][-1]["reason"]
        assert why == f"restores did not take 3 times in a row for {model}: prefilling here"
        assert all(o["total_s"] < 60 for o in (plain, streamed, chatted, after))
        log = head.text()
        assert log.count("did not take: restore reused nothing") == 3, log[-3000:]
        assert "no more transfers for it" in log
        # ... and `linkctl status` says so on the head.
        r = lab.run("mac", "status", "--profile", str(prof), "--json")
        route = json.loads(r.stdout)["serve"]["route"]
        assert route["restores"][model] == {
            "took": 0, "noops": 3, "in_a_row": 3, "stopped": True
        }, route  # fmt: skip
        r = lab.run("mac", "status", "--profile", str(prof))
        assert "3 reused nothing (3 in a row); transfers stopped for it" in r.stdout, r.stdout
