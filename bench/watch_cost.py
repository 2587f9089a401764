#!/usr/bin/env python3
"""What serve's watch costs: decode tokens/s with the watch on and off, and the canary's
wall time, on the same pair in the lab.

    sudo .venv/bin/python bench/watch_cost.py [--rounds 3] [--runs 8] [--tokens 64] [--json]

Stands up a dgx-mac lab (namespaces, 198.18.0.0/15 only), `linkctl setup` on both
ends, writes a tiny random-weight llama (8 layers x 512: a token is ~10-30 ms of work
here, as a real model's is tens of ms), runs `linkctl serve` on dgx (rpc-server) and
`linkctl verify` on mac (it records the canary's fingerprint). Then, per round, the
head's `linkctl serve` three ways, one after the other, each mode first in turn:

  off     serve.watch_interval_s = 0 (no watch, no canary)
  on      the default: every 5 s, the canary after the start and every 60 s
  busy    every 1 s, the canary every 10 s (the lab tests' pace)

and --runs completions of --tokens tokens against each (llama-server's own
timings.predicted_per_second; the canary after the start is waited for and the
first request of each start is a warm-up, neither counted). Reported: per mode the
median decode of every run with min-max, the ratio of each round's on/off and
busy/off medians (target: the watch costs under 1%, ratio >= 0.99), `linkctl
serve`'s own CPU while it served (what the watch adds to
the supervisor: the direct cost, which the decode ratio, noisy on a shared 2-core
machine, cannot resolve to 1%), and the canary's wall time from the head's status.
The lab is torn down at the end, whatever happens.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

from labkit import Proc, complete, in_ns, start, wait_status

PORT = 9999
MODES = {
    "off": {"watch_interval_s": 0},
    "on": {"watch_interval_s": 5.0, "canary_interval_s": 60.0},
    "busy": {"watch_interval_s": 1.0, "canary_interval_s": 10.0},
}
TARGET = 0.99


def cpu_s(pid: int) -> float:
    """CPU seconds a process has used, all its threads (the watch is one of serve's)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def wait_canary(path: Path, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        st = json.loads(path.read_text())
        if ((st.get("watch") or {}).get("canary") or {}).get("why") == "start":
            return
        time.sleep(0.1)
    raise SystemExit(f"no canary after the start within {timeout} s")


def spread(xs: list[float]) -> str:
    return f"{statistics.median(xs):.2f} ({min(xs):.2f}-{max(xs):.2f})"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--runs", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    import tomllib

    import tomli_w

    from linkctl.core.profile import load_profile
    from linkctl.core.records import status_path
    from linkctl.gguf.tiny import TinySpec, write_tiny_llama
    from linkctl.lab import netns

    name, tmp, _state, _bins = start("watchcost", "network namespaces")
    model = write_tiny_llama(tmp / "tiny.gguf", TinySpec(n_layer=8, n_embd=512, n_ff=1024))
    lab = netns.up(load_profile("dgx-mac")[0], name)
    procs: list[Proc] = []
    rows: dict[str, list[float]] = {m: [] for m in MODES}
    ratios: dict[str, list[float]] = {m: [] for m in MODES if m != "off"}
    canary_s: list[float] = []
    cpu: dict[str, list[float]] = {m: [] for m in MODES}  # serve's own CPU s per s
    sample_ms: dict[str, list[float]] = {m: [] for m in MODES if m != "off"}
    try:
        for h in ("dgx", "mac"):
            in_ns(name, h, "linkctl", "setup")
        base = tomllib.loads(Path(lab.profile_path).read_text())
        base["serve"] |= {"ctx": 1024, "model": model["path"]}
        profiles = {}
        for mode, extra in MODES.items():
            d = json.loads(json.dumps(base))
            d["serve"] |= extra
            profiles[mode] = tmp / f"{mode}.toml"
            profiles[mode].write_text(tomli_w.dumps(d))
        rpc = Proc(name, "dgx", ["linkctl", "serve", "--profile", str(profiles["off"])],
                   tmp / "dgx.log")  # fmt: skip
        procs.append(rpc)
        wait_status(status_path("rpc", lab.host_state_dir("dgx")), rpc, 60, "rpc-server")
        in_ns(name, "mac", "linkctl", "verify", "--profile", str(profiles["on"]),
              "--model", model["path"], timeout=600)  # fmt: skip
        order = list(MODES)
        for rnd in range(a.rounds):
            medians = {}
            for mode in order[rnd % 3 :] + order[: rnd % 3]:  # each mode first in turn
                head = Proc(
                    name,
                    "mac",
                    ["linkctl", "serve", "--skip-probe", "--profile", str(profiles[mode])],
                    tmp / f"mac-{mode}-{rnd}.log",
                )
                try:
                    path = status_path("head", lab.host_state_dir("mac"))
                    wait_status(path, head, 120, f"llama-server ({mode})")
                    if mode != "off":  # the canary after the start: its cost is its own
                        wait_canary(path)
                    complete(name, "mac", PORT, a.tokens, 1)  # warm-up
                    sup = json.loads(path.read_text())["pid"]
                    c0, t0 = cpu_s(sup), time.monotonic()
                    runs = complete(name, "mac", PORT, a.tokens, a.runs)
                    cpu[mode].append((cpu_s(sup) - c0) / (time.monotonic() - t0))
                    rates = [r["predicted_per_second"] for r in runs]
                    rows[mode] += rates
                    medians[mode] = statistics.median(rates)
                    if mode != "off":
                        w = json.loads(path.read_text()).get("watch") or {}
                        if w.get("canary"):
                            canary_s.append(w["canary"]["wall_s"])
                        sample_ms[mode].append(w["figures"]["sample_ms"])
                finally:
                    head.stop()
            for mode in ratios:
                ratios[mode].append(medians[mode] / medians["off"])
            line = ", ".join(f"{m} {v:.2f}" for m, v in medians.items())
            print(f"round {rnd + 1}: decode tok/s medians: {line}", file=sys.stderr)
    finally:
        for p in procs:
            p.stop()
        netns.down(name)
    out = {
        "decode_tok_s": {m: spread(v) for m, v in rows.items()},
        "ratio_vs_off": {m: spread(v) for m, v in ratios.items()},
        "canary_wall_s": spread(canary_s) if canary_s else None,
        # `linkctl serve`'s own CPU while it served (the supervisor, its log pump and,
        # when on, the watch): of one core, in percent.
        "serve_cpu_pct": {m: spread([100 * x for x in v]) for m, v in cpu.items()},
        # One reading's wall time (link facts, sock_diag, /metrics, ping when idle).
        "sample_ms": {m: spread(v) for m, v in sample_ms.items() if v},
        "target_ratio": TARGET,
        "met": {m: statistics.median(v) >= TARGET for m, v in ratios.items()},
        "rounds": a.rounds,
        "runs": a.runs,
        "tokens": a.tokens,
    }
    if a.json:
        print(json.dumps(out, indent=2))
        return 0
    print(
        f"{'mode':6} {'decode tok/s median (min-max)':32} {'ratio vs off (rounds)':24} "
        "serve's own CPU, % of a core"
    )
    for m, v in rows.items():
        r = out["ratio_vs_off"].get(m, "-")
        print(f"{m:6} {spread(v):32} {r:24} {out['serve_cpu_pct'][m]}")
    print(f"one reading of the watch: {out['sample_ms']} ms")
    print(f"canary wall time: {out['canary_wall_s']} s; target ratio >= {TARGET}: {out['met']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
