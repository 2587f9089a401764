"""Per-ggml-type weight read rates: the bytes of each type a token reads, the kernel-rate
priors (data/kernel_rates.toml) and what the fit and the estimate do with them."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from linkctl.core.errors import InputError
from linkctl.estimate.catalog import load_catalog, load_spec
from linkctl.estimate.cost import Participant, estimate
from linkctl.estimate.devicefit import fit_all
from linkctl.estimate.features import D_F16, D_Q, decode_features, weight_type_bytes
from linkctl.estimate.kernel_rates import TypeRate, load_rates, parse_rates
from linkctl.estimate.published import load_rows
from linkctl.gguf.info import read_model
from linkctl.gguf.reader import type_name
from support.catalog_kit import dev
from support.ggufshapes import F32, Q4_0, Q6_K, Q8_0, Shape, nbytes, write_header_only

SMALL = Shape("llama", 512, 4, 8, 8, 1536, 1024, 2048)


def _model(tmp_path: Path, wtype: int):
    shape = dataclasses.replace(SMALL, wtype=wtype)
    return shape, read_model(write_header_only(tmp_path / f"m{wtype}.gguf", shape))


def test_per_type_bytes_are_the_tensors_own(tmp_path):
    """A Q4_0 file mixes Q4_0, Q6_K (attn_v, ffn_down, output) and F32 (norms): each
    type's bytes per token are the sum of its tensors' sizes (an independent table)."""
    shape, m = _model(tmp_path, Q4_0)
    got = weight_type_bytes(m, list(range(m.block_count)), True)
    want: dict[int, int] = {}
    for name, ne, t in shape.tensors():
        if name.startswith("blk.") or name.startswith("output"):
            want[t] = want.get(t, 0) + nbytes(ne, t)
    assert set(got) == {Q4_0, Q6_K, F32}
    assert got == pytest.approx(want)
    # One block alone, without the output head: only its own tensors.
    one = weight_type_bytes(m, [2], False)
    assert one[Q6_K] == sum(
        nbytes(s, t) for n, s, t in shape.tensors() if n.startswith("blk.2.") and t == Q6_K
    )
    # Unpriced (factors None), the quantized feature is every quantized byte.
    f = decode_features(m, list(range(m.block_count)), True, 0)
    assert f[D_Q] == pytest.approx(want[Q4_0] + want[Q6_K])
    assert f[D_F16] == pytest.approx(want[F32])


def test_a_slower_type_is_priced_slower(tmp_path):
    """On a device that reads Q4_0 at half the Q8_0 rate, a Q4_0 model's weight time is
    its Q4_0 bytes over half the bandwidth (plus its Q6_K at the Q8_0 rate), while a Q8_0
    model's is unchanged by the Q4_0 factor."""
    _, q4 = _model(tmp_path, Q4_0)
    _, q8 = _model(tmp_path, Q8_0)
    plain = dev("gpu", 100.0)
    slow = dataclasses.replace(
        plain,
        weight_rates={"Q4_0": TypeRate(0.5, "prior", "test"), "Q6_K": TypeRate(1.0, "prior", "t")},
    )

    def weights_us(model, d):
        head = Participant("head", "head", d, 1e12)
        return estimate(model, [head], None, ctx=512).local.devices[0].weights_us

    layers = list(range(q4.block_count))
    tb = weight_type_bytes(q4, layers, True)
    assert weights_us(q4, slow) - weights_us(q4, plain) == pytest.approx(tb[Q4_0] / (100.0 * 1e3))
    assert weights_us(q8, slow) == pytest.approx(weights_us(q8, plain))
    # --json carries the types priced, with their factor and how each was set.
    head = Participant("head", "head", slow, 1e12)
    types = {
        x["type"]: x for x in estimate(q4, [head], None, ctx=512).local.devices[0].weight_types
    }
    assert types["Q4_0"]["factor"] == 0.5 and types["Q4_0"]["how"] == "prior"
    assert types["Q4_0"]["bytes_per_token"] == int(tb[Q4_0])
    assert types["F32"]["how"] == "f16 term"


def test_the_priors_order_the_types_as_their_sources_do():
    """The kernel tables put every lower-bit type below Q8_0's read rate (M2 Ultra pp1,
    PR #10491 / #10581; GB10 tg, PR #26843): the prior prices them slower per byte."""
    rates = load_rates()
    for fam in ("apple", "nvidia"):
        assert rates[fam]["Q8_0"].factor == 1.0
        for t in ("Q4_0", "Q4_K", "Q5_K", "Q6_K"):
            assert 0.7 < rates[fam][t].factor < 1.0, (fam, t)
            assert rates[fam][t].how in ("prior", "assumed")
    # Q4_0 on the M2 Ultra: 56.00 t/s x 7.93 GiB over 35.89 t/s x 14.62 GiB.
    assert rates["apple"]["Q4_0"].factor == pytest.approx(56.00 * 7.93 / (35.89 * 14.62))
    assert "10491" in rates["apple"]["Q4_0"].source


def test_a_type_the_rows_do_not_pin_is_reported_tied():
    """The M2 Ultra's current rows hold Q4_0 in one model only (gemma-3-4b): its Q4_0 rate
    stays tied to the prior and the fit notes say so; MXFP4 (gpt-oss 20B and 120B beside
    Q8_0 rows) is fitted. The GB10 holds Q4_0 in two models: fitted there."""
    fits = fit_all(load_rows(), load_spec())
    m2 = fits["m2-ultra"]
    assert m2.rates["Q4_0"].how == "prior"
    assert m2.rates["Q4_0"].factor == load_rates()["apple"]["Q4_0"].factor
    assert "Q4_0" in m2.notes["weight_types"] and "tied" in m2.notes["weight_types"]
    assert m2.rates["MXFP4"].how == "fitted"
    assert fits["gb10"].rates["Q4_0"].how == "fitted, on its bound"  # 234 GB/s
    # The shipped catalog carries the same, and a device's JSON load says it.
    cat = load_catalog()
    assert cat["m2-ultra"].weight_rates["Q4_0"].how == "prior"
    assert cat["m2-ultra"].weight_rates["Q4_K"].how == "prior"
    assert cat["gb10"].weight_rates["MXFP4"].how == "fitted"


def test_a_device_without_rows_for_a_type_prices_it_at_its_family_prior(tmp_path):
    """A quantized type with no prior (Q2_K here, none in the tables) is read at the Q8_0
    rate and says so."""
    from linkctl.estimate.weight_types import type_rate

    cat = load_catalog()
    r = type_rate(cat["m2-ultra"], 10)  # Q2_K
    assert type_name(10) == "Q2_K" and r.factor == 1.0 and r.how == "none"


def _base() -> dict:
    return {
        "apple": {
            "reference": "Q8_0",
            "table": [
                {
                    "id": "t",
                    "url": "https://example.invalid/t",
                    "rows": [
                        {"type": "Q4_0", "size_gib": 4.0, "tok_s": 50.0},
                        {"type": "Q8_0", "size_gib": 8.0, "tok_s": 30.0},
                    ],
                }
            ],
        }
    }


def test_bad_kernel_rate_data_is_a_clear_error(tmp_path):
    p = tmp_path / "k.toml"
    ok = parse_rates(_base(), p)
    assert ok["apple"]["Q4_0"].factor == pytest.approx(200 / 240)
    no_speed = _base()
    del no_speed["apple"]["table"][0]["rows"][0]["tok_s"]
    with pytest.raises(InputError, match=r"table 1 row 1: Q4_0: tok_s"):
        parse_rates(no_speed, p)
    no_ref = _base()
    no_ref["apple"]["table"][0]["rows"].pop()
    with pytest.raises(InputError, match="no Q8_0 row"):
        parse_rates(no_ref, p)
    no_url = _base()
    del no_url["apple"]["table"][0]["url"]
    with pytest.raises(InputError, match="lacks url"):
        parse_rates(no_url, p)
    p.write_text("[apple\n")
    from linkctl.estimate.kernel_rates import _load

    with pytest.raises(InputError, match="not valid TOML"):
        _load(str(p))
