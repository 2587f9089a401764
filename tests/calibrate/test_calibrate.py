"""`linkctl calibrate` with the real llama.cpp binaries, inside a lab namespace, and
the estimate picking the stored figure up."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

import pytest
import tomli_w

from support.ggufshapes import LLAMA_7B, write_header_only
from support.llama_util import need_llama

pytestmark = [pytest.mark.netns, pytest.mark.llama]


def test_two_term_solve_recovers_known_terms():
    from linkctl.calibrate.solve import solve_two_terms

    layer_us, bw = 35.0, 12.0  # µs per block, GB/s
    pts = [(b, n, b * layer_us + n / (bw * 1e3)) for b, n in ((24, 63e6), (2, 103e6))]
    got = solve_two_terms(pts)
    assert got == pytest.approx((layer_us, bw), rel=1e-6)
    # A host too busy for the times to follow the bytes: an error, not a negative bandwidth.
    from linkctl.core.errors import CheckFailed

    with pytest.raises(CheckFailed, match="do not rise with the bytes"):
        solve_two_terms([(24, 1e6, 9000.0), (2, 1e8, 10.0)])


def test_record_from_plan_and_measurements_without_llama(tmp_path):
    """record() alone: measurements made to follow known terms give those terms back,
    the median run is the one kept, and --rpc's figures follow from its runs."""
    from linkctl.calibrate.measure import Measurements, RpcRuns
    from linkctl.calibrate.plan import CalibrationPlan, PlannedModel
    from linkctl.calibrate.solve import record
    from linkctl.estimate.features import decode_features
    from linkctl.gguf.info import read_model
    from linkctl.gguf.tiny import TinySpec, write_tiny_llama
    from linkctl.llama.client import Timing

    specs = [TinySpec(n_layer=6, n_embd=64, n_ff=128), TinySpec(n_layer=1, n_embd=256, n_ff=512)]
    paths = [write_tiny_llama(tmp_path / f"m{i}.gguf", sp)["path"] for i, sp in enumerate(specs)]
    layer_us, bw = 40.0, 8.0

    def timing(path: str, slower: float = 1.0) -> Timing:
        m = read_model(path)
        f = decode_features(m, list(range(m.block_count)), True, 64 + 16 / 2)
        t_us = (m.block_count * layer_us + (f[2] + f[3] + f[4]) / (bw * 1e3)) * slower
        return Timing(1e6 / t_us, 16, 1000.0, 64, 16 * t_us / 1e3, 64.0)

    plan = CalibrationPlan(
        host="dgx", device="cpu", device_kind="cpu",
        models=[PlannedModel(path=paths[0]), PlannedModel(path=paths[1], spec={"n_layer": 1})],
        tokens=16, runs=3, threads=1, rpc=True, context=512, prompt_tokens=64,
        cpu_quota=None, servers=[], llama_server="llama-server", workdir=str(tmp_path),
        saves_to=str(tmp_path / "calibration.json"), catalog_layer_us=0.0,
        catalog_effective_bandwidth_gbs=68.0,
    )  # fmt: skip
    # Three runs each: one fast outlier, the typical one, one slow: the median is kept.
    runs = [[timing(p, 0.5), timing(p), timing(p, 3.0)] for p in paths]
    rpc_runs = [timing(paths[0], 2.0)] * 3
    rec = record(plan, Measurements(runs, RpcRuns(loopback_rtt_us=20.0, runs=rpc_runs)))
    assert rec.layer_us == pytest.approx(layer_us, rel=1e-6)
    assert rec.effective_bandwidth_gbs == pytest.approx(bw, rel=1e-6)
    d = rec.model_dump()
    assert [m["generated"] for m in d["models"]] == [False, True]
    assert d["decode_tok_s"] == runs[0][1].predicted_per_second
    assert len(d["runs"]) == 3 and d["runs"][0]["predicted_per_second"] > 0
    local_us = 1e6 / runs[0][1].predicted_per_second
    assert rec.rpc_overhead_us == pytest.approx(2 * local_us - local_us - 20.0)
    assert d["rpc"]["loopback_rtt_us"] == 20.0 and "cpu_quota" not in d
    assert not (tmp_path / "calibration.json").exists()  # record builds; it does not save


def test_record_measures_a_quantized_models_types_and_the_estimate_prices_them(tmp_path):
    """A given Q8_0 model stays out of the two-term solve (F32 models alone) and gives
    its type's read rate; the calibrated device then prices Q8_0 at that rate."""
    from linkctl.calibrate.measure import Measurements
    from linkctl.calibrate.plan import CalibrationPlan, PlannedModel, reads_quantized
    from linkctl.calibrate.solve import record
    from linkctl.estimate.catalog import apply_calibration, get_device, load_catalog
    from linkctl.estimate.features import decode_features
    from linkctl.estimate.weight_types import priced
    from linkctl.gguf.info import read_model
    from linkctl.gguf.tiny import TinySpec, write_tiny_llama
    from linkctl.llama.client import Timing

    specs = [
        TinySpec(n_layer=2, n_embd=256, n_ff=512, wtype="Q8_0"),
        TinySpec(n_layer=6, n_embd=64, n_ff=128),
        TinySpec(n_layer=1, n_embd=256, n_ff=512),
    ]
    paths = [write_tiny_llama(tmp_path / f"m{i}.gguf", sp)["path"] for i, sp in enumerate(specs)]
    models = [read_model(p) for p in paths]
    assert [reads_quantized(m) for m in models] == [True, False, False]
    layer_us, bw, q8_gbs = 40.0, 8.0, 5.0

    def timing(m) -> Timing:
        f = decode_features(m, list(range(m.block_count)), True, 64 + 16 / 2)
        t_us = m.block_count * layer_us + f[2] / (q8_gbs * 1e3) + (f[3] + f[4]) / (bw * 1e3)
        return Timing(1e6 / t_us, 16, 1000.0, 64, 16 * t_us / 1e3, 64.0)

    plan = CalibrationPlan(
        host="dgx", device="cpu", device_kind="cpu",
        models=[PlannedModel(path=paths[0], quantized=True)]
        + [PlannedModel(path=p, spec={"n_layer": 1}) for p in paths[1:]],
        tokens=16, runs=1, threads=1, rpc=False, context=512, prompt_tokens=64,
        cpu_quota=None, servers=[], llama_server="llama-server", workdir=str(tmp_path),
        saves_to=str(tmp_path / "calibration.json"), catalog_layer_us=0.0,
        catalog_effective_bandwidth_gbs=68.0,
    )  # fmt: skip
    rec = record(plan, Measurements([[timing(m)] for m in models], None))
    assert rec.layer_us == pytest.approx(layer_us, rel=1e-6)
    assert rec.effective_bandwidth_gbs == pytest.approx(bw, rel=1e-6)
    (t, r), *more = (rec.weight_rates or {}).items()
    assert t == "Q8_0" and not more and r.together == ["Q8_0"]
    assert r.gbs == pytest.approx(q8_gbs, rel=1e-6) and r.factor == pytest.approx(q8_gbs / bw)
    # The record round-trips through its file form, and the estimate prices Q8_0 by it.
    rec = type(rec).model_validate_json(rec.model_dump_json())
    dev = apply_calibration(get_device(load_catalog(), "cpu", "dgx"), rec)
    q8 = next(x for x in priced(models[0], [0, 1], True, dev) if x["type"] == "Q8_0")
    assert q8["how"] == "calibrated" and q8["read_gbs"] == pytest.approx(q8_gbs, abs=0.05)
    assert "measured by linkctl calibrate" in q8["source"]


def test_cpu_quota_reads_cgroup_v2_and_v1_files(tmp_path):
    """The plan's CPU quota, from files shaped as the kernel writes them."""
    from linkctl.calibrate.plan import _quota_of

    v2, v1 = tmp_path / "v2", tmp_path / "v1"
    v2.mkdir()
    v1.mkdir()
    (v2 / "cpu.max").write_text("max 100000\n")
    assert _quota_of(v2, True).cpus is None  # read: no limit
    (v2 / "cpu.max").write_text("50000 100000\n")
    assert _quota_of(v2, True).cpus == 0.5
    (v1 / "cpu.cfs_quota_us").write_text("-1\n")
    (v1 / "cpu.cfs_period_us").write_text("100000\n")
    assert _quota_of(v1, False).cpus is None
    (v1 / "cpu.cfs_quota_us").write_text("1000\n")
    (v1 / "cpu.cfs_period_us").write_text("4000\n")
    q = _quota_of(v1, False)
    assert q.cpus == 0.25 and str(v1 / "cpu.cfs_quota_us") in q.source
    assert _quota_of(tmp_path, True) is None  # no controller files there: unknown


def cpu_lab(make_lab, tmp_path: Path):
    """The dgx-mac lab with every host a "cpu" device (this machine's CPU build)."""
    lab = make_lab("dgx-mac")
    data = tomllib.loads(Path(lab.profile_path).read_text())
    for h in data["hosts"]:
        h["device"] = "cpu"
    prof = tmp_path / "cpu.toml"
    prof.write_text(tomli_w.dumps(data))
    return lab, prof


def test_calibrate_solves_both_decode_terms_and_estimate_uses_them(make_lab, tmp_path):
    """Real llama-server on the given tiny model and a generated one of another shape;
    per-block cost and bandwidth solved from both; the estimate then predicts the given
    model's per-token time on that host from those two terms."""
    need_llama()
    from linkctl.gguf.tiny import TinySpec, write_tiny_llama

    lab, prof = cpu_lab(make_lab, tmp_path)
    model = write_tiny_llama(tmp_path / "tiny.gguf", TinySpec(n_layer=2, n_embd=256, n_ff=512))

    args = ["--profile", str(prof), "--model", model["path"], "--tokens", "16", "--runs", "2"]
    args += ["--threads", "1", "--json"]
    # The dry run is the plan the real run carries out, and writes nothing.
    r = lab.run("dgx", "calibrate", *args, "--dry-run")
    assert r.returncode == 0, r.stderr
    plan = json.loads(r.stdout)
    assert not Path(plan["workdir"]).exists() and not Path(plan["saves_to"]).exists()
    assert [m["spec"] is not None for m in plan["models"]] == [False, True]
    assert plan["commands"] == [s["argv"] for s in plan["servers"]]
    r = lab.run("dgx", "calibrate", *args, timeout=900)
    assert r.returncode == 0, r.stderr
    assert "linkctl[calibrate] timed run 2/2" in r.stderr  # progress, on stderr
    rec = json.loads(r.stdout)
    assert [m["model"] for m in rec["models"]] == [m["path"] for m in plan["models"]]
    assert rec["saved_to"] == plan["saves_to"]
    assert Path(plan["models"][1]["path"]).is_file()  # the generated one, written by measure
    ctx = plan["commands"][0][plan["commands"][0].index("-c") + 1]
    assert rec["runs"][0]["prompt_n"] == plan["prompt_tokens"] and int(ctx) == plan["context"]
    assert rec["host"] == "dgx" and rec["device"] == "cpu"
    ms = rec["models"]
    assert len(ms) == 2 and not ms[0]["generated"] and ms[1]["generated"]
    assert ms[0]["model"] == model["path"]
    # The generated model weighs per-block cost and bytes differently (blocks per byte).
    ratio = [m["blocks"] / m["bytes_per_token"] for m in ms]
    assert max(ratio) > 3 * min(ratio)
    assert all(m["decode_tok_s"] > 0 and m["runs"][0]["predicted_n"] == 16 for m in ms)
    assert rec["effective_bandwidth_gbs"] > 0 and rec["layer_us"] >= 0
    if rec["layer_us"] > 0:  # two models, two terms: both times reproduced exactly
        for m in ms:
            assert m["predicted_us"] == pytest.approx(m["per_token_us"], rel=1e-3)
    saved = Path(rec["saved_to"])
    assert saved.is_file() and "dgx" in json.loads(saved.read_text())["hosts"]

    # All of the given model on dgx (the CPU head holds no layers; calibrated without
    # --rpc, so dgx's two local terms apply).
    first = ms[0]
    depth = int(first["runs"][0]["prompt_n"] + 8)
    r = lab.run(
        "dgx",
        "estimate",
        "--profile",
        str(prof),
        "--model",
        model["path"],
        "--rtt-us",
        "100",
        "--throughput-gbps",
        "9",
        "--depth",
        str(depth),
        "--json",
    )
    assert r.returncode == 0, r.stderr
    est = json.loads(r.stdout)
    dgx = next(d for d in est["split"]["devices"] if d["host"] == "dgx")
    assert dgx["figures_source"].startswith("calibrated")
    assert dgx["bandwidth_gbs"] == pytest.approx(rec["effective_bandwidth_gbs"])
    assert dgx["layer_fixed_us"] == pytest.approx(rec["layer_us"] * 2)
    assert dgx["compute_us"] + dgx["kv_read_us"] == pytest.approx(first["predicted_us"], rel=0.01)

    # A header-only 7B on the same host: the calibrated terms, not the catalog's.
    big = write_header_only(tmp_path / "7b.gguf", LLAMA_7B)
    r = lab.run(
        "dgx",
        "estimate",
        "--profile",
        str(prof),
        "--model",
        str(big),
        "--rtt-us",
        "100",
        "--throughput-gbps",
        "9",
        "--json",
    )
    assert r.returncode == 0, r.stderr
    dgx = next(d for d in json.loads(r.stdout)["split"]["devices"] if d["host"] == "dgx")
    assert dgx["bandwidth_gbs"] == pytest.approx(rec["effective_bandwidth_gbs"])


def test_calibrate_measures_the_given_quantized_models_types(make_lab, tmp_path):
    """Real llama-server on a Q8_0 tiny model and the generated F32 pair: the pair
    solves the two terms, the Q8_0 model gives its type's read rate, and estimate on
    that host prices Q8_0 by it (no catalog term for it) and reproduces the model's
    measured time."""
    need_llama()
    from linkctl.gguf.tiny import TinySpec, write_tiny_llama

    lab, prof = cpu_lab(make_lab, tmp_path)
    spec = TinySpec(n_layer=2, n_embd=512, n_head=8, n_ff=1024, wtype="Q8_0")
    model = write_tiny_llama(tmp_path / "q8.gguf", spec)
    args = ["--profile", str(prof), "--model", model["path"], "--tokens", "16", "--runs", "2"]
    args += ["--threads", "1", "--json"]
    r = lab.run("dgx", "calibrate", *args, "--dry-run")
    assert r.returncode == 0, r.stderr
    # Quantized: not in the two-term solve, so both generated F32 models are added.
    assert [m["spec"] is not None for m in json.loads(r.stdout)["models"]] == [False, True, True]
    r = lab.run("dgx", "calibrate", *args, timeout=900)
    assert r.returncode == 0, r.stderr
    rec = json.loads(r.stdout)
    assert [m["quantized"] for m in rec["models"]] == [True, False, False]
    q8 = rec["weight_rates"]["Q8_0"]
    assert set(rec["weight_rates"]) == {"Q8_0"} and q8["together"] == ["Q8_0"]
    assert q8["gbs"] > 0 and q8["factor"] == pytest.approx(
        q8["gbs"] / rec["effective_bandwidth_gbs"]
    )
    r = lab.run("dgx", "calibrate", *args[:-1])  # text: the type's line
    assert r.returncode == 0, r.stderr
    assert "Q8_0 weights:" in r.stdout and "GB/s" in r.stdout

    first = json.loads(Path(rec["saved_to"]).read_text())["hosts"]["dgx"]["models"][0]
    depth = int(first["runs"][0]["prompt_n"] + 8)
    what_if = ["--rtt-us", "100", "--throughput-gbps", "9", "--depth", str(depth), "--json"]
    r = lab.run("dgx", "estimate", "--profile", str(prof), "--model", model["path"], *what_if)
    assert r.returncode == 0, r.stderr
    dgx = next(d for d in json.loads(r.stdout)["split"]["devices"] if d["host"] == "dgx")
    types = {t["type"]: t for t in dgx["weight_types"]}
    assert types["Q8_0"]["how"] == "calibrated" and "linkctl calibrate" in types["Q8_0"]["source"]
    # The model's time as calibrate measured it (the Q8_0 rate is its own measure).
    assert dgx["compute_us"] + dgx["kv_read_us"] == pytest.approx(first["per_token_us"], rel=0.02)


def test_calibrate_rpc_on_a_gpu_host(make_lab, tmp_path):
    """dgx as a GB10 (kind gpu, as in the shipped profile): `--rpc` puts every layer on the
    RPC device with --device, which this llama.cpp build must accept (a CPU build runs
    the same argv; the tiny model keeps it to the small generated pair)."""
    need_llama()
    from linkctl.gguf.tiny import TinySpec, write_tiny_llama

    lab = make_lab("dgx-mac")
    data = tomllib.loads(Path(lab.profile_path).read_text())
    next(h for h in data["hosts"] if h["name"] == "dgx")["device"] = "gb10"
    prof = tmp_path / "gpu.toml"
    prof.write_text(tomli_w.dumps(data))
    model = write_tiny_llama(tmp_path / "tiny.gguf", TinySpec(n_layer=2, n_embd=256, n_ff=512))
    args = ["--profile", str(prof), "--model", model["path"], "--tokens", "16", "--runs", "1"]
    args += ["-t", "1", "--rpc"]
    r = lab.run("dgx", "calibrate", *args, "--json", timeout=900)
    assert r.returncode == 0, r.stderr
    rec = json.loads(r.stdout)
    assert rec["device"] == "gb10" and rec["rpc"]["decode_tok_s"] > 0
    assert rec["rpc_effective_bandwidth_gbs"] > 0


def test_calibrate_refuses_header_only_model(make_lab, tmp_path):
    lab = make_lab("dgx-mac")
    p = write_header_only(tmp_path / "h.gguf", LLAMA_7B)
    r = lab.run("dgx", "calibrate", "--model", str(p))
    assert r.returncode == 2
    assert "header only" in r.stderr and "Traceback" not in r.stderr


def test_estimate_query_rpc_uses_the_servers_free_memory(make_lab, tmp_path):
    """--query-rpc asks the real ggml-rpc-server (GET_DEVICE_MEMORY) over the lab link."""
    import subprocess
    import time

    bins = need_llama()
    lab = make_lab("dgx-mac")
    for h in ("dgx", "mac"):
        r = lab.run(h, "setup")
        assert r.returncode == 0, r.stderr
    dgx_ip = lab.host("dgx")["address"].split("/")[0]
    srv = subprocess.Popen(
        [
            "ip",
            "netns",
            "exec",
            lab.netns("dgx"),
            bins.rpc_server.path,
            "-H",
            dgx_ip,
            "-p",
            "50052",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        p = write_header_only(tmp_path / "7b.gguf", LLAMA_7B)
        deadline = time.monotonic() + 20
        while True:
            r = lab.run(
                "mac",
                "estimate",
                "--model",
                str(p),
                "--query-rpc",
                "--rtt-us",
                "100",
                "--throughput-gbps",
                "9",
                "--json",
            )
            if r.returncode == 0 or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert r.returncode == 0, r.stderr
        est = json.loads(r.stdout)
        dgx = next(d for d in est["split"]["devices"] if d["host"] == "dgx")
        # A CPU rpc-server reports this machine's free RAM: same order as MemAvailable.
        avail = next(
            int(line.split()[1]) * 1024
            for line in Path("/proc/meminfo").read_text().splitlines()
            if line.startswith("MemAvailable:")
        )
        assert 0.3 * avail < dgx["free_bytes"] < 3 * avail
        assert dgx["free_bytes"] != pytest.approx(128 * 1024**3 * 0.9)  # not the profile's
    finally:
        srv.terminate()
        srv.wait(10)


def test_host_help_says_what_calibrate_does_when_no_host_matches(tmp_path):
    """--host: the default is the detected host, as for every command acting as one
    host; no host matching is exit 2 asking for --host (the help once promised a
    fallback to the head, which would store the head's name on an rpc host's figures)."""
    import os

    from support.cli import linkctl
    from support.paths import PROFILES

    data = tomllib.loads((PROFILES / "dgx-mac.toml").read_text())
    for h in data["hosts"]:
        h["os"], h["interface"] = "linux", f"lkno{h['name']}0"  # no such port here
    prof = tmp_path / "absent.toml"
    prof.write_text(tomli_w.dumps(data))
    env = {k: v for k, v in os.environ.items() if k != "LINKCTL_HOST"}
    env["LINKCTL_STATE_DIR"] = str(tmp_path / "state")
    r = linkctl("calibrate", "--profile", str(prof), "--dry-run", env=env)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert "matches this machine" in r.stderr and "(fix: pass --host NAME)" in r.stderr
    assert not (tmp_path / "state").exists()
    text = " ".join(linkctl("calibrate", "--help").stdout.split())
    assert "--host <str> Which profile host this machine is (default: detected)." in text
    assert "head" not in text.split("--host", 1)[1].split("--", 1)[0]
    probe_help = " ".join(linkctl("probe", "--help").stdout.split())
    assert "--host <str> Which profile host this machine is (default: detected)." in probe_help
