"""How long linkctl takes to read a GGUF header (target: < 0.5 s for any model).

Writes header-only GGUF files shaped like Llama-2-7B, Llama-3-70B and
Qwen3-235B-A22B (full tensor infos and a full-size vocabulary, no tensor
data), plus the 235B file extended to its real size as a sparse file
(~142 GiB, so the reader would have to skip 142 GiB of data it never reads),
then times linkctl.gguf.info.read_model on each: the first read in this
process (includes loading gguf's constants) and the median of 5 more.

    .venv/bin/python bench/gguf_read.py [--json]
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from support.ggufshapes import LLAMA_7B, LLAMA_70B, QWEN3_235B_A22B, write_header_only

TARGET_S = 0.5


def main() -> int:
    from linkctl.gguf.info import read_model

    rows = []
    with tempfile.TemporaryDirectory() as d:
        files = {}
        for name, shape in (
            ("llama-7b", LLAMA_7B),
            ("llama-70b", LLAMA_70B),
            ("qwen3-235b-a22b", QWEN3_235B_A22B),
        ):
            files[name] = write_header_only(Path(d) / f"{name}.gguf", shape)
        m = read_model(files["qwen3-235b-a22b"])
        sparse = Path(d) / "qwen3-235b-a22b-sparse.gguf"
        sparse.write_bytes(files["qwen3-235b-a22b"].read_bytes())
        os.truncate(sparse, m.header_size + max(t.offset + t.nbytes for t in m.tensors))
        files["qwen3-235b-a22b (sparse, full size)"] = sparse
        first = True
        for name, path in files.items():
            t0 = time.perf_counter()
            info = read_model(path)
            cold = time.perf_counter() - t0
            times = []
            for _ in range(5):
                t0 = time.perf_counter()
                read_model(path)
                times.append(time.perf_counter() - t0)
            rows.append(
                {
                    "model": name,
                    "file_bytes": path.stat().st_size,
                    "weights_gib": info.total_bytes / 1024**3,
                    "tensors": len(info.tensors),
                    "first_read_s": cold,
                    "first_includes_constants_load": first,
                    "median_read_s": statistics.median(times),
                    "max_read_s": max([*times, cold]),
                }
            )
            first = False
    ok = all(r["max_read_s"] < TARGET_S for r in rows)
    if "--json" in sys.argv:
        print(json.dumps({"target_s": TARGET_S, "ok": ok, "rows": rows}, indent=2))
    else:
        print(f"{'model':38}{'file':>10}{'weights':>11}{'tensors':>9}{'first':>9}{'median':>9}")
        for r in rows:
            print(
                f"{r['model']:38}{r['file_bytes'] / 1e6:>8.1f}MB{r['weights_gib']:>8.1f}GiB"
                f"{r['tensors']:>9}{r['first_read_s'] * 1000:>7.0f}ms"
                f"{r['median_read_s'] * 1000:>7.0f}ms"
            )
        print(f"target < {TARGET_S * 1000:.0f} ms per read: {'met' if ok else 'NOT met'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
