"""route checks that every restore took (issue 24, item 4), and says ahead of serving
when a model's restores are known not to (estimate, doctor).

llama-server's slot restore can report success and reuse nothing: for sliding-window,
recurrent and hybrid models a slot file carries no context checkpoint, and the next
request prefills the whole prompt again (llama.cpp #25913, #26676, #27813, #28194).
Here the parsing and the counting, on bytes and on a Router with no server; the lab
fault (a tiny gemma2 whose restores reuse nothing, served disaggregated by the real
llama-server) is in tests/test_watch.py with the watch's other faults.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from linkctl.disagg.router import (
    MAX_EVENT_BYTES,
    EventSniffer,
    RouteConfig,
    Router,
    Timings,
    timings_of,
)
from linkctl.estimate.cost import GIB, LinkFigures, Participant
from linkctl.gguf.tiny import TinySpec, write_tiny_llama
from linkctl.llama.client import LlamaServer
from support.catalog_kit import dev

MODEL = "/models/m.gguf"
LINK = LinkFigures(rtt_us=100.0, throughput_gbps=10.0)
PARTS = [
    Participant("dgx", "rpc", dev("gb", 273.0, tflops=100.0), 120 * GIB),
    Participant("mac", "head", dev("m2", 800.0, tflops=30.0), 120 * GIB),
]
SETTINGS = {"generation_settings": {"n_predict": 8, "samplers": ["top_k"] * 50}}


def final_event(cache_n: int, **extra) -> dict:
    """The shape of llama-server's last /completion event (b11434)."""
    return {"content": "", "stop": True, "model": MODEL, "tokens_predicted": 8} | (
        SETTINGS | {"timings": {"cache_n": cache_n, "prompt_n": 1, "predicted_n": 8}} | extra
    )


def sse(*events: dict | str) -> bytes:
    return b"".join(
        b"data: " + (e if isinstance(e, str) else json.dumps(e)).encode() + b"\n\n" for e in events
    )


def test_timings_from_a_json_answer():
    assert timings_of(json.dumps(final_event(299)).encode()) == Timings(299, MODEL)
    # The OpenAI shape carries them beside choices and usage.
    chat = {"choices": [], "model": "alias", "timings": {"cache_n": 0, "prompt_n": 300}}
    assert timings_of(json.dumps(chat).encode()) == Timings(0, "alias")
    for bad in (b"", b"not json", b"\xff\xfe", b"[1]", b'{"timings": {"cache_n": true}}'):
        assert timings_of(bad) is None, bad
    assert timings_of(b'{"error": {"code": 500, "message": "x"}}') is None


@pytest.mark.parametrize("size", [1, 2, 7, 64, 4096])
def test_timings_are_read_from_a_stream_cut_anywhere(size):
    """The last event carrying timings counts: the usage chunk after the finish chunk
    (stream_options.include_usage), whatever the chunk boundaries."""
    token = {"content": "x", "stop": False}
    finish = {"choices": [{"delta": {}}], "model": MODEL, "timings": {"cache_n": 5}}
    usage = {"choices": [], "model": MODEL, "usage": {}, "timings": {"cache_n": 6}}
    stream = sse(token, token, finish, usage, "[DONE]")
    sniff = EventSniffer()
    for i in range(0, len(stream), size):
        sniff.feed(stream[i : i + size])
    assert sniff.timings == Timings(6, MODEL)
    # /completion's stream ends with its final event, no [DONE].
    stream = sse(token, final_event(17))
    sniff = EventSniffer()
    for i in range(0, len(stream), size):
        sniff.feed(stream[i : i + size])
    assert sniff.timings == Timings(17, MODEL)


def test_a_line_past_the_bound_is_skipped_not_held():
    sniff = EventSniffer()
    sniff.feed(b"data: " + b"x" * (MAX_EVENT_BYTES + 10))
    sniff.feed(b"y" * 1000)  # still the same line: not kept
    assert len(sniff._line) == 0
    sniff.feed(b'"timings": {"cache_n": 3}}\n\n' + sse(final_event(9)))
    assert sniff.timings == Timings(9, MODEL)
    sniff.feed(sse({"error": "the server went away"}))  # an event without timings
    assert sniff.timings == Timings(9, MODEL)


def router(tmp_path: Path, log: io.StringIO, stop: int = 3) -> Router:
    nowhere = LlamaServer("127.0.0.1", 9)  # the decisions below ask no server
    cfg = RouteConfig(
        decode=nowhere,
        decode_slot_dir=tmp_path,
        prefill=nowhere,
        agent_host="127.0.0.1",
        threshold_tokens=8,
        restore_noops_to_stop=stop,
    )
    return Router(cfg, log=log)


def generation(r: Router, cache_n: int, model: str = MODEL, n: int = 40):
    """One long prompt through ``r``: decided, restored (n tokens), answered."""
    o = r.begin("/completion")
    if not r.decide("/completion", {"prompt": list(range(n))}, {}, o):
        o.route = "direct"
    else:
        o.route, o.restored_tokens = "disaggregated", n
    r.answered(o, Timings(cache_n, model))
    r.done(o)
    return o


def test_no_ops_in_a_row_stop_transfers_for_that_model(tmp_path):
    log = io.StringIO()
    r = router(tmp_path, log)
    took = generation(r, 39)
    assert (took.route, took.restore_took, took.cache_n) == ("disaggregated", True, 39)
    # Two that reuse nothing, one that took: the count in a row starts again.
    for _ in range(2):
        o = generation(r, 0)
        assert (o.route, o.restore_took) == ("fallback", False)
        assert o.reason == "restore reused nothing (cache_n 0 of 40)"
        assert o.headers()["X-Linkctl-Cache-N"] == "0"
    assert generation(r, 39).restore_took
    health = r.stats()["restores"]["models"][MODEL]
    assert health == {"took": 2, "noops": 2, "in_a_row": 0, "stopped": False}
    # Partly reused is not taken either: the decode server prefilled the rest.
    part = generation(r, 20)
    assert part.reason == "restore reused only 20 tokens (cache_n 20 of 40)"
    generation(r, 0)
    assert not r.stats()["restores"]["models"][MODEL]["stopped"]
    generation(r, 0)
    st = r.stats()
    assert st["restores"] == {
        "stop_after": 3,
        "models": {MODEL: {"took": 2, "noops": 5, "in_a_row": 3, "stopped": True}},
    }
    # Stopped: a long prompt goes straight to the decode server, and says why.
    o = generation(r, 39)
    assert o.route == "direct" and o.restore_took is None
    assert o.reason == f"restores did not take 3 times in a row for {MODEL}: prefilling here"
    assert st["counts"]["fallback"] == 5
    said = log.getvalue()
    assert said.count("did not take: restore reused") == 5
    assert f"restores did not take 3 times in a row for {MODEL}: no more transfers" in said
    # The decode server now serves another model (an answer says so): it transfers again.
    assert generation(r, 0, model="other.gguf").route == "direct"
    assert generation(r, 39, model="other.gguf").route == "disaggregated"
    # An answer without timings (an error, a stream cut short) teaches nothing.
    o = r.begin("/completion")
    o.route, o.restored_tokens = "disaggregated", 40
    r.answered(o, None)
    assert (o.route, o.restore_took) == ("disaggregated", None)


def test_estimate_and_doctor_name_models_whose_restores_do_not_take(tmp_path):
    from linkctl.core.checks import Verdict
    from linkctl.disagg.checks import restore_check
    from linkctl.estimate.notes import NoteKind
    from linkctl.estimate.ttft import predict, restore_risk
    from linkctl.gguf.info import read_model

    swa = write_tiny_llama(tmp_path / "swa.gguf", TinySpec(sliding_window=32))["path"]
    dense = write_tiny_llama(tmp_path / "dense.gguf")["path"]
    risk = restore_risk(read_model(swa))
    assert risk is not None and (risk.architecture, risk.kind) == ("gemma2", "sliding-window")
    assert risk.evidence == "gemma2.attention.sliding_window = 32"
    assert restore_risk(read_model(dense)) is None
    for arch, keys, attn, kind in (
        ("mamba", {"ssm.conv_kernel": 4, "ssm.state_size": 16}, False, "recurrent"),
        ("jamba", {"ssm.conv_kernel": 4}, True, "hybrid"),
        ("rwkv7", {"wkv.head_size": 64}, False, "recurrent"),
        ("lfm2", {"shortconv.l_cache": 3}, True, "hybrid"),
    ):
        got = restore_risk(
            read_model(recurrent_header(tmp_path / f"{arch}.gguf", arch, keys, attn))
        )
        assert got is not None and got.kind == kind, (arch, got)
        assert got.evidence == f"{arch}.{sorted(keys)[0]}"

    def serving_notes(path: str) -> list[str]:
        de = predict(read_model(path), PARTS, LINK, 512, 256, 16, "dgx")
        return [n.text for n in de.notes if n.kind is NoteKind.DISAGGREGATED]

    notes = serving_notes(swa)
    assert any("gemma2 is a sliding-window model" in n and "#28194" in n for n in notes), notes
    assert not [n for n in serving_notes(dense) if "#28194" in n]

    warn, ok = restore_check(swa), restore_check(dense)
    assert (warn.name, warn.verdict, warn.value) == ("slot restores", Verdict.WARN, "gemma2")
    assert "reuse nothing" in warn.detail and warn.fix
    assert (ok.verdict, ok.value) == (Verdict.PASS, "llama")


def recurrent_header(path: Path, arch: str, keys: dict[str, int], attn: bool) -> Path:
    """A small GGUF of a recurrent (or, with attention tensors, hybrid) architecture:
    the header keys and tensor names restore_risk reads, tiny tensors."""
    import gguf
    import numpy as np

    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(1)
    w.add_embedding_length(8)
    for k, v in keys.items():
        w.add_uint32(f"{arch}.{k}", v)
    names = ["token_embd.weight", "blk.0.ssm_in.weight"]
    names += ["blk.0.attn_q.weight"] if attn else []
    for name in names:
        w.add_tensor(name, np.zeros((8, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
