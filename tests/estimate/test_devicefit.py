"""The device catalog is fitted from the public benchmark rows, reproducibly, and the
fit is the estimator's own model."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import replace

import pytest

from linkctl.estimate.catalog import fit_path, load_catalog, load_spec
from linkctl.estimate.cost import GIB, Participant, estimate
from linkctl.estimate.devicefit import fit_all, predict_us
from linkctl.estimate.fitfile import render_fit_toml
from linkctl.estimate.published import load_rows, row_model, row_time_us
from support.paths import REPO


def test_fit_script_reproduces_the_shipped_catalog(tmp_path):
    out = tmp_path / "fit.toml"
    r = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "fit_devices.py"), "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    assert out.read_text() == fit_path().read_text(), "re-run scripts/fit_devices.py"


def test_every_row_is_sourced_and_its_shape_matches_the_published_size():
    rows = load_rows()
    assert len(rows) >= 60
    for r in rows:
        assert r.url.startswith("https://github.com/"), r
        got = row_model(r).total_bytes / GIB
        assert got == pytest.approx(r.size_gib, rel=0.02), (r.label, got)
    devices = {r.device for r in rows if not r.exclude}
    assert {"gb10", "m2-ultra"} <= devices
    for dev in ("gb10", "m2-ultra"):
        mine = [r for r in rows if r.device == dev and not r.exclude]
        assert len({r.model for r in mine}) >= 3
        assert len({r.quant.split("+")[0] for r in mine}) >= 2
        assert any(row_model(r).is_moe for r in mine) and any(r.kind == "decode" for r in mine)
    assert all(r.exclude for r in rows if r.exclude is not None)


def test_fit_recovers_known_terms_from_synthetic_rows():
    """Rows generated from known terms through the estimator fit back to those terms."""
    rows = [r for r in load_rows() if r.device == "gb10" and not r.exclude]
    spec = load_spec()
    truth = fit_all(rows, spec)["gb10"]
    # Within the gb10's bound (234 GB/s measured read: devices.toml), so the fit may reach them.
    truth.decode = [30.0, 12.0, 1e6 / 220e9, 1e6 / 220e9, 1e6 / 180e9]
    synth = [replace(r, tok_s=r.tok_s * row_time_us(r) / predict_us(truth, r)) for r in rows]
    got = fit_all(synth, spec)["gb10"]
    for a, b in zip(got.decode, truth.decode, strict=True):
        assert a == pytest.approx(b, rel=1e-3)
    for r in synth:
        assert predict_us(got, r) == pytest.approx(row_time_us(r), rel=1e-3)


def test_the_catalog_predicts_a_row_exactly_as_the_estimate_does():
    """A row's fitted prediction is what `linkctl estimate` says for that model alone."""
    cat = load_catalog()
    fits = fit_all(load_rows(), load_spec())
    row = next(r for r in load_rows() if r.model == "gpt-oss-120b" and r.test == "tg32")
    m = row_model(row)
    head = Participant("spark", "head", cat["gb10"], 120 * GIB)
    est = estimate(m, [head], None, ctx=4096, depth=int(row.depth + row.n / 2), n_prompt=512)
    assert 1e6 / est.local.decode_tok_s == pytest.approx(predict_us(fits["gb10"], row), rel=1e-4)


def test_devices_without_rows_are_marked_assumed():
    cat = load_catalog()
    assert cat["h200"].fit["summary"].startswith("assumed")
    assert "assumed" in cat["h200"].fit["decode"]
    assert cat["gb10"].fit["summary"].startswith("fitted")
    text = render_fit_toml(fit_all(load_rows(), load_spec()), load_rows(), {})
    assert "[h200.notes]" in text and "[gb10.notes]" in text  # gb10: no F16 rows


def test_attention_without_flash_attention_reads_kv_once_per_query_head():
    """Without flash attention llama.cpp's mat-vec kernels broadcast K and V over the
    query heads and materialise the F32 KQ row, so a row's KV feature is n_head / n_head_kv
    times the cache bytes plus the KQ passes; with it, the cache bytes. Nothing else moves."""
    from linkctl.estimate.features import decode_features
    from linkctl.gguf.shapes import model_info

    m = model_info("llama-3-70b", "Q4_K_M")  # 64 query heads, 8 KV heads, head dim 128
    layers = list(range(m.block_count))
    fa = decode_features(m, layers, True, 4096, flash_attn=True)
    no = decode_features(m, layers, True, 4096, flash_attn=False)
    assert fa[4] == m.kv_bytes_per_token_per_layer * m.block_count * 4096
    assert no[4] == pytest.approx(fa[4] * 64 / 8 * (1 + 16 / 512))
    assert fa[:4] == no[:4]
    rows = load_rows()
    assert {r.flash_attn for r in rows} == {True, False}
    m3 = [r for r in rows if r.device == "m3-max"]
    assert m3 and not any(r.flash_attn for r in m3)  # the 2024 notebooks: llama-bench -fa 0


def test_a_source_that_does_not_say_whether_it_ran_flash_attention_is_refused(tmp_path):
    from linkctl.core.errors import InputError

    text = (REPO / "linkctl" / "data" / "published_bench.toml").read_text()
    bad = tmp_path / "rows.toml"
    bad.write_text(text.replace("flash_attn = true\n", "", 1))
    with pytest.raises(InputError, match="flash_attn"):
        load_rows(bad)


def test_prefill_rows_of_one_model_do_not_fit_a_per_micro_batch_cost():
    """A unit whose prompt rows are all one model cannot tell a per-micro-batch cost from
    a FLOPS rate (both grow with the prompt): the cost is the family anchor's, marked."""
    from linkctl.estimate.devicefit import catalog_group

    rows, spec = load_rows(), load_spec()
    group = catalog_group(rows, "m3-ultra")
    unit = [r for r in rows if r.device == "m3-ultra" and r.kind == "prefill" and r.group == group]
    assert unit and len({r.model for r in unit}) == 1
    fits = fit_all(rows, spec)
    fit = fits["m3-ultra"]
    assert "one model" in fit.notes["ubatch_layer_us"]
    anchor = fits["m2-ultra"]
    assert fit.prefill[0] == pytest.approx(anchor.prefill[0])  # a time per block: not spec-scaled


def test_one_row_shape_borrows_the_term_that_explains_less_of_it():
    """Rows of one shape cannot split per-block cost from bandwidth: the fit borrows from
    the family anchor the term that explains less of the row's time and fits the other,
    so the borrowed term's error moves the prediction least."""
    from linkctl.estimate.devicefit import Prior, fit_decode, loo_fit
    from linkctl.estimate.features import D_BLOCK, D_Q

    rows, spec = load_rows(), load_spec()
    anchor = fit_all(rows, spec)["m2-ultra"]
    # The M3 Ultra's Dec 2025 rows without its 3B one: two 70B rows, bandwidth-bound.
    small = next(r for r in rows if r.device == "m3-ultra" and r.model == "llama-3.2-3b")
    fit = loo_fit(rows, small, spec)
    assert "layer_us" in fit.notes and "bw_gbs" not in fit.notes
    assert fit.decode[D_BLOCK] == pytest.approx(anchor.decode[D_BLOCK])
    # A 1.1B row alone is mostly per-block cost: the bandwidth is the borrowed term.
    tiny = [r for r in rows if r.model == "tinyllama-1.1b" and r.kind == "decode"][:1]
    coefs, notes = fit_decode(tiny, Prior(anchor.decode, anchor.prefill, "m2-ultra"))
    assert "bw_gbs" in notes and "layer_us" not in notes
    assert coefs[D_Q] == pytest.approx(anchor.decode[D_Q])


def test_the_m2_ultra_catalog_is_fitted_from_its_current_build_alone():
    """The M2 Ultra's catalog terms come from its 2025-2026 rows (ggerganov's benches file
    and PR #15616, flash attention on); its 2023-2024 builds are fitted apart: mixed in,
    one set of terms cannot hold both (the newer build reads weights faster)."""
    from linkctl.estimate.devicefit import catalog_group

    rows = [r for r in load_rows() if r.device == "m2-ultra" and not r.exclude]
    assert catalog_group(rows, "m2-ultra") == ""
    current = [r for r in rows if not r.group]
    assert {r.date[:4] for r in current} <= {"2025", "2026"}
    assert any("mac-m2-ultra" in r.source for r in current)
    assert len({r.model for r in current}) >= 5 and all(r.flash_attn for r in current)
    older = [r for r in rows if r.group and not r.group.startswith("metal-8e672efe")]
    assert older and all(r.date < "2025" for r in older)
    fits = fit_all(load_rows(), load_spec())
    assert fits["m2-ultra"].n_decode + fits["m2-ultra"].n_prefill == len(current)


def test_a_metal_sliding_window_block_reads_its_window_and_the_gemma_depth0_row_holds():
    """On Metal, flash attention skips the cache chunks the mask fully masks, so gemma-3's
    sliding-window blocks read their 1024-cell window, not the window + 2048-cell
    micro-batch the cache holds (CUDA, the GB10's build, reads that whole view). Charged
    the whole view, the M2 Ultra's depth-0 gemma-3 tg32 was +20.2 % leave-one-out (its
    depth 4096-32768 rows dragged the KV rate down); now it is within the target."""
    from linkctl.estimate.devicefit import loo_fit, row_features
    from linkctl.estimate.features import D_KV

    rows, spec = load_rows(), load_spec()

    def gemma(device: str, depth: int):
        return next(
            r
            for r in rows
            if r.device == device and r.model == "gemma-3-4b" and r.test == "tg32"
            if r.depth == depth
        )

    m = row_model(gemma("m2-ultra", 0))
    swa = len(m.swa_layers())
    full = m.block_count - swa
    per = m.kv_bytes_per_token_per_layer
    pos = 8192 + 16
    mac, spark = gemma("m2-ultra", 8192), gemma("gb10", 8192)
    assert row_features(mac)[D_KV] == pytest.approx(per * (full * pos + swa * m.sliding_window))
    cells = m.sliding_window + spark.ubatch
    assert row_features(spark)[D_KV] == pytest.approx(per * (full * pos + swa * cells))
    row = gemma("m2-ultra", 0)
    loo = row.tok_s * row_time_us(row) / predict_us(loo_fit(rows, row, spec), row)
    assert abs(loo / row.tok_s - 1) <= 0.15
