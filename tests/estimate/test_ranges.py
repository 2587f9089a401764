"""Every figure the estimate prints carries an interval from the fit's leave-one-out
residuals, and the fit is judged on sources it never saw."""

from __future__ import annotations

import json

import pytest

from linkctl.core.errors import InputError
from linkctl.estimate.catalog import load_catalog
from linkctl.estimate.cost import GIB, LinkFigures, Participant, estimate
from linkctl.estimate.holdout import HELD_OUT_SHARE, held_out_sources, source_held_out
from linkctl.estimate.published import load_rows
from linkctl.estimate.ranges import MIN_POOL, ErrorRange, Residual, conformal, error_range
from linkctl.estimate.ttft import predict
from linkctl.gguf.info import read_model
from support.cli import linkctl
from support.ggufshapes import LLAMA_70B, write_header_only

FAM = {"a": "apple", "b": "apple", "c": "nvidia"}


def res(device: str, errs: list[float], fitted: bool = True, kind: str = "decode", new=False):
    return [Residual(device, kind, e, fitted, new, f"src-{device}") for e in errs]


def test_conformal_takes_the_ceil_n_plus_1_times_coverage_smallest_magnitude():
    # n = 9: the ceil(10 x 0.8) = 8th smallest |e|.
    xs = [0.01, -0.02, 0.03, -0.04, 0.05, -0.06, 0.07, -0.08, 0.5]
    assert conformal(xs) == pytest.approx(0.08)
    assert conformal([0.01] * 3 + [2.0]) == 0.95  # capped: a high end at infinity says nothing


def test_a_fitted_figure_takes_the_widest_pool_that_holds_enough_rows():
    narrow = res("a", [0.01] * MIN_POOL)
    wide = res("b", [0.2] * MIN_POOL)
    g = error_range(narrow + wide, FAM, "a", "decode", True)
    assert g.pool == "apple decode" and g.err == pytest.approx(0.2)  # the family is wider
    g = error_range(narrow + res("c", [0.3] * MIN_POOL), FAM, "a", "decode", True)
    assert g.pool == "a decode" and g.err == pytest.approx(0.01)  # another family: not used
    new = res("c", [0.25] * MIN_POOL, new=True)
    g = error_range(narrow + new, FAM, "a", "decode", True)
    assert g.pool == "new tables' decode" and g.err == pytest.approx(0.25)
    # Too few anywhere: every device's residuals of the kind; none at all: no interval.
    g = error_range(res("c", [0.1, 0.1]), FAM, "a", "decode", True)
    assert g.pool == "every device's decode" and g.n == 2
    assert error_range([], FAM, "a", "decode", True).n == 0


def test_an_assumed_figure_takes_the_residuals_of_assumed_terms():
    rs = res("a", [0.01] * MIN_POOL) + res("c", [0.4, -0.3, 0.2], fitted=False)
    g = error_range(rs, FAM, "a", "decode", False)
    assert g.pool == "decode (assumed terms)" and g.err == pytest.approx(0.4)


def test_an_interval_maps_relative_error_to_rates_and_times():
    g = ErrorRange(0.2, 10, "x")
    assert g.tok_s(120.0) == pytest.approx((100.0, 150.0))  # published = predicted / (1 + e)
    assert g.time(1.0) == pytest.approx((0.8, 1.2))


def test_the_shipped_catalog_carries_a_range_for_every_device_and_kind():
    cat = load_catalog()
    for key, d in cat.items():
        for kind in ("decode", "prefill"):
            g = d.error_range(kind)
            assert 0 < g.err < 1 and g.n >= 1 and g.pool, (key, kind, g)
    assert "assumed" in cat["h200"].error_range("decode").pool  # no rows of its own
    assert "assumed" not in cat["gb10"].error_range("decode").pool


def test_a_range_missing_its_fields_is_refused(tmp_path):
    from linkctl.estimate.catalog import fit_path

    text = fit_path().read_text()
    bad = tmp_path / "fit.toml"
    bad.write_text(text.replace("decode = { err = ", "decode = { wrong = ", 1))
    with pytest.raises(InputError, match=r"range\]\.decode is incomplete"):
        load_catalog(fit=bad)


def _pair(head_gib: float = 30):
    """A 70B Q4 (about 40 GiB) does not fit a 30 GiB head: the split has layers on both."""
    cat = load_catalog()
    return [
        Participant("dgx", "rpc", cat["gb10"], 100 * GIB),
        Participant("mac", "head", cat["m2-ultra"], head_gib * GIB),
    ]


def test_every_figure_has_its_interval_around_it(tmp_path):
    model = read_model(write_header_only(tmp_path / "70b.gguf", LLAMA_70B))
    link = LinkFigures(rtt_us=150.0, throughput_gbps=9.4)
    est = estimate(model, _pair(), link, 4096)
    for sc in (est.local, est.split, est.recommended):
        assert sc is not None
        assert sc.decode_tok_s_low < sc.decode_tok_s < sc.decode_tok_s_high
        assert sc.prefill_tok_s_low < sc.prefill_tok_s < sc.prefill_tok_s_high
    assert est.split_gain is not None
    g, lo, hi = est.split_gain
    assert lo < g < hi
    assert est.recommended is not None and est.local is not None
    assert g == pytest.approx(est.recommended.decode_tok_s / est.local.decode_tok_s)
    # The local figure alone: exactly the head device's range.
    e = load_catalog()["m2-ultra"].error_range("decode").err
    assert est.local.decode_tok_s_low == pytest.approx(est.local.decode_tok_s / (1 + e))
    de = predict(model, _pair(), link, 4096, 2048, 128, "dgx")
    for p in de.plans:
        assert p.ttft_s_low < p.ttft_s < p.ttft_s_high, p


def test_estimate_json_and_text_carry_the_ranges(tmp_path, env):
    p = write_header_only(tmp_path / "70b.gguf", LLAMA_70B)
    what_if = ["--rtt-us", "150", "--throughput-gbps", "9.4"]
    r = linkctl("estimate", "--model", str(p), *what_if, "--json", env=env)
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    for name in ("local", "split", "recommended"):
        sc = d[name]
        assert sc["decode_tok_s_low"] < sc["decode_tok_s"] < sc["decode_tok_s_high"]
        assert sc["prefill_tok_s_low"] < sc["prefill_tok_s"] < sc["prefill_tok_s_high"]
        for dev in sc["devices"]:
            assert set(dev["ranges"]) == {"decode", "prefill"}
            assert dev["ranges"]["decode"]["pool"] and dev["ranges"]["decode"]["n"] > 0
    assert d["split_gain"]["low"] <= d["split_gain"]["value"] <= d["split_gain"]["high"]
    for plan in d["serving"]["plans"]:
        assert plan["ttft_s_low"] <= plan["ttft_s"] <= plan["ttft_s_high"]
    r = linkctl("estimate", "--model", str(p), *what_if, env=env)
    assert r.returncode == 0, r.stderr
    assert "decode tok/s (range)" in r.stdout and "split gain" in r.stdout
    assert "four in five inside" in r.stdout and "TTFT s (range)" in r.stdout


def test_held_out_sources_are_whole_sources_fixed_by_the_data():
    rows = load_rows()
    held = held_out_sources(rows)
    assert held == held_out_sources(list(reversed(rows)))  # not by the order of the file
    scored = [r for r in rows if not r.exclude]
    share = sum(r.source in held for r in scored) / len(scored)
    assert HELD_OUT_SHARE <= share < HELD_OUT_SHARE + 0.2, share
    assert held < {r.source for r in rows}


def test_a_held_out_source_is_predicted_by_a_fit_that_never_saw_it():
    rows = load_rows()
    src = next(r.source for r in rows if r.device == "m2-ultra" and "15616" in r.source)
    judged = source_held_out(rows, _spec(), {src})
    assert judged and all(j.row.source == src for j in judged)
    # The M2 Ultra keeps its other current-build table: every row is a fit's prediction.
    assert all(j.testable for j in judged)
    assert max(abs(j.err) for j in judged) < 0.25


def _spec():
    from linkctl.estimate.catalog import load_spec

    return load_spec()
