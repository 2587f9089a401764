"""The serving overhead (linkctl.estimate.serving): llama-server's cost per token beyond
llama-bench's, its measured constants, `estimate`'s llama-server figures, and the tiny
model at a real vocabulary size through the real llama-bench that scripts/build-llama.sh
now builds."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from linkctl.estimate.serving import (
    SamplerSettings,
    ServingTerms,
    load_terms,
    served,
    serving_overhead,
)
from linkctl.gguf.info import read_model
from support.cli import IN_CI, linkctl
from support.ggufshapes import LLAMA_70B, write_header_only

TERMS = ServingTerms(
    fixed_us=100.0,
    vocab_ns=2.0,
    stream_fixed_us=50.0,
    stream_vocab_ns=0.5,
    penalties_fixed_us=10.0,
    penalties_vocab_ns=5.0,
    ctx_32k_fixed_us=20.0,
    ctx_32k_vocab_ns=0.0,
    build="b1",
    cpu="cpu",
    command="cmd",
    measured="then",
)


def test_overhead_is_fixed_plus_a_pass_over_the_vocabulary():
    a = serving_overhead(32_000, terms=TERMS, stream=False)
    b = serving_overhead(152_000, terms=TERMS, stream=False)
    assert a.fixed_us == b.fixed_us == 100.0
    assert a.vocab_us == pytest.approx(64.0) and b.vocab_us == pytest.approx(304.0)
    assert b.us == pytest.approx(404.0) and not b.unpriced
    # streamed (the default): the SSE chunk per token on top
    s = serving_overhead(152_000, terms=TERMS)
    assert s.stream and s.us - b.us == pytest.approx(50.0 + 0.5 * 152)


def test_penalties_and_a_large_ctx_add_their_measured_terms():
    base = serving_overhead(100_000, terms=TERMS)
    pen = serving_overhead(100_000, SamplerSettings(repeat_penalty=1.1), terms=TERMS)
    assert pen.us - base.us == pytest.approx(10.0 + 5.0 * 100)
    # a neutral penalty is llama.cpp's empty sampler (llama_sampler_init_penalties)
    assert not SamplerSettings(repeat_penalty=1.1, penalty_last_n=0).penalties
    assert not SamplerSettings().penalties
    big = serving_overhead(100_000, ctx=32768, terms=TERMS)
    assert big.us - base.us == pytest.approx(20.0)


def test_settings_it_cannot_price_are_said():
    o = serving_overhead(32_000, SamplerSettings(top_k=0, n_probs=5), terms=TERMS)
    assert len(o.unpriced) == 2 and "top_k 0" in o.unpriced[0] and "n_probs 5" in o.unpriced[1]


def test_served_adds_the_overhead_and_only_its_vocab_part_on_a_calibrated_head():
    o = serving_overhead(100_000, terms=TERMS, stream=False)  # 100 + 200 us
    sv = served({"local": (100.0, 90.0, 110.0)}, o)
    (r,) = sv.rows
    assert r.bench_tok_s == 100.0 and r.server_tok_s == pytest.approx(1e6 / (10_000 + 300))
    assert r.server_tok_s_low < r.server_tok_s < r.server_tok_s_high
    cal = served({"local": (100.0, 90.0, 110.0)}, o, head_calibrated=True)
    assert cal.added_us == pytest.approx(200.0)  # all but the plain fixed part (100)
    assert cal.rows[0].server_tok_s == pytest.approx(1e6 / 10_200)
    # streamed: the stream's part is not in a calibration (plain requests), so it is added
    streamed = served({"local": (100.0, 90.0, 110.0)}, serving_overhead(100_000, terms=TERMS), True)
    assert streamed.added_us == pytest.approx(200.0 + 50.0 + 0.5 * 100)


def test_the_shipped_terms_are_measured_and_say_where_from():
    t = load_terms()
    assert t.build.startswith("b") and t.build != "b0"
    assert "bench/serving_overhead.py" in t.command and t.cpu and t.measured
    assert t.fixed_us > 0 and t.vocab_ns > 0
    o = serving_overhead(151_936)
    assert o.us > serving_overhead(32_000).us > 0
    assert t.build in o.source and t.cpu in o.source


def test_estimate_prints_llama_server_beside_llama_bench(tmp_path, env):
    p = write_header_only(tmp_path / "70b.gguf", LLAMA_70B)
    what_if = ("--rtt-us", "150", "--throughput-gbps", "9.4", "--ctx", "4096")
    r = linkctl("estimate", "--model", str(p), *what_if, "--json", env=env)
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    ls = d["llama_server"]
    assert ls["overhead"]["n_vocab"] == 128256 and ls["overhead"]["ctx"] == 4096
    rows = {x["scenario"]: x for x in ls["rows"]}
    assert set(rows) == {"local", "split", "recommended"}
    assert rows["local"]["bench_tok_s"] == d["local"]["decode_tok_s"]
    assert 0 < rows["local"]["server_tok_s"] < rows["local"]["bench_tok_s"]
    assert "llama-server" in ls["predicts"]
    r = linkctl("estimate", "--model", str(p), *what_if, env=env)
    assert r.returncode == 0, r.stderr
    assert "what llama-server delivers" in r.stdout and "llama-bench" in r.stdout
    assert "serving overhead" in r.stdout and "128,256-token vocabulary" in r.stdout


def test_tiny_model_takes_a_vocabulary_size(tmp_path):
    from linkctl.core.errors import InputError
    from linkctl.gguf.tiny import N_VOCAB, TinySpec, write_tiny_llama

    out = write_tiny_llama(tmp_path / "v.gguf", TinySpec(n_embd=16, n_head=2, n_vocab=32000))
    assert out["vocab"] == 32000 and read_model(out["path"]).vocab_size == 32000
    small = write_tiny_llama(tmp_path / "s.gguf", TinySpec())
    assert small["vocab"] == N_VOCAB == read_model(small["path"]).vocab_size
    with pytest.raises(InputError):
        TinySpec(n_vocab=100).check()


def llama_bench() -> Path:
    from linkctl.llama.bins import find_bins

    bins = find_bins(versions=False)
    srv = bins.llama_server
    bench = Path(srv.path).with_name("llama-bench") if srv else None
    if bench is None or not bench.exists():
        msg = "llama-bench not built; run scripts/build-llama.sh"
        if IN_CI:
            pytest.fail(msg)
        pytest.skip(msg)
    return bench


def test_llama_bench_is_built_beside_llama_server_and_runs_a_tiny_vocab_model(tmp_path):
    """The binary bench/serving_overhead.py takes its reference from: built by
    scripts/build-llama.sh next to llama-server, and it decodes the tiny model at a
    32k vocabulary (llama.cpp loads the added tokens)."""
    from linkctl.gguf.tiny import TinySpec, write_tiny_llama

    bench = llama_bench()
    m = write_tiny_llama(tmp_path / "v.gguf", TinySpec(n_embd=16, n_head=2, n_vocab=32000))
    argv = [str(bench), "-m", m["path"], "-p", "0", "-n", "8", "-r", "1", "-t", "1", "-o", "json"]
    r = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    (row,) = json.loads(r.stdout)
    # (build_number is 0: the source package's binaries carry no git build number)
    assert row["n_gen"] == 8 and row["avg_ts"] > 0
