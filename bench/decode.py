#!/usr/bin/env python3
"""Decode tokens/s for one tiny model: local only vs split over the lab link, in one run.

    sudo .venv/bin/python bench/decode.py [--tokens 64] [--runs 5] [--layers 8] [--json]

Stands up a dgx-mac lab (namespaces, 198.18.0.0/15 only), configures both
ends with `linkctl setup`, writes the tiny random-weight llama GGUF, then on
the head ("mac" namespace) runs llama-server three ways, all at once:

  local   llama-server alone, every layer on the head's CPU
  half    --rpc dgx, half the layers on the rpc-server in the "dgx" namespace
  all     --rpc dgx, every layer on the rpc-server (-ngl 99)

and asks them in turn, round robin, for the same completions (ignore_eos,
so exactly --tokens tokens): load from elsewhere falls on all three alike.
Decode speed is llama-server's own timings.predicted_per_second; the median
of --runs is reported, with min/max. Every server (llama-server, rpc-server)
runs one thread (-t 1), so the comparison is the link, not core count. The lab is torn down
at the end, whatever happens.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from labkit import HEALTH, PY, Proc, complete, in_ns, start

PORT = 9999


def measure(
    lab: str, configs: list[tuple[str, int, list[str]]], tokens: int, runs: int, logdir: Path
) -> list[dict]:
    """Start every configuration's llama-server at once, then ask them in turn
    (round robin), so that load from elsewhere on the machine falls on all alike."""
    procs = [Proc(lab, "mac", argv, logdir / f"llama-server-{n}.log") for n, _p, argv in configs]
    try:
        for _n, port, _a in configs:
            in_ns(lab, "mac", PY, "-c", HEALTH, str(port), "120")
            complete(lab, "mac", port, 8, 1)  # warm-up
        samples: dict[str, list[dict]] = {n: [] for n, _p, _a in configs}
        for _ in range(runs):
            for n, port, _a in configs:
                (d,) = complete(lab, "mac", port, tokens, 1)
                assert d["tokens_predicted"] == tokens, d
                samples[n].append(d)
    finally:
        for proc in procs:
            proc.stop()
    out = []
    for n, _port, argv in configs:
        tps = [x["predicted_per_second"] for x in samples[n]]
        out.append(
            {
                "config": n,
                "argv": argv,
                "tokens": tokens,
                "runs": runs,
                "decode_tps_median": round(statistics.median(tps), 1),
                "decode_tps_min": round(min(tps), 1),
                "decode_tps_max": round(max(tps), 1),
                "ms_per_token_median": round(
                    statistics.median(x["predicted_per_token_ms"] for x in samples[n]), 3
                ),
            }
        )
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--embd", type=int, default=256)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    from linkctl.core.profile import load_profile
    from linkctl.gguf.tiny import TinySpec, write_tiny_llama
    from linkctl.lab import netns

    name, tmp, _state, bins = start("decode", "network namespaces")
    rpc_bin, server_bin = bins.rpc_server.path, bins.llama_server.path
    model = write_tiny_llama(
        tmp / "tiny.gguf", TinySpec(n_layer=a.layers, n_embd=a.embd, n_ff=a.embd * 2)
    )
    prof, _ = load_profile("dgx-mac")
    lab = netns.up(prof, name)
    rpc_procs: list[Proc] = []
    try:
        for h in ("dgx", "mac"):
            in_ns(name, h, "linkctl", "setup")
        dgx_ip = lab.host("dgx").address.split("/")[0]
        # one rpc-server per split configuration: each serves one client at a time
        for port in (50052, 50053):
            rpc_procs.append(
                Proc(
                    name,
                    "dgx",
                    [rpc_bin, "-H", dgx_ip, "-p", str(port), "-t", "1"],
                    tmp / f"rpc-server-{port}.log",
                )
            )
            # HELLO from inside the head's namespace, over the link
            in_ns(
                name,
                "mac",
                PY,
                "-c",
                "import sys; from linkctl.llama.rpc import wait_ready; "
                "print(wait_ready(sys.argv[1], int(sys.argv[2]), 30))",
                dgx_ip,
                str(port),
            )

        def server(port: int, *extra: str) -> list[str]:
            return [
                server_bin,
                "-m",
                model["path"],
                "-c",
                "512",
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "-t",
                "1",
                "--no-warmup",
                *extra,
            ]

        configs = [
            ("local", PORT, server(PORT, "-ngl", "0")),
            (
                "half",
                PORT + 1,
                server(PORT + 1, "--rpc", f"{dgx_ip}:50052", "-ngl", str(a.layers // 2)),
            ),
            ("all", PORT + 2, server(PORT + 2, "--rpc", f"{dgx_ip}:50053", "-ngl", "99")),
        ]
        t0 = time.time()
        results = measure(name, configs, a.tokens, a.runs, tmp)
        out = {
            "model": {k: model[k] for k in ("params", "bytes", "n_layer", "n_embd", "n_ff")},
            "link": f"veth between lab namespaces, MTU {prof.link.mtu}",
            "elapsed_s": round(time.time() - t0, 1),
            "results": results,
            "logs": str(tmp),
        }
    finally:
        for p in rpc_procs:
            p.stop()
        netns.down(name)
    if a.json:
        print(json.dumps(out, indent=2))
        return 0
    m = out["model"]
    print(
        f"tiny llama: {m['n_layer']} layers, n_embd {m['n_embd']}, {m['params']} params, "
        f"{m['bytes'] / 2**20:.1f} MiB; {a.tokens} tokens x {a.runs} runs; {out['link']}"
    )
    print(f"{'config':8} {'decode tok/s (median)':>22} {'min':>8} {'max':>8} {'ms/token':>9}")
    for r in results:
        print(
            f"{r['config']:8} {r['decode_tps_median']:>22} {r['decode_tps_min']:>8} "
            f"{r['decode_tps_max']:>8} {r['ms_per_token_median']:>9}"
        )
    base = results[0]["decode_tps_median"]
    for r in results[1:]:
        print(f"{r['config']} / local = {r['decode_tps_median'] / base:.2f}x")
    print(f"logs: {out['logs']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
