"""TTFT / end-to-end predictions for local, layer split and disaggregated serving,
and the disaggregated-mode profile fields."""

from __future__ import annotations

import json

import pytest

from linkctl.core.errors import InputError
from linkctl.core.profile import parse_profile
from linkctl.estimate.cost import GIB, LinkFigures, Participant
from linkctl.estimate.ttft import (
    DISAGG_FIXED_S,
    KV_CELL_EXTRA_BYTES,
    KV_FILE_HEADER_BYTES,
    STATE_IO_GBS,
    kv_file_bytes,
    predict,
    predict_for_profile,
    threshold,
)
from linkctl.gguf.info import read_model
from support.catalog_kit import dev
from support.cli import linkctl
from support.ggufshapes import LLAMA_70B, QWEN3_235B_A22B, write_header_only

LINK = LinkFigures(rtt_us=100.0, throughput_gbps=10.0)


@pytest.fixture(scope="module")
def m70(tmp_path_factory):
    return read_model(write_header_only(tmp_path_factory.mktemp("d") / "70b.gguf", LLAMA_70B))


def parts(head_tflops=30.0, rpc_tflops=100.0, head_bw=800.0, rpc_bw=273.0):
    return [
        Participant("dgx", "rpc", dev("gb", rpc_bw, tflops=rpc_tflops), 120 * GIB),
        Participant("mac", "head", dev("m2", head_bw, tflops=head_tflops), 120 * GIB),
    ]


def test_kv_bytes_per_token_from_the_header(m70):
    # Llama-3-70B: 80 layers x 8 KV heads x (128 + 128) x 2 bytes (f16) = 320 KiB/token.
    assert m70.block_count * m70.kv_bytes_per_token_per_layer == 80 * 8 * 256 * 2
    assert kv_file_bytes(m70, 1000) == KV_FILE_HEADER_BYTES + 1000 * (327680 + KV_CELL_EXTRA_BYTES)


def test_disaggregated_terms_add_up_and_win_long_prompts(m70):
    de = predict(m70, parts(), LINK, 8192, 4096, 128, "dgx")
    plans = {p.name: p for p in de.plans}
    assert set(plans) == {"local", "split", "disaggregated"}
    d, loc = plans["disaggregated"], plans["local"]
    kv = kv_file_bytes(m70, 4096)
    assert d.kv_bytes == kv
    assert d.transfer_s == pytest.approx(
        kv * 8 / 10e9 + 2 * kv / (STATE_IO_GBS * 1e9) + DISAGG_FIXED_S
    )
    assert d.ttft_s == pytest.approx(sum(v for k, v in d.terms_s.items() if k != "decode"))
    assert d.total_s == pytest.approx(d.ttft_s + d.terms_s["decode"])
    # Decode runs on the head either way; the prefill ran on the 3x faster host.
    assert d.decode_tok_s == loc.decode_tok_s
    assert d.prefill_s < loc.prefill_s / 2
    assert de.winner_ttft == "disaggregated" and d.ttft_s < loc.ttft_s


def test_threshold_is_where_the_gain_turns_positive(m70):
    p = parts()
    t = threshold(m70, p[1], p[0], LINK, 8192)
    assert t is not None and 1 < t < 8192
    at = predict(m70, p, LINK, 8192, t, 1, "dgx").plans
    below = predict(m70, p, LINK, 8192, t - 1, 1, "dgx").plans
    ttft = lambda plans, n: next(x.ttft_s for x in plans if x.name == n)  # noqa: E731
    assert ttft(at, "disaggregated") < ttft(at, "local")
    assert ttft(below, "disaggregated") >= ttft(below, "local")
    # A slower link moves the threshold up; a prefill host no faster than the head: never.
    slow = LinkFigures(rtt_us=100.0, throughput_gbps=1.0)
    assert threshold(m70, p[1], p[0], slow, 8192) > t
    same = parts(rpc_tflops=30.0, rpc_bw=800.0)
    assert threshold(m70, same[1], same[0], LINK, 8192) is None


def test_no_disaggregated_plan_when_the_model_fits_neither_host_alone(tmp_path):
    moe = read_model(write_header_only(tmp_path / "moe.gguf", QWEN3_235B_A22B))
    de = predict(moe, parts(), LINK, 4096, 2048, 16, "dgx")
    assert [p.name for p in de.plans] == ["local", "split"]
    assert de.threshold_tokens is None and de.winner_ttft == "split"
    assert any("does not fit each host alone" in n.text for n in de.notes)


def test_predict_refuses_bad_lengths(m70):
    with pytest.raises(InputError, match="at least 1"):
        predict(m70, parts(), LINK, 8192, 0, 10, "dgx")


def test_cli_estimate_prints_the_three_plans(tmp_path):
    import os

    p = write_header_only(tmp_path / "70b.gguf", LLAMA_70B)
    env = dict(os.environ, LINKCTL_STATE_DIR=str(tmp_path / "state"))
    args = ["estimate", "--model", str(p), "--rtt-us", "150", "--throughput-gbps", "9.4"]
    r = linkctl(*args, "--prompt", "4096", "--output", "64", "--json", env=env)
    assert r.returncode == 0, r.stderr
    s = json.loads(r.stdout)["serving"]
    assert [x["name"] for x in s["plans"]] == ["local", "split", "disaggregated"]
    assert s["prompt_tokens"] == 4096 and s["output_tokens"] == 64
    assert s["winner_ttft"] in ("local", "split", "disaggregated")
    r = linkctl(*args, "--prompt", "4096", env=env)
    assert r.returncode == 0, r.stderr
    assert "Serving one request: 4096 prompt tokens" in r.stdout
    assert "Fastest first token:" in r.stdout


BASE = {
    "name": "t",
    "link": {"subnet": "192.168.100.0/24"},
    "hosts": [
        {
            "name": "dgx",
            "os": "linux",
            "interface": "e",
            "address": "192.168.100.2/24",
            "role": "rpc",
        },
        {
            "name": "mac",
            "os": "macos",
            "interface": "en0",
            "address": "192.168.100.1/24",
            "role": "head",
        },
    ],
}


def test_profile_disaggregated_mode_defaults_and_refusals():
    p = parse_profile(BASE | {"serve": {"mode": "disaggregated"}})
    assert p.serve.mode == "disaggregated" and p.prefill_host.name == "dgx"
    assert p.serve.disagg.threshold_tokens is None
    for serve, msg in (
        ({"mode": "disaggregated", "disagg": {"prefill_host": "mac"}}, "is not an rpc host"),
        ({"mode": "disaggregated", "disagg": {"decode_port": 9999}}, "is serve.port"),
        ({"mode": "disaggregated", "disagg": {"agent_port": 8081}}, "prefill_port"),
        ({"mode": "layers"}, "serve.mode"),
        ({"disagg": {"slots": 0}}, "serve.disagg.slots"),
    ):
        with pytest.raises(InputError, match=msg):
            parse_profile(BASE | {"serve": serve})


def test_route_threshold_from_flag_profile_or_estimate(tmp_path, monkeypatch, m70):
    from linkctl.disagg.plan import resolve_route_config

    monkeypatch.setenv("LINKCTL_STATE_DIR", str(tmp_path / "state"))  # no probe report
    hosts = [h | {"device": d} for h, d in zip(BASE["hosts"], ("gb10", "m2-ultra"), strict=True)]
    prof = parse_profile(BASE | {"hosts": hosts, "serve": {"mode": "disaggregated"}})
    cfg = resolve_route_config(prof, m70.path)
    assert cfg.threshold_tokens == 512 and "no estimate" in cfg.threshold_source
    assert "probe report" in cfg.threshold_source
    assert resolve_route_config(prof, m70.path, 77).threshold_tokens == 77
    # With the probe report's link figures: the estimate's threshold, which the
    # threshold() search found (same arithmetic, same devices).
    report = tmp_path / "state" / "probe" / "latest.json"
    report.parent.mkdir(parents=True)
    report.write_text(
        json.dumps(
            {
                "latency": {"tcp": {"1": {"p50_us": 90.0}}},
                "throughput": {"fwd_p1": {"gbps": 9.4}},
            }
        )
    )
    cfg = resolve_route_config(prof, m70.path)
    assert cfg.threshold_source.startswith("estimate for dgx -> mac at 9.4 Gbit/s")
    de = predict_for_profile(prof, m70.path, prompt=cfg.threshold_tokens, output=1)
    ttft = {p.name: p.ttft_s for p in de.plans}
    assert ttft["disaggregated"] < ttft["local"]
    fixed = parse_profile(
        BASE | {"serve": {"mode": "disaggregated", "disagg": {"threshold_tokens": 300}}}
    )
    cfg = resolve_route_config(fixed, m70.path)
    assert (cfg.threshold_tokens, cfg.threshold_source) == (300, "serve.disagg.threshold_tokens")
    # Transfers and the prefill server are reached from and at the link addresses.
    assert cfg.source == "192.168.100.1" and cfg.agent_host == "192.168.100.2"
    assert cfg.prefill is not None and cfg.prefill.source == "192.168.100.1"
    assert cfg.decode.host == "127.0.0.1"
