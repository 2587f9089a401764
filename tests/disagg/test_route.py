"""Disaggregated serving in the lab with the real llama.cpp binaries.

dgx (prefill host) runs `linkctl serve` in serve.mode = "disaggregated": the prefill
llama-server and the kv-agent, both on its link address 198.18.100.2. mac (head)
runs `linkctl serve`: the decode llama-server on 127.0.0.1:8080 and route on :9999.
Greedy completions through route (disaggregated: prefilled on dgx, KV moved over the
link, restored and generated on mac) return exactly the tokens the decode server
alone returns; streaming works; killing the prefill server mid-request falls back.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from support.disagg_lab import (
    DECODE,
    KEY,
    ROUTE,
    chat,
    disagg_profile,
    greedy,
    ops,
    route_stats,
)
from support.llama_util import need_llama
from support.route_client import prompt_of
from support.serve_lab import Serve

pytestmark = [pytest.mark.netns, pytest.mark.llama]

THRESHOLD = 64


def test_route_disaggregated_equals_decode_alone_stream_and_fallback(make_lab, tmp_path):
    need_llama()
    lab = make_lab("dgx-mac")
    from linkctl.gguf.tiny import TinySpec, write_tiny_llama

    model = write_tiny_llama(
        tmp_path / "tiny.gguf", TinySpec(n_layer=6, n_embd=256, n_ff=512, n_ctx=4096)
    )
    prof = disagg_profile(lab, tmp_path, model["path"], THRESHOLD)

    # The plan: the prefill server and the agent on dgx's link address only.
    r = lab.run("dgx", "serve", "--profile", str(prof), "--dry-run", "--json")
    assert r.returncode == 0, r.stderr
    plan = json.loads(r.stdout)
    assert plan["role"] == "prefill" and plan["agent"] == "198.18.100.2:50053"
    argv = plan["argv"]
    assert argv[argv.index("--host") + 1] == "198.18.100.2"
    assert "--slot-save-path" in argv and argv[argv.index("--cache-ram") + 1] == "0"
    # The prefill server's key is derived from the pair secret (never the users' keys).
    dgx_key = Path(lab.info["root"]) / "hosts" / "dgx" / "serve" / "prefill-api-key"
    assert argv[argv.index("--api-key-file") + 1] == str(dgx_key)
    assert KEY not in " ".join(argv)

    pre = Serve(lab, "dgx", "prefill", ["--profile", str(prof)], tmp_path / "dgx.log")
    head = None
    try:
        # No model on dgx yet: the agent listens, llama-server waits for `model sync`.
        pre.wait(lambda s: s["state"] == "waiting", 60, "prefill waiting for the model")
        assert "run `linkctl model sync` on mac" in pre.text()
        r = lab.run("dgx", "doctor", "--profile", str(prof), "--json")
        lines = {ln["check"]: ln for ln in json.loads(r.stdout)["checks"]}
        assert lines["disagg model"]["verdict"] == "FAIL", lines["disagg model"]
        assert "model sync" in lines["disagg model"]["fix"]
        r = lab.run("mac", "model", "sync", "--profile", str(prof), "--json")
        assert r.returncode == 0, r.stderr
        synced = json.loads(r.stdout)
        assert synced["bytes"] == model["bytes"] and synced["from_address"] == "198.18.100.1"
        there = Path(lab.info["root"]) / "hosts" / "dgx" / "models" / "tiny.gguf"
        assert there.read_bytes() == Path(model["path"]).read_bytes()
        pre.wait(lambda s: s["state"] == "ready", 120, "prefill llama-server ready")
        assert dgx_key.stat().st_mode & 0o777 == 0o600 and KEY not in dgx_key.read_text()
        # A client on the link holding a user's key cannot use the prefill server: only
        # route, with the key from the pair secret, can.
        probe = (
            "import sys, urllib.request, urllib.error\n"
            "rq = urllib.request.Request('http://198.18.100.2:8081/completion', b'{}',"
            " {'Authorization': 'Bearer ' + sys.argv[1]})\n"
            "try:\n urllib.request.urlopen(rq, timeout=10)\n print(200)\n"
            "except urllib.error.HTTPError as e:\n print(e.code)\n"
        )
        r = lab.exec("mac", sys.executable, "-c", probe, KEY)
        assert r.stdout.strip() == "401", (r.stdout, r.stderr)
        head = Serve(
            lab, "mac", "head", ["--profile", str(prof), "--skip-probe"], tmp_path / "mac.log"
        )
        head.wait(lambda s: s["state"] == "ready", 120, "decode llama-server ready")
        route_status = head.status_path.with_name("route.json")
        head.wait(lambda s: route_status.exists(), 60, "route listening")
        assert "match: build" in head.text()
        r = lab.run("mac", "doctor", "--profile", str(prof), "--json")
        lines = {ln["check"]: ln for ln in json.loads(r.stdout)["checks"]}
        for check in ("disagg model", "slot directory", "kv-agent", "servers match"):
            assert lines[check]["verdict"] == "PASS", lines[check]

        long_prompt = prompt_of(300)
        ref, via, streamed, ref_chat, via_chat, short = ops(
            lab,
            # The decode server alone, from scratch.
            {
                "port": DECODE,
                "path": "/completion",
                "body": greedy(long_prompt, cache_prompt=False),
            },
            {"port": ROUTE, "path": "/completion", "body": greedy(long_prompt)},
            {
                "port": ROUTE,
                "path": "/completion",
                "body": greedy(long_prompt, stream=True),
                "stream": True,
            },
            {
                "port": DECODE,
                "path": "/v1/chat/completions",
                "body": chat(long_prompt, cache_prompt=False),
            },
            {"port": ROUTE, "path": "/v1/chat/completions", "body": chat(long_prompt)},
            {"port": ROUTE, "path": "/completion", "body": greedy("hi there")},
        )
        assert ref["status"] == 200, ref
        assert ref["body"]["tokens_predicted"] == 24
        # Through route, disaggregated: the same tokens, and the decode server really used
        # the restored cache (it evaluated one prompt token, the rest came over the link).
        assert via["headers"]["x-linkctl-route"] == "disaggregated", (
            via["headers"],
            head.text()[-3000:],
        )
        assert via["body"]["tokens"] == ref["body"]["tokens"]
        assert via["body"]["content"] == ref["body"]["content"]
        n_prompt = ref["body"]["tokens_evaluated"]
        assert n_prompt > THRESHOLD
        assert via["body"]["timings"]["prompt_n"] == 1, via["body"]["timings"]
        assert via["body"]["timings"]["cache_n"] == n_prompt - 1
        # route read the same from the answer: the restore took.
        assert via["headers"]["x-linkctl-cache-n"] == str(n_prompt - 1)
        assert int(via["headers"]["x-linkctl-transfer-bytes"]) > n_prompt * 6 * 2 * 256 * 2
        # Streaming, disaggregated: the same text, token by token.
        assert streamed["headers"]["x-linkctl-route"] == "disaggregated"
        pieces = [e["content"] for e in streamed["events"] if not e.get("stop")]
        assert len(pieces) >= 20 and "".join(pieces) == ref["body"]["content"]
        # The OpenAI chat endpoint: the template is applied on both servers alike.
        assert via_chat["headers"]["x-linkctl-route"] == "disaggregated", via_chat
        assert (
            via_chat["body"]["choices"][0]["message"]["content"]
            == ref_chat["body"]["choices"][0]["message"]["content"]
        )
        assert (
            via_chat["body"]["usage"]["prompt_tokens"] == ref_chat["body"]["usage"]["prompt_tokens"]
        )
        # Short prompts go straight to the decode server.
        assert short["headers"]["x-linkctl-route"] == "direct" and short["status"] == 200
        # Both servers want the API key: a client without it is refused, and nothing was
        # prefilled for it (route could not even count its tokens).
        (anon,) = ops(
            lab, {"port": ROUTE, "path": "/completion", "body": greedy(long_prompt), "headers": {}}
        )
        assert anon["status"] == 401 and anon["headers"]["x-linkctl-route"] == "direct", anon
        # Every restore took (the completion, the stream, the chat), so none was a no-op.
        restores = route_stats(lab)["restores"]["models"]
        assert restores == {model["path"]: {"took": 3, "noops": 0, "in_a_row": 0, "stopped": False}}

        # Kill the prefill server while route prefills there: the request still succeeds,
        # prefilled on the decode host, with the same tokens.
        long2 = prompt_of(1500, seed=3)
        ref2, fell = ops(
            lab,
            {"port": DECODE, "path": "/completion", "body": greedy(long2, cache_prompt=False)},
            {
                "port": ROUTE,
                "path": "/completion",
                "body": greedy(long2),
                "kill": {"status": str(pre.status_path), "stages": ["prefill", "save", "transfer"]},
            },
        )
        assert fell["killed"], fell
        assert fell["status"] == 200, fell
        assert fell["headers"]["x-linkctl-route"] == "fallback", (fell["headers"], fell["killed"])
        assert fell["body"]["tokens"] == ref2["body"]["tokens"]
        assert fell["body"]["timings"]["prompt_n"] == ref2["body"]["tokens_evaluated"]
        assert "prefilling on the decode host" in head.text()

        # The supervisor brings the prefill server back; route disaggregates again.
        pre.wait(lambda s: s["starts"] >= 2 and s["state"] == "ready", 120, "prefill restart")
        (again,) = ops(lab, {"port": ROUTE, "path": "/completion", "body": greedy(long2)})
        assert again["headers"]["x-linkctl-route"] == "disaggregated", again["headers"]
        assert again["body"]["tokens"] == ref2["body"]["tokens"]

        # route refuses a decode model that is not the prefill host's file, naming it.
        other = write_tiny_llama(
            tmp_path / "other.gguf", TinySpec(n_layer=6, n_embd=256, n_ff=512, n_ctx=4096, seed=1)
        )
        r = lab.run(
            "mac", "route", "--profile", str(prof), "--model", other["path"], "--wait", "10"
        )
        assert r.returncode == 2, r.stderr
        assert "the decode and prefill servers differ: model file: decode" in r.stderr, r.stderr
    finally:
        if head:
            head.stop()
        pre.stop()


@pytest.mark.parametrize(
    "raw, path, target",
    [
        ("/slots/0?action=erase", "/slots/0", "/slots/0?action=erase"),
        ("/%73lots/0?action=save", "/slots/0", "/slots/0?action=save"),  # decoded
        ("/v1/../slots/1?action=restore", "/slots/1", "/slots/1?action=restore"),
        ("/./slots", "/slots", "/slots"),
        ("//slots/0?action=erase", "/slots/0", "/slots/0?action=erase"),  # not an authority
        ("http://h/%73lots/0?action=save", "/slots/0", "/slots/0?action=save"),
        ("/v1/chat/completions", "/v1/chat/completions", "/v1/chat/completions"),
        ("/slotsx", "/slotsx", "/slotsx"),
    ],
)
def test_the_slot_guard_sees_the_path_the_server_will(raw, path, target):
    from linkctl.disagg.route import request_path

    assert request_path(raw) == (path, target)


def test_compare_servers_names_each_difference():
    from linkctl.disagg.pair import compare_servers

    a = {
        "build_info": "b1-abc",
        "model_ftype": "F32",
        "total_slots": 1,
        "chat_template": "t",
        "default_generation_settings": {"n_ctx": 4096},
    }
    assert compare_servers(a, dict(a)) == []
    b = a | {"build_info": "b2-def", "default_generation_settings": {"n_ctx": 2048}}
    diffs = compare_servers(a, b)
    assert len(diffs) == 2
    assert "llama.cpp build (build_info): decode 'b1-abc', prefill 'b2-def'" in diffs[0]
    assert "n_ctx" in diffs[1] and "4096" in diffs[1] and "2048" in diffs[1]


def test_kv_cache_flags_that_differ_are_named():
    from linkctl.disagg.fingerprint import ModelFingerprint
    from linkctl.llama.invocation import KvLayout, ServerInvocation

    def layout(*extra: str) -> KvLayout:
        return ServerInvocation("llama-server", "m.gguf").with_extra(extra, "serve.extra_args").kv

    default = layout()
    assert default == KvLayout("f16", "f16", "auto")
    assert layout("-ctk", "f16") == default

    def fp(kv: KvLayout | None) -> ModelFingerprint:
        return ModelFingerprint("/m.gguf", 4, "ab", kv)

    other = layout("--cache-type-v", "q4_0", "-fa", "off")
    assert [d.text("decode", "prefill") for d in fp(default).diff(fp(other))] == [
        "KV cache cache_type_v: decode f16, prefill q4_0",
        "KV cache flash_attn: decode auto, prefill off",
    ]
    # An agent that reports no layout (an older linkctl) is not compared.
    assert fp(default).diff(fp(None)) == []
    # Another file is named as a whole, whatever its path.
    moved = ModelFingerprint("/elsewhere/m.gguf", 4, "ab", default)
    assert fp(default).diff(moved) == []
    assert [d.field for d in fp(default).diff(ModelFingerprint("/m.gguf", 5, "cd"))] == [
        "model file"
    ]
