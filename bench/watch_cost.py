#!/usr/bin/env python3
"""What serve's watch costs: decode tokens/s of a watched pair against an unwatched one
decoding at the same time, and the canary's wall time, in the lab.

    sudo .venv/bin/python bench/watch_cost.py [--rounds 8] [--runs 8] [--tokens 64] [--json]

On this shared 2-core machine decode moves by 10-20% between back-to-back runs (other
jobs' load), far more than the watch's cost: two runs of one pair, first without the
watch and then with it, cannot resolve 1%. So two labs (dgx-mac each: namespaces,
198.18.0.0/15 only) run side by side, each its own `linkctl serve` on both hosts and its
own client, every process of a lab on a CPU of its own (affinity), and decode at the
same time: what slows the machine slows both, and each round's ratio watched /
unwatched keeps what differs, the watch. (Sharing both CPUs, the pair whose head
started first decoded 10-20% slower, whichever it was.) Which lab is watched swaps
every round and which head starts first every two rounds, so a difference between the
labs themselves (their CPUs), or the order, cancels out too.

Per lab: `linkctl setup` on both ends, a tiny random-weight llama (8 layers x 512: a
token is several ms of work here), rpc-server under `linkctl serve`, and `linkctl
verify` on the head (it records the canary's fingerprint). Per round and mode:

  on      the default: the watch every 5 s, the canary after the start and every 60 s
  busy    the watch every 1 s, the canary every 10 s (the lab tests' pace)

against `off` (serve.watch_interval_s = 0) in the other lab: both heads started, the
watched one's canary after the start waited for, one warm-up request each, then --runs
completions of --tokens tokens in both labs at once (llama-server's own
timings.predicted_per_second). Reported per mode: the rounds' ratios of medians, and
the order-balanced ones (the geometric mean of two rounds on the same lab, started in
either order), median with min-max (target: the watch costs under 1%, a balanced
median >= 0.99), `linkctl
serve`'s own CPU while it served (the supervisor, its log pump and, when on, the watch),
one reading's wall time, and the canary's wall time. Both labs are torn down at the
end, whatever happens.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import threading
import time
from pathlib import Path

from labkit import COMPLETE, PROMPT, PY, CpuLimit, Proc, in_ns, start, wait_status

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


def together(pairs: dict[str, Pair], tokens: int, runs: int) -> dict[str, list[dict]]:
    """Each pair's completions, all pairs at the same time."""
    out: dict[str, list[dict]] = {}

    def go(mode: str, p: Pair) -> None:
        out[mode] = p.complete(tokens, runs)

    threads = [threading.Thread(target=go, args=x) for x in pairs.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def spread(xs: list[float], digits: int = 3) -> str:
    return f"{statistics.median(xs):.{digits}f} ({min(xs):.{digits}f}-{max(xs):.{digits}f})"


class Pair:
    """One lab with rpc-server served, a model, and a profile per mode."""

    def __init__(self, tmp: Path, name: str, model: str, cpu: int):
        import tomllib

        import tomli_w

        from linkctl.core.profile import load_profile
        from linkctl.core.records import status_path
        from linkctl.lab import netns

        self.name, self.tmp = name, tmp
        # Every process of this pair (serve, its servers, the client) on one CPU of its
        # own: the other pair's llama.cpp threads never share it.
        self.limit = CpuLimit(cpus={cpu})
        self.lab = netns.up(load_profile("dgx-mac")[0], name)
        self.procs: list[Proc] = []
        for h in ("dgx", "mac"):
            in_ns(name, h, "linkctl", "setup")
        base = tomllib.loads(Path(self.lab.profile_path).read_text())
        base["serve"] |= {"ctx": 1024, "model": model}
        self.profiles = {}
        for mode, extra in MODES.items():
            d = json.loads(json.dumps(base))
            d["serve"] |= extra
            self.profiles[mode] = tmp / f"{name}-{mode}.toml"
            self.profiles[mode].write_text(tomli_w.dumps(d))
        rpc = Proc(name, "dgx", ["linkctl", "serve", "--profile", str(self.profiles["off"])],
                   tmp / f"{name}-dgx.log", limit=self.limit)  # fmt: skip
        self.procs.append(rpc)
        wait_status(status_path("rpc", self.lab.host_state_dir("dgx")), rpc, 60, "rpc-server")
        in_ns(name, "mac", "linkctl", "verify", "--profile", str(self.profiles["on"]),
              "--model", model, timeout=600, limit=self.limit)  # fmt: skip
        self.status = status_path("head", self.lab.host_state_dir("mac"))

    def head(self, mode: str, tag: str) -> Proc:
        p = Proc(self.name, "mac",
                 ["linkctl", "serve", "--skip-probe", "--profile", str(self.profiles[mode])],
                 self.tmp / f"{self.name}-mac-{tag}.log", limit=self.limit)  # fmt: skip
        wait_status(self.status, p, 120, f"llama-server ({mode})")
        if mode != "off":  # the canary after the start: its cost is its own figure
            wait_canary(self.status)
        self.complete(8, 1)  # warm-up
        return p

    def complete(self, tokens: int, runs: int) -> list[dict]:
        argv = [PY, "-c", COMPLETE, str(PORT), str(tokens), str(runs), PROMPT]
        return json.loads(in_ns(self.name, "mac", *argv, limit=self.limit))

    def close(self) -> None:
        from linkctl.lab import netns

        for p in self.procs:
            p.stop()
        netns.down(self.name)
        self.limit.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=8, help="rounds per mode (4k: all swaps)")
    ap.add_argument("--runs", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    from linkctl.gguf.tiny import TinySpec, write_tiny_llama

    name, tmp, _state, _bins = start("watchcost", "network namespaces")
    model = write_tiny_llama(tmp / "tiny.gguf", TinySpec(n_layer=8, n_embd=512, n_ff=1024))
    pairs: list[Pair] = []
    ratios: dict[str, list[float]] = {"on": [], "busy": []}
    decode: dict[str, list[float]] = {"off": [], "on": [], "busy": []}
    cpu: dict[str, list[float]] = {"off": [], "on": [], "busy": []}
    sample_ms: dict[str, list[float]] = {"on": [], "busy": []}
    canary_s: list[float] = []
    try:
        for k in range(2):
            pairs.append(Pair(tmp, f"{name[:6]}{k}", model["path"], cpu=k))
        for mode in ("on", "busy"):
            for rnd in range(a.rounds):
                watched, other = (pairs[0], pairs[1]) if rnd % 2 == 0 else (pairs[1], pairs[0])
                # Which head starts first alternates too (every two rounds): on 2 cores
                # shared by 8 llama.cpp threads, the start order alone moved decode 10%.
                if (rnd // 2) % 2 == 0:
                    heads = [watched.head(mode, f"{mode}{rnd}"), other.head("off", f"{mode}{rnd}")]
                else:
                    heads = [other.head("off", f"{mode}{rnd}"), watched.head(mode, f"{mode}{rnd}")]
                try:
                    sups = {m: json.loads(p.status.read_text())["pid"]
                            for m, p in ((mode, watched), ("off", other))}  # fmt: skip
                    c0 = {m: cpu_s(pid) for m, pid in sups.items()}
                    t0 = time.monotonic()
                    out = together({mode: watched, "off": other}, a.tokens, a.runs)
                    dt = time.monotonic() - t0
                    for m, pid in sups.items():
                        cpu[m].append(100 * (cpu_s(pid) - c0[m]) / dt)
                    med = {m: statistics.median(r["predicted_per_second"] for r in v)
                           for m, v in out.items()}  # fmt: skip
                    for m, v in out.items():
                        decode[m] += [r["predicted_per_second"] for r in v]
                    ratios[mode].append(med[mode] / med["off"])
                    w = json.loads(watched.status.read_text()).get("watch") or {}
                    sample_ms[mode].append(w["figures"]["sample_ms"])
                    if w.get("canary"):
                        canary_s.append(w["canary"]["wall_s"])
                    print(f"{mode} round {rnd + 1} (watched: {watched.name}): "
                          f"{med[mode]:.2f} vs off {med['off']:.2f} tok/s, "
                          f"ratio {ratios[mode][-1]:.3f}", file=sys.stderr)  # fmt: skip
                finally:
                    for h in heads:
                        h.stop()
    finally:
        for p in pairs:
            p.close()
    # Rounds k and k + 2 watch the same lab with the heads started in the other order:
    # their geometric mean cancels the order, which alone moved a round's ratio 10-20%.
    balanced = {
        m: [
            math.sqrt(v[k] * v[k + 2])
            for k in range(len(v) - 2)
            if (k // 2) % 2 == 0 and k + 2 < len(v)
        ]
        for m, v in ratios.items()
    }
    res = {
        "ratio_balanced": {m: spread(v) for m, v in balanced.items() if v},
        "ratio_watched_vs_off": {m: spread(v) for m, v in ratios.items()},
        "decode_tok_s": {m: spread(v, 1) for m, v in decode.items()},
        "serve_cpu_pct_of_a_core": {m: spread(v, 2) for m, v in cpu.items()},
        "sample_ms": {m: spread(v, 2) for m, v in sample_ms.items()},
        "canary_wall_s": spread(canary_s, 2) if canary_s else None,
        "target_ratio": TARGET,
        "met": {m: statistics.median(v) >= TARGET for m, v in balanced.items() if v},
        "rounds": a.rounds,
        "runs": a.runs,
        "tokens": a.tokens,
    }
    if a.json:
        print(json.dumps(res, indent=2))
        return 0
    print(f"{'mode':5} {'ratio watched/off, order-balanced':34} {'every round':24} "
          f"{'serve CPU % of a core':24} one reading, ms")  # fmt: skip
    for m in ("on", "busy"):
        print(f"{m:5} {res['ratio_balanced'].get(m, '-'):34} {res['ratio_watched_vs_off'][m]:24} "
              f"{res['serve_cpu_pct_of_a_core'][m]:24} {res['sample_ms'][m]}")  # fmt: skip
    print(f"off   serve CPU % of a core {res['serve_cpu_pct_of_a_core']['off']}")
    print(f"decode tok/s: {res['decode_tok_s']}")
    print(f"canary wall time: {res['canary_wall_s']} s; target ratio >= {TARGET}: {res['met']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
