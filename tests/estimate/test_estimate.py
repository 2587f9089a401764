"""The estimate model (pure arithmetic on header-only model shapes) and the CLI."""

from __future__ import annotations

import json

import pytest

from linkctl.core.errors import InputError
from linkctl.estimate.advice import Because
from linkctl.estimate.catalog import load_catalog
from linkctl.estimate.cost import (
    GIB,
    RPC_ROUND_TRIPS_PER_TOKEN,
    RPC_TOKEN_EXTRA_BYTES,
    LinkFigures,
    Participant,
    estimate,
    scenario,
)
from linkctl.estimate.features import DEFAULT_UBATCH
from linkctl.estimate.layers import llama_slot_devices, slots_from_counts
from linkctl.estimate.report import reason
from linkctl.gguf.info import read_model
from support.catalog_kit import dev
from support.cli import error_lines, linkctl
from support.ggufshapes import LLAMA_7B, LLAMA_70B, QWEN3_235B_A22B, write_header_only
from support.paths import PROFILES


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("est")
    return {
        "7b": read_model(write_header_only(d / "7b.gguf", LLAMA_7B)),
        "70b": read_model(write_header_only(d / "70b.gguf", LLAMA_70B)),
        "moe": read_model(write_header_only(d / "moe.gguf", QWEN3_235B_A22B)),
    }


def pair(head_bw=400.0, rpc_bw=200.0, head_gib=200.0, rpc_gib=200.0, overhead=0.0):
    return [
        Participant("rpc", "rpc", dev("r", rpc_bw), rpc_gib * GIB, rpc_overhead_us=overhead),
        Participant("head", "head", dev("h", head_bw), head_gib * GIB),
    ]


LINK = LinkFigures(rtt_us=100.0, throughput_gbps=10.0)


def test_llama_split_rule_matches_layer_counts():
    """Integer weights reproduce exactly those slot counts (llama.cpp's float32 rule)."""
    for n_layer in (1, 7, 32, 80, 94):
        for a in range(0, n_layer + 2, max(1, n_layer // 7)):
            counts = [a, n_layer + 1 - a]
            assert llama_slot_devices(n_layer, [float(c) for c in counts]) == slots_from_counts(
                counts
            ), (n_layer, counts)


def test_default_split_is_proportional_to_free_memory():
    slots = llama_slot_devices(80, [128.0, 192.0])
    first = slots.count(0)
    assert abs(first - 81 * 128 / 320) <= 1
    assert slots[-1] == 1  # the output layer goes to the last device (the head's GPU)


def test_local_decode_is_bytes_over_bandwidth(models):
    m = models["7b"]
    parts = pair()
    sc = scenario("local", m, parts[1:], llama_slot_devices(m.block_count, [1.0]), 1, None)
    read = sum(m.layer_active_bytes()) + m.output_bytes + m.kv_bytes_per_token_per_layer * 32
    assert sc.decode_us == pytest.approx(read / 400e9 * 1e6)
    assert sc.network_us == 0


def test_split_adds_round_trips_and_transfer(models):
    m = models["7b"]
    parts = pair()
    counts = [16, 17]  # 16 blocks on rpc, 16 blocks + output on the head
    a = scenario("s", m, parts, slots_from_counts(counts), 1, LINK)
    b = scenario(
        "s",
        m,
        parts,
        slots_from_counts(counts),
        1,
        LinkFigures(rtt_us=1100.0, throughput_gbps=10.0),
    )
    assert b.decode_us - a.decode_us == pytest.approx(RPC_ROUND_TRIPS_PER_TOKEN * 1000.0)
    assert a.round_trips_per_token == RPC_ROUND_TRIPS_PER_TOKEN
    # In and out of the rpc device: one n_embd f32 activation each way.
    wire = 2 * 4 * m.embedding_length + RPC_TOKEN_EXTRA_BYTES + 4 * 1
    assert a.bytes_crossing_per_token == wire
    assert a.network_transfer_us == pytest.approx(wire * 8 / 10e9 * 1e6)
    # Each device's time is its share of bytes over its bandwidth.
    la = m.layer_active_bytes()
    rpc_load = next(d for d in a.devices if d.host == "rpc")
    assert rpc_load.compute_us == pytest.approx(sum(la[:16]) / 200e9 * 1e6)


def test_logits_cross_the_link_when_the_output_layer_is_remote(models):
    m = models["7b"]
    parts = pair()
    sc = scenario("s", m, parts, slots_from_counts([33, 0]), 1, LINK)
    extra = RPC_TOKEN_EXTRA_BYTES + 4
    assert sc.bytes_crossing_per_token == 4 * m.embedding_length + 4 * m.vocab_size + extra


def test_rpc_overhead_is_added_per_boundary(models):
    m = models["7b"]
    a = scenario("s", m, pair(), slots_from_counts([16, 17]), 1, LINK)
    b = scenario("s", m, pair(overhead=250.0), slots_from_counts([16, 17]), 1, LINK)
    assert b.decode_us - a.decode_us == pytest.approx(250.0)


def test_kv_reads_grow_with_context(models):
    m = models["70b"]
    parts = pair()
    slots = slots_from_counts([40, 41])
    a = scenario("s", m, parts, slots, 1000, LINK, depth=1000)
    b = scenario("s", m, parts, slots, 5000, LINK, depth=5000)
    per_layer = m.kv_bytes_per_token_per_layer * 4000
    expect = per_layer * 40 / 200e9 * 1e6 + per_layer * 40 / 400e9 * 1e6
    expect += 4 * 4000 * 8 / 10e9 * 1e6  # the attention mask row on the wire
    assert b.decode_us - a.decode_us == pytest.approx(expect)


def test_moe_decode_reads_active_experts_only(models):
    m = models["moe"]
    parts = pair(head_gib=400)
    local = scenario("l", m, parts[1:], llama_slot_devices(m.block_count, [1.0]), 1, None)
    all_bytes = sum(m.layer_bytes()) + m.output_bytes
    assert local.decode_us < 0.2 * all_bytes / 400e9 * 1e6


def test_recommendation_split_needed_when_head_is_too_small(models):
    m = models["70b"]
    est = estimate(m, pair(head_gib=30, rpc_gib=30), LINK, ctx=2048)
    assert not est.fits_head_alone
    assert est.recommendation == "split needed"
    assert est.advice.because is Because.HEAD_TOO_SMALL
    assert reason(est.advice) == (
        f"the model needs {est.local.devices[0].need_bytes / GIB:.1f} GiB and the head "
        "holds 30.0 GiB"
    )
    rec = est.recommended
    assert rec is not None and rec.fits
    assert all(d.need_bytes <= d.free_bytes for d in rec.devices)
    assert sum(rec.tensor_split) == m.block_count + 1


def test_recommended_split_is_no_slower_than_any_feasible_split(models):
    m = models["70b"]
    parts = pair(head_bw=800, rpc_bw=273, head_gib=30, rpc_gib=40)
    est = estimate(m, parts, LINK, ctx=2048)
    best = est.recommended
    assert best is not None
    for a in range(0, 82, 3):
        sc = scenario("s", m, parts, slots_from_counts([a, 81 - a]), 2048, LINK)
        if sc.fits:
            assert best.decode_us <= sc.decode_us + 1e-6
    # The faster head is filled as far as its memory allows.
    head = next(d for d in best.devices if d.host == "head")
    assert head.free_bytes - head.need_bytes < 2 * max(m.layer_bytes())


def test_run_locally_when_it_fits_and_the_head_is_faster(models):
    est = estimate(models["7b"], pair(head_bw=800, rpc_bw=200), LINK, ctx=2048)
    assert est.fits_head_alone and est.recommendation == "run locally"
    assert reason(est.advice).startswith(
        f"local decode {est.local.decode_tok_s:.1f} tok/s vs best split "
        f"{est.recommended.decode_tok_s:.1f} tok/s: the link"
    )


def test_split_faster_when_the_rpc_host_is_much_faster(models):
    """A head much slower than the rpc host: moving layers there pays for the link."""
    parts = [
        Participant("rpc", "rpc", dev("r", 3000), 200 * GIB),
        Participant("head", "head", dev("h", 100), 200 * GIB),
    ]
    est = estimate(models["70b"], parts, LINK, ctx=2048)
    assert est.recommendation == "split faster"
    assert est.recommended.decode_tok_s > est.local.decode_tok_s
    assert reason(est.advice) == (
        f"split decode {est.recommended.decode_tok_s:.1f} tok/s vs local "
        f"{est.local.decode_tok_s:.1f} tok/s"
    )


def test_cpu_head_holds_no_layers(models):
    m = models["7b"]
    parts = [
        Participant("rpc", "rpc", dev("r", 50, kind="cpu"), 64 * GIB),
        Participant("head", "head", dev("h", 50, kind="cpu"), 64 * GIB),
    ]
    est = estimate(m, parts, LINK, ctx=512)
    split = est.split
    assert split.tensor_split == [m.block_count + 1]
    head = next(d for d in split.devices if d.host == "head")
    assert head.layers == [] and head.compute_us == 0
    # Everything is read on the rpc host, then the logits come back.
    assert split.decode_us == pytest.approx(est.local.decode_us + split.network_us)


def test_model_larger_than_all_devices(models):
    with pytest.raises(InputError, match=r"needs \d+\.\d GiB .* hold 20\.0 GiB together"):
        estimate(models["moe"], pair(head_gib=10, rpc_gib=10), LINK, ctx=2048)


def test_tensor_split_length_checked(models):
    with pytest.raises(InputError, match="--split has 3 weights, the split has 2"):
        estimate(models["7b"], pair(), LINK, ctx=512, tensor_split=[1, 1, 1])


def test_catalog_has_required_devices_with_sources():
    cat = load_catalog()
    for key in (
        "gb10",
        "m1-max",
        "m1-ultra",
        "m2-max",
        "m2-ultra",
        "m3-max",
        "m3-ultra",
        "m4-max",
        "rtx3090",
        "rtx4090",
        "rtx5090",
        "h100",
        "h200",
        "cpu",
    ):
        d = cat[key]
        assert 0 < d.decode.bw_gbs <= d.mem_bandwidth_gbs * 1.5 and d.decode.layer_us >= 0
        assert d.prefill.tflops > 0
        assert all(d.sources[f] for f in ("mem_bandwidth_gbs", "efficiency"))
        assert d.fit["summary"].startswith(("fitted", "assumed"))
    assert cat["cpu"].kind == "cpu"


# -- the CLI ------------------------------------------------------------------------


def test_cli_json_and_text(tmp_path, env):
    p = write_header_only(tmp_path / "70b.gguf", LLAMA_70B)
    r = linkctl(
        "estimate",
        "--model",
        str(p),
        "--rtt-us",
        "150",
        "--throughput-gbps",
        "9.4",
        "--ctx",
        "4096",
        "--json",
        env=env,
    )
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert d["link"]["rtt_us"] == 150
    assert d["split"]["round_trips_per_token"] == RPC_ROUND_TRIPS_PER_TOKEN
    assert d["recommendation"] in ("run locally", "split faster", "split needed")
    assert d["local"]["decode_tok_s"] > 0 and d["split"]["prefill_tok_s"] > 0
    assert d["network_per_layer_us"] == pytest.approx(d["network_per_token_us"] / 80)
    assert d["depth"] == 512 and d["local"]["decode_tok_s_full_ctx"] < d["local"]["decode_tok_s"]
    r = linkctl(
        "estimate", "--model", str(p), "--rtt-us", "150", "--throughput-gbps", "9.4", env=env
    )
    assert r.returncode == 0, r.stderr
    for text in (
        "fits on the head alone",
        "decode tok/s",
        "network per layer",
        "dominant term",
        "decode tok/s by depth",
        "recommended --split",
        "recommendation:",
    ):
        assert text in r.stdout


def test_cli_split_takes_serves_grammar(tmp_path, env):
    """--split as serve takes it: llama is the default split, recommended predicts the
    placement serve runs by default, weights pin the layers."""
    p = write_header_only(tmp_path / "70b.gguf", LLAMA_70B)

    def est(*split: str) -> dict:
        what_if = ("--rtt-us", "150", "--throughput-gbps", "9.4", "--ctx", "4096")
        r = linkctl("estimate", "--model", str(p), *what_if, *split, "--json", env=env)
        assert r.returncode == 0, r.stderr
        return json.loads(r.stdout)

    default, llama, rec = est(), est("--split", "llama"), est("--split", "recommended")
    assert llama["split"] == default["split"]
    counts = [int(c) for c in default["recommended_tensor_split"].split(",")]
    assert rec["split"]["tensor_split"] == counts != default["split"]["tensor_split"]
    assert rec["split"]["decode_tok_s"] == default["recommended"]["decode_tok_s"]
    pinned = est("--split", ",".join(map(str, counts)))
    assert pinned["split"] == rec["split"]


def test_depth_sets_the_kv_reads_and_ctx_only_the_allocation(models):
    """--ctx sizes the cache (memory fit); --depth is where decode is predicted."""
    m = models["70b"]
    parts = pair(head_gib=400)
    a = estimate(m, parts, LINK, ctx=32768, depth=0)
    b = estimate(m, parts, LINK, ctx=32768, depth=32768)
    c = estimate(m, parts, LINK, ctx=2048, depth=0)
    assert a.local.decode_tok_s > b.local.decode_tok_s
    assert a.local.decode_tok_s == pytest.approx(c.local.decode_tok_s)  # same depth
    assert a.local.devices[0].kv_bytes > c.local.devices[0].kv_bytes  # bigger cache
    assert a.local.decode_tok_s_depth0 == pytest.approx(a.local.decode_tok_s)
    assert a.local.decode_tok_s_full_ctx == pytest.approx(b.local.decode_tok_s)
    default = estimate(m, parts, LINK, ctx=32768, n_prompt=512)
    assert default.depth == 512  # default: right after the prompt
    with pytest.raises(InputError, match="--depth 40000: must be between 0 and --ctx 32768"):
        estimate(m, parts, LINK, ctx=32768, depth=40000)


def test_sliding_window_blocks_read_window_plus_ubatch(tmp_path):
    from linkctl.gguf.shapes import model_info

    m = model_info("gpt-oss-20b", "MXFP4")
    swa = m.swa_layers()
    assert len(swa) == m.block_count // 2 and 0 in swa and 1 not in swa
    assert m.kv_positions(0, 100_000, 512) == 128 + 512
    assert m.kv_positions(1, 100_000, 512) == 100_000


def test_metal_flash_attention_reads_only_a_sliding_window_blocks_window():
    """Metal's flash-attention kernels skip the cache chunks the mask fully masks
    (ggml-metal.metal, "skip -INF blocks"); CUDA's one-sequence decode runs over the whole
    view (fattn-common.cuh scans the mask only for >= 1024 queries or several sequences).
    So a sliding-window block reads its window on an Apple device and window + micro-batch
    on an NVIDIA one, and the estimate follows the device's family."""
    from dataclasses import replace

    from linkctl.estimate.features import skips_masked_kv
    from linkctl.gguf.shapes import model_info

    assert skips_masked_kv("apple") and not skips_masked_kv("apple", flash_attn=False)
    assert not skips_masked_kv("nvidia") and not skips_masked_kv("cpu")
    m = model_info("gemma-3-4b", "Q4_0+embd=Q8_0")  # 5 local blocks per global one
    local, glob = 0, 5
    assert local in m.swa_layers() and glob not in m.swa_layers()
    w = m.sliding_window
    assert m.kv_positions(local, 8192, 2048) == w + 2048
    assert m.kv_positions(local, 8192, 2048, skips_masked=True) == w
    assert m.kv_positions(local, 100, 2048, skips_masked=True) == 100
    assert m.kv_positions(glob, 8192, 2048, skips_masked=True) == 8192
    mac = next(d for d in load_catalog().values() if d.family == "apple")
    as_cuda = replace(mac, family="nvidia")
    parts = [Participant("head", "head", d, 100 * GIB) for d in (mac, as_cuda)]
    on_mac, on_cuda = (estimate(m, [p], None, ctx=32768, depth=16384).local for p in parts)
    kv_bytes = m.kv_bytes_per_token_per_layer * len(m.swa_layers()) * DEFAULT_UBATCH
    read_mac, read_cuda = (s.devices[0].read_bytes_per_token for s in (on_mac, on_cuda))
    assert read_cuda - read_mac == pytest.approx(kv_bytes, abs=8)
    assert on_mac.decode_tok_s > on_cuda.decode_tok_s


def test_cli_probe_takes_what_probe_json_prints(tmp_path, env):
    """--probe FILE: `linkctl probe --json` prints a list (one report per peer): a list
    of one is that link; several are refused (exit 2) asking for one peer's."""
    p = write_header_only(tmp_path / "7b.gguf", LLAMA_7B)
    one = {
        "latency": {"tcp": {"1": {"p50_us": 87.5, "p99_us": 120}}},
        "throughput": {"fwd_p1": {"gbps": 9.41, "retransmits": 0}},
    }
    for name, data in (("list.json", [one]), ("saved.json", one)):
        (tmp_path / name).write_text(json.dumps(data))
        r = linkctl(
            "estimate", "--model", str(p), "--probe", str(tmp_path / name), "--json", env=env
        )
        assert r.returncode == 0, r.stderr
        assert json.loads(r.stdout)["link"]["rtt_us"] == 87.5
    (tmp_path / "two.json").write_text(json.dumps([one, one]))
    r = linkctl("estimate", "--model", str(p), "--probe", str(tmp_path / "two.json"), env=env)
    assert r.returncode == 2 and "2 reports, one per peer" in r.stderr
    assert "linkctl probe --peer NAME --json" in r.stderr


def test_cli_uses_the_saved_probe_report(tmp_path, env):
    p = write_header_only(tmp_path / "7b.gguf", LLAMA_7B)
    report = tmp_path / "state" / "probe" / "latest.json"
    report.parent.mkdir(parents=True)
    report.write_text(
        json.dumps(
            {
                "latency": {
                    "tcp": {"1": {"p50_us": 87.5, "p99_us": 120}, "32768": {"p50_us": 400}}
                },
                "throughput": {"fwd_p1": {"gbps": 9.41, "retransmits": 0}},
            }
        )
    )
    r = linkctl("estimate", "--model", str(p), "--json", env=env)
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert d["link"]["rtt_us"] == 87.5 and d["link"]["throughput_gbps"] == 9.41
    assert "latest.json" in d["link"]["source"]
    # A what-if flag overrides the report.
    r = linkctl("estimate", "--model", str(p), "--json", "--rtt-us", "2000", env=env)
    assert json.loads(r.stdout)["link"]["rtt_us"] == 2000


@pytest.mark.parametrize(
    ("content", "args", "message"),
    [
        (b"PK\x03\x04 not a model", (), "not a GGUF file"),
        (b"GGUF\x03\x00\x00\x00\x05", (), "truncated GGUF header"),
        (None, (), "no probe report"),
        (
            None,
            ("--rtt-us", "100", "--throughput-gbps", "9", "--split", "1,2,3"),
            "--split has 3 weights",
        ),
        (
            None,
            ("--rtt-us", "100", "--throughput-gbps", "9", "--split", "fastest"),
            "--split 'fastest': not recommended, llama or comma-separated weights",
        ),
        (None, ("--rtt-us", "-5", "--throughput-gbps", "9"), "--rtt-us -5: must be > 0"),
        (None, ("--rtt-us", "100", "--throughput-gbps", "9", "--ctx", "0"), "--ctx 0"),
        (
            None,
            ("--rtt-us", "100", "--throughput-gbps", "9", "--ctx", "512", "--depth", "600"),
            "--depth 600: must be between 0 and --ctx 512",
        ),
    ],
)
def test_cli_bad_input_one_line_exit_2(tmp_path, env, content, args, message):
    p = tmp_path / "m.gguf"
    if content is None:
        write_header_only(p, LLAMA_7B)
    else:
        p.write_bytes(content)
    r = linkctl("estimate", "--model", str(p), *args, env=env)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert message in r.stderr
    assert "Traceback" not in r.stderr and len(error_lines(r.stderr)) == 1


def test_cli_too_large_for_every_device(tmp_path, env):
    p = write_header_only(tmp_path / "moe.gguf", QWEN3_235B_A22B)
    prof = tmp_path / "small.toml"
    prof.write_text(
        (PROFILES / "dgx-mac.toml").read_text().replace("memory_gb = 128", "memory_gb = 32")
    )
    r = linkctl(
        "estimate",
        "--model",
        str(p),
        "--profile",
        str(prof),
        "--rtt-us",
        "100",
        "--throughput-gbps",
        "9",
        env=env,
    )
    assert r.returncode == 2
    assert "GiB together" in r.stderr and "smaller quantization" in r.stderr


def test_shipped_profile_235b_moe_needs_the_split(tmp_path, env):
    """The fielded pair: a 128 GB Mac Studio cannot hold a Q4 235B MoE alone (with the
    192 GB top configuration it would look as if it did)."""
    p = write_header_only(tmp_path / "moe.gguf", QWEN3_235B_A22B)
    r = linkctl(
        "estimate",
        "--model",
        str(p),
        "--profile",
        "dgx-mac",
        "--rtt-us",
        "100",
        "--throughput-gbps",
        "9",
        "--json",
        env=env,
    )
    assert r.returncode == 0, r.stderr
    est = json.loads(r.stdout)
    assert est["fits_head_alone"] is False
    assert est["recommendation"] == "split needed"
