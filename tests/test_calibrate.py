"""`linkctl calibrate` with the real llama.cpp binaries, inside a lab namespace, and
the estimate picking the stored figure up."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

import pytest
import tomli_w
from ggufshapes import LLAMA_7B, write_header_only
from llama_util import need_llama

pytestmark = [pytest.mark.netns, pytest.mark.llama]


def test_calibrate_stores_measured_figures_and_estimate_uses_them(make_lab, tmp_path):
    need_llama()
    from linkctl.tinymodel import TinySpec, write_tiny_llama

    lab = make_lab("dgx-mac")
    data = tomllib.loads(Path(lab.profile_path).read_text())
    for h in data["hosts"]:
        h["device"] = "cpu"
    prof = tmp_path / "cpu.toml"
    prof.write_text(tomli_w.dumps(data))
    model = write_tiny_llama(tmp_path / "tiny.gguf", TinySpec(n_layer=2, n_embd=256, n_ff=512))

    r = lab.run(
        "dgx",
        "calibrate",
        "--profile",
        str(prof),
        "--model",
        model["path"],
        "--tokens",
        "16",
        "--runs",
        "1",
        "--threads",
        "1",
        "--json",
        timeout=600,
    )
    assert r.returncode == 0, r.stderr
    rec = json.loads(r.stdout)
    assert rec["host"] == "dgx" and rec["device"] == "cpu"
    assert rec["decode_tok_s"] > 0 and rec["runs"][0]["predicted_n"] == 16
    # bandwidth = bytes per token x tok/s, bytes from the header
    assert rec["effective_bandwidth_gbs"] == pytest.approx(
        rec["bytes_per_token"] * rec["decode_tok_s"] / 1e9
    )
    saved = Path(rec["saved_to"])
    assert saved.is_file() and "dgx" in json.loads(saved.read_text())["hosts"]

    # The estimate on the same host uses the calibrated figure, not the catalog's.
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
    est = json.loads(r.stdout)
    dgx = next(d for d in est["split"]["devices"] if d["host"] == "dgx")
    assert dgx["bandwidth_gbs"] == pytest.approx(rec["effective_bandwidth_gbs"])
    assert dgx["figures_source"].startswith("calibrated")


def test_calibrate_refuses_header_only_model(make_lab, tmp_path):
    lab = make_lab("dgx-mac")
    p = write_header_only(tmp_path / "h.gguf", LLAMA_7B)
    r = lab.run("dgx", "calibrate", "--model", str(p))
    assert r.returncode == 2
    assert "header only" in r.stderr and "Traceback" not in r.stderr
