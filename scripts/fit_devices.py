#!/usr/bin/env python3
"""Fit the device catalog's decode and prefill terms to public llama-bench results.

Reads linkctl/data/published_bench.toml (every row with its source link) and the
device specs in linkctl/data/devices.toml, fits each device's terms
(linkctl/estimate/devicefit.py: non-negative least squares on relative error, through the
estimator's own feature code) and writes linkctl/data/devices_fit.toml, which
`linkctl estimate` loads. Terms a device's rows do not pin are borrowed from its
family's anchor device and marked "assumed" in that file. Each device's `range` is
the interval `estimate` prints around its figures, from the leave-one-out residuals
(linkctl/estimate/ranges.py).

    .venv/bin/python scripts/fit_devices.py            # rewrite devices_fit.toml
    .venv/bin/python scripts/fit_devices.py --check    # exit 1 if it is out of date
    .venv/bin/python scripts/fit_devices.py --print    # show the terms, write nothing
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from linkctl.estimate.catalog import fit_path, load_spec
from linkctl.estimate.devicefit import fit_all
from linkctl.estimate.fitfile import render_fit_toml, terms
from linkctl.estimate.holdout import (
    catalog_ranges,
    leave_one_out,
    leave_one_source_out,
    residuals,
)
from linkctl.estimate.published import load_rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", type=Path, help="benchmark rows (default: the shipped file)")
    ap.add_argument("--out", type=Path, help="where to write (default: the shipped catalog)")
    ap.add_argument("--check", action="store_true", help="compare, do not write")
    ap.add_argument("--print", dest="show", action="store_true", help="print the terms only")
    a = ap.parse_args()
    rows = load_rows(a.data)
    spec = load_spec()
    fits = fit_all(rows, spec)
    # Each row refitted without it, and each source (about 30 s): the ranges' residuals.
    res = residuals(leave_one_out(rows, spec), leave_one_source_out(rows, spec))
    ranges = catalog_ranges(rows, spec, res)
    text = render_fit_toml(fits, rows, ranges)
    out = a.out or fit_path()
    if a.show:
        for key, f in fits.items():
            d, p = terms(f)
            print(
                f"{key:9} decode layer {d.layer_us:6.1f} µs  moe +{d.moe_layer_us:6.1f} µs  "
                f"bw {d.bw_gbs:6.0f}  f16 {d.bw_f16_gbs:6.0f}  kv {d.kv_bw_gbs:6.0f} GB/s | "
                f"prefill {p.tflops:6.1f} TF  f16 {p.tflops_f16:6.1f}  moe {p.moe_tflops:6.1f}"
                f"  attn {p.attn_tflops:6.1f}  ubatch {p.ubatch_layer_us:6.0f} µs/block"
            )
        return 0
    if a.check:
        same = out.is_file() and out.read_text() == text
        print(f"{out}: {'up to date' if same else 'OUT OF DATE: run scripts/fit_devices.py'}")
        return 0 if same else 1
    out.write_text(text)
    n = sum(1 for r in rows if not r.exclude)
    print(f"wrote {out}: {len(fits)} devices from {n} rows ({len(rows) - n} excluded)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
