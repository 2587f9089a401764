"""The catalog says which llama.cpp build its terms describe and holds every term to
what the device can physically reach."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from linkctl.estimate.builds import BUILD_FAR, build_numbers, far_notes
from linkctl.estimate.catalog import load_catalog, load_spec
from linkctl.estimate.cost import GIB, Participant
from linkctl.estimate.devicefit import bounds, fit_all, predict_us
from linkctl.estimate.features import D_Q
from linkctl.estimate.published import load_rows, row_time_us
from support.cli import linkctl
from support.ggufshapes import LLAMA_7B, write_header_only


@pytest.mark.parametrize(
    ("text", "want"),
    [
        ("2f68ce7cf (6918)", [6918]),
        ("b7948", [7948]),
        ("version: 6918 (2f68ce7cf)", [6918]),
        ("version: 0.6.0-dev (build 11434, commit abc)", [11434]),
        ("version: 0.6.0-dev (build 0, commit unknown)", []),  # the PyPI source's build
        ("PR #15616 head", []),
        ("9fb13f9", []),
    ],
)
def test_build_numbers_are_read_from_what_sources_and_llama_server_print(text, want):
    assert build_numbers(text) == want


def test_the_catalog_records_the_builds_its_terms_describe():
    cat = load_catalog()
    assert 6918 in cat["gb10"].build_numbers and "2f68ce7cf" in cat["gb10"].build
    assert cat["m2-ultra"].build_numbers == (7948,)
    # Rows of one source that ran different builds carry their own.
    assert 7825 not in cat["m3-ultra"].build_numbers


def test_a_build_far_from_the_catalogs_is_noted_and_a_near_one_is_not():
    d = load_catalog()["m2-ultra"]
    part = [Participant("mac", "head", d, 100 * GIB)]
    (note,) = far_notes(part, (7948 + BUILD_FAR + 1, "test"))
    assert "b7948" in note.text and f"b{7948 + BUILD_FAR + 1}" in note.text
    assert far_notes(part, (7948 + BUILD_FAR, "test")) == []
    assert far_notes(part, None) == []
    unknown = [Participant("mac", "head", replace(d, build_numbers=()), 100 * GIB)]
    assert far_notes(unknown, (20000, "test")) == []  # no number to compare: said nothing


def test_a_term_faster_than_the_device_can_go_is_held_at_its_bound_and_marked():
    """Rows made 40 % faster than the gb10's fit: the quantized bandwidth that would fit
    them is above 234 GB/s, the most a read kernel measured on a DGX Spark; it is held
    there, the rest refitted, and the note says so."""
    spec = load_spec()
    rows = [r for r in load_rows() if r.device == "gb10" and not r.exclude]
    fast = [replace(r, tok_s=r.tok_s * 1.4) for r in rows]
    f = fit_all(fast, spec)["gb10"]
    bound, why = bounds(spec["gb10"])[0][D_Q]
    assert f.decode[D_Q] == pytest.approx(bound)
    assert f.notes["bw_gbs"].startswith("on its physical bound: 234 GB/s")
    assert "measured" in why and "antirez/ds4/issues/773" in why
    # The rows ask for more than the device can read: the bound wins, and the large
    # models, whose time is their bytes, come out slower than those rows.
    big = [r for r in fast if r.kind == "decode" and r.model == "gpt-oss-120b"]
    assert big and all(predict_us(f, r) > row_time_us(r) for r in big)


def test_the_shipped_terms_are_within_their_bounds_and_those_on_it_are_named():
    spec = load_spec()
    fits = fit_all(load_rows(), spec)
    for key, f in fits.items():
        dmin, pmin = bounds(spec[key])
        for i, (lo, _) in dmin.items():
            assert f.decode[i] >= lo * (1 - 1e-9), (key, i)
        for i, (lo, _) in pmin.items():
            assert f.prefill[i] >= lo * (1 - 1e-9), (key, i)
    cat = load_catalog()
    assert cat["h100"].on_bound == ["kv_bw_gbs"]  # 2070 GB/s fitted, 2000 the PCIe peak


def test_a_bound_without_its_source_is_refused(tmp_path):
    from linkctl.core.errors import InputError
    from linkctl.estimate.catalog import catalog_path

    text = catalog_path().read_text()
    bad = tmp_path / "devices.toml"
    bad.write_text(text.replace("bound_bandwidth_gbs_source", "bound_bandwidth_note", 1))
    with pytest.raises(InputError, match=r"\[gb10\]\.bound_bandwidth_gbs = 234"):
        load_spec(bad)


def test_estimate_json_carries_the_build_and_the_bound_of_each_device(tmp_path, env):
    p = write_header_only(tmp_path / "7b.gguf", LLAMA_7B)
    r = linkctl(
        "estimate", "--model", str(p), "--rtt-us", "150", "--throughput-gbps", "9.4", "--json",
        env=env,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    devs = {x["host"]: x for x in d["split"]["devices"]}
    assert "6918" in devs["dgx"]["terms_build"] and "7948" in devs["mac"]["terms_build"]
    assert devs["dgx"]["on_bound"] == [] and devs["mac"]["on_bound"] == []
    assert any("llama.cpp 2f68ce7cf (6918)" in w for w in d["warnings"])
