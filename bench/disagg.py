#!/usr/bin/env python3
"""Disaggregated serving in the lab: TTFT and total time, local vs disaggregated,
measured beside the predictions, plus the KV transfer's bytes and time.

    sudo .venv/bin/python bench/disagg.py [--lengths 16,256,1024,4096,7000] [--runs 2] [--json]

Stands up a dgx-mac lab (namespaces, 198.18.0.0/15 only), `linkctl setup` on both
ends, writes a tiny random-weight llama GGUF, and runs `linkctl serve` with
serve.mode = "disaggregated" on both hosts (dgx: prefill llama-server + kv-agent on
its link address; mac: decode llama-server on 127.0.0.1:8080 + route on :9999),
with the threshold at 1 token so route disaggregates every prompt. `linkctl model
sync` copies the model to dgx first; its measured Gbit/s is the link throughput the
transfer prediction uses. Then for each prompt length, in turn, --runs times:

  local          the decode server alone (cache_prompt false): prefill + decode on mac
  disaggregated  through route: prefill on dgx, slot saved, moved over the link,
                 restored on mac, decoded on mac

both streamed, TTFT = first streamed token at the client. Route's response headers
give the prefill, transfer and restore times and the bytes moved. Predictions come
from linkctl/estimate/ttft.py with the lab profile (both hosts "cpu").

The lab's two hosts share this machine's CPU, so no speed gain can show here: the
lab measures correctness and the cost of the transfer. The gain on the real pair is
predicted at the end, for the dgx-mac profile and a Llama-3-70B-shaped header.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from labkit import PY, Proc, in_ns, start, wait_status

TESTS = Path(__file__).resolve().parent.parent / "tests"
sys.path.insert(0, str(TESTS))  # support: route_client (the requests), ggufshapes (70B)

DECODE, ROUTE = 8080, 9999


def client(lab: str, *ops: dict) -> list[dict]:
    return json.loads(
        in_ns(lab, "mac", PY, str(TESTS / "support" / "route_client.py"), json.dumps(ops))
    )


def body(prompt: str, n: int, **extra) -> dict:
    return (
        {"prompt": prompt, "n_predict": n, "temperature": 0, "seed": 1, "ignore_eos": True}
        | {"stream": True}
        | extra
    )


def spread(xs: list[float]) -> dict:
    return {"min": min(xs), "max": max(xs), "n": len(xs)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="16,256,1024,4096,7000")
    ap.add_argument("--output", type=int, default=32)
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--embd", type=int, default=512)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    lengths = [int(x) for x in a.lengths.split(",")]

    import tomllib

    import tomli_w

    from linkctl.core.profile import load_profile, parse_profile
    from linkctl.core.records import status_path
    from linkctl.estimate.cost import LinkFigures
    from linkctl.estimate.run import participants
    from linkctl.estimate.ttft import predict
    from linkctl.gguf.info import read_model
    from linkctl.gguf.tiny import TinySpec, write_tiny_llama
    from linkctl.lab import netns
    from support.route_client import prompt_of

    name, tmp, _state, _bins = start("disagg", "network namespaces")
    ctx = 8192
    spec = TinySpec(n_layer=a.layers, n_embd=a.embd, n_ff=a.embd * 2, n_ctx=ctx)
    model = write_tiny_llama(tmp / "tiny.gguf", spec)
    prof, _ = load_profile("dgx-mac")
    lab = netns.up(prof, name)
    procs: list[Proc] = []
    try:
        for h in ("dgx", "mac"):
            in_ns(name, h, "linkctl", "setup")
        data = tomllib.loads(Path(lab.profile_path).read_text())
        data["serve"] |= {
            "mode": "disaggregated",
            "model": model["path"],
            "ctx": ctx,
            "disagg": {"threshold_tokens": 1},
        }
        lab_prof = parse_profile(data)
        pfile = tmp / "disagg.toml"
        pfile.write_text(tomli_w.dumps(data))
        serve = ["linkctl", "serve", "--profile", str(pfile)]
        dgx = Proc(name, "dgx", serve, tmp / "dgx.log")
        procs.append(dgx)
        prefill = status_path("prefill", root=lab.host_state_dir("dgx"))
        wait_status(prefill, dgx, 60, "kv-agent", state="waiting")
        sync = json.loads(
            in_ns(name, "mac", "linkctl", "model", "sync", "--profile", str(pfile), "--json")
        )
        wait_status(prefill, dgx, 120, "prefill llama-server")
        mac = Proc(name, "mac", [*serve, "--skip-probe"], tmp / "mac.log")
        procs.append(mac)
        route = status_path("route", root=lab.host_state_dir("mac"))
        wait_status(route, mac, 180, "route")

        client(
            name, {"port": DECODE, "path": "/completion", "body": body("warm up", 4, stream=False)}
        )
        rows = []
        for n in lengths:
            samples: dict[str, list[dict]] = {"local": [], "disagg": []}
            for run in range(a.runs):
                # A new prompt each run: the prefill server keeps the last prompt in its
                # slot, and the same prompt again would be served from that cache.
                p = prompt_of(n, seed=run)
                loc, dis = client(
                    name,
                    {
                        "port": DECODE,
                        "path": "/completion",
                        "body": body(p, a.output, cache_prompt=False),
                        "stream": True,
                    },
                    {
                        "port": ROUTE,
                        "path": "/completion",
                        "body": body(p, a.output),
                        "stream": True,
                    },
                )
                assert dis["headers"]["x-linkctl-route"] == "disaggregated", dis["headers"]
                for what, d in (("local", loc), ("disaggregated", dis)):
                    last = d["events"][-1] if d.get("events") else {}
                    if d["status"] != 200 or last.get("tokens_predicted") != a.output:
                        raise RuntimeError(f"{what} {n} tokens: not {a.output} tokens: {d}")
                samples["local"].append(loc)
                samples["disagg"].append(dis)
            h = [d["headers"] for d in samples["disagg"]]
            last = samples["local"][0]["events"][-1]
            n_prompt = last.get("tokens_evaluated") or last.get("timings", {}).get("prompt_n")
            rows.append(
                {
                    "prompt_tokens": n_prompt,
                    "local_ttft_s": spread([d["first_event_s"] for d in samples["local"]]),
                    "local_total_s": spread([d["total_s"] for d in samples["local"]]),
                    "disagg_ttft_s": spread([d["first_event_s"] for d in samples["disagg"]]),
                    "disagg_total_s": spread([d["total_s"] for d in samples["disagg"]]),
                    "prefill_s": spread([float(x["x-linkctl-prefill-s"]) for x in h]),
                    "transfer_s": spread([float(x["x-linkctl-transfer-s"]) for x in h]),
                    "restore_s": spread([float(x["x-linkctl-restore-s"]) for x in h]),
                    "save_s": spread([float(x["x-linkctl-save-s"]) for x in h]),
                    "kv_bytes": int(h[0]["x-linkctl-transfer-bytes"]),
                }
            )
    finally:
        for proc in procs:
            proc.stop()
        netns.down(name)

    info = read_model(model["path"])
    parts, _ = participants(lab_prof)
    link = LinkFigures(rtt_us=50.0, throughput_gbps=sync["gbps"], source="model sync in this run")
    for row in rows:
        pr = predict(info, parts, link, ctx, row["prompt_tokens"], a.output, "dgx")
        plans = {x.name: x for x in pr.plans}
        row["pred"] = {
            "local_ttft_s": plans["local"].ttft_s,
            "local_total_s": plans["local"].total_s,
            "disagg_ttft_s": plans["disaggregated"].ttft_s,
            "disagg_total_s": plans["disaggregated"].total_s,
            "kv_bytes": plans["disaggregated"].kv_bytes,
            "wire_s": plans["disaggregated"].terms_s["KV over the link"],
        }
    from support.ggufshapes import LLAMA_70B, write_header_only

    real, _ = load_profile("dgx-mac")
    big = read_model(write_header_only(tmp / "70b.gguf", LLAMA_70B))
    rparts, _ = participants(real)
    rlink = LinkFigures(rtt_us=150.0, throughput_gbps=9.4, source="what-if: 9.4 Gbit/s, 150 us")
    real_rows = []
    for n in (128, 512, 2048, 4096, 8000):
        pr = predict(big, rparts, rlink, 8192, n, 256, "dgx")
        real_rows.append(
            {
                "prompt_tokens": n,
                "threshold": pr.threshold_tokens,
                "winner_ttft": pr.winner_ttft,
                "winner_total": pr.winner_total,
                **{f"{x.name}_ttft_s": x.ttft_s for x in pr.plans},
                **{f"{x.name}_total_s": x.total_s for x in pr.plans},
            }
        )
    out = {
        "model": {k: model[k] for k in ("params", "bytes", "n_layer", "n_embd")},
        "link_gbps_model_sync": sync["gbps"],
        "output_tokens": a.output,
        "runs": a.runs,
        "lab": rows,
        "dgx_mac_70b_predicted": real_rows,
        "logs": str(tmp),
    }
    if a.json:
        print(json.dumps(out, indent=2))
        return 0
    m = out["model"]
    print(
        f"lab: tiny llama {m['n_layer']} layers, n_embd {m['n_embd']}, "
        f"{m['bytes'] / 2**20:.0f} MiB; "
        f"{a.output} output tokens; {a.runs} runs each (min-max); link by model sync "
        f"{sync['gbps']:.2f} Gbit/s; machine shared"
    )
    print(
        f"{'prompt':>6} | {'local TTFT s':>15} {'pred':>6} | {'disagg TTFT s':>15} {'pred':>6} | "
        f"{'local total s':>15} {'disagg total s':>15} | {'KV MiB':>7} {'pred/meas':>9} | "
        f"{'move s':>13} {'wire pred':>9} | {'save s':>13} {'restore s':>13} | "
        f"{'dgx prefill s':>13}"
    )

    def mm(d: dict) -> str:
        return f"{d['min']:.3f}-{d['max']:.3f}"

    for r in rows:
        p = r["pred"]
        print(
            f"{r['prompt_tokens']:>6} | {mm(r['local_ttft_s']):>15} {p['local_ttft_s']:6.3f} | "
            f"{mm(r['disagg_ttft_s']):>15} {p['disagg_ttft_s']:6.3f} | "
            f"{mm(r['local_total_s']):>15} {mm(r['disagg_total_s']):>15} | "
            f"{r['kv_bytes'] / 2**20:7.2f} {p['kv_bytes'] / r['kv_bytes']:9.3f} | "
            f"{mm(r['transfer_s']):>13} {p['wire_s']:9.4f} | "
            f"{mm(r['save_s']):>13} {mm(r['restore_s']):>13} | {mm(r['prefill_s']):>13}"
        )
    print("\ndgx-mac (predicted, Llama-3-70B shape, 256 output tokens, 9.4 Gbit/s):")
    print(
        f"{'prompt':>6} {'local TTFT':>10} {'split TTFT':>10} {'disagg TTFT':>11} "
        f"{'local total':>11} {'disagg total':>12}  winner (TTFT / total)"
    )
    for r in real_rows:
        print(
            f"{r['prompt_tokens']:>6} {r['local_ttft_s']:10.2f} {r['split_ttft_s']:10.2f} "
            f"{r['disaggregated_ttft_s']:11.2f} {r['local_total_s']:11.2f} "
            f"{r['disaggregated_total_s']:12.2f}  {r['winner_ttft']} / {r['winner_total']}"
        )
    print(f"threshold (disaggregate from): {real_rows[0]['threshold']} tokens; logs: {out['logs']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
