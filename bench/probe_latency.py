#!/usr/bin/env python3
"""bench/probe_latency: linkctl's TCP round trip versus sockperf ping-pong, and the
default probe's wall time, on one lab link made for this run.

    sudo .venv/bin/python bench/probe_latency.py [--rounds 5] [--json]

Makes its own lab (dgx-mac profile, unique name), runs `linkctl setup` on
both namespaces, then per round, alternating so both tools see the same
machine load:

- sockperf: `sockperf sr --tcp` in the dgx namespace, `sockperf pp --tcp
  -m 14 -t 3 --full-rtt` from the mac namespace. sockperf's smallest message
  is 14 bytes and by default it reports half the round trip; --full-rtt makes
  its percentiles whole round trips, like linkctl's.
- linkctl: `linkctl responder` in the dgx namespace, `linkctl probe
  --no-throughput --samples N` from the mac namespace; its 1-byte TCP p50
  (1 byte out, 1 byte back; sockperf cannot go below 14 bytes, and at these
  sizes the difference is far below the timer noise).

Then one default `linkctl probe` (throughput included) and its wall time.
Targets: linkctl p50 / sockperf p50 <= 1.5, default probe under 10 s.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import select
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from linkctl.core.checks import Verdict
from linkctl.core.profile import load_profile
from linkctl.core.records import ProbeRecord, parse
from linkctl.lab import netns

SOCKPERF_PORT = 11111
P50_RE = re.compile(r"percentile 50\.000 =\s*([\d.]+)")
P99_RE = re.compile(r"percentile 99\.000 =\s*([\d.]+)")
OBS_RE = re.compile(r"Total (\d+) observations")


def run_in(lab, host: str, argv: list[str], timeout: float = 120) -> subprocess.CompletedProcess:
    a, env = netns.exec_argv(lab, host, argv)
    return subprocess.run(a, env=env, capture_output=True, text=True, timeout=timeout)


def spawn_in(lab, host: str, argv: list[str]) -> subprocess.Popen:
    a, env = netns.exec_argv(lab, host, argv)
    return subprocess.Popen(a, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def wait_line(proc: subprocess.Popen, timeout: float) -> str:
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    if not ready:
        raise SystemExit(f"no output from {proc.args} within {timeout} s")
    return proc.stdout.readline()


def sockperf_round(lab, addr: str, seconds: int) -> dict:
    srv = spawn_in(lab, "dgx", ["sockperf", "sr", "--tcp", "-i", addr, "-p", str(SOCKPERF_PORT)])
    try:
        time.sleep(1.0)
        r = run_in(
            lab,
            "mac",
            [
                "sockperf",
                "pp",
                "--tcp",
                "-i",
                addr,
                "-p",
                str(SOCKPERF_PORT),
                "-m",
                "14",
                "-t",
                str(seconds),
                "--full-rtt",
            ],
            timeout=seconds + 30,
        )
    finally:
        stop(srv)
    out = re.sub(r"\x1b\[[0-9;]*m", "", r.stdout + r.stderr)
    p50, p99, obs = P50_RE.search(out), P99_RE.search(out), OBS_RE.search(out)
    if not p50:
        raise SystemExit(f"sockperf gave no percentiles:\n{out}")
    return {
        "p50_us": float(p50.group(1)),
        "p99_us": float(p99.group(1)) if p99 else None,
        "samples": int(obs.group(1)) if obs else None,
    }


def linkctl_round(lab, samples: int) -> dict:
    r = run_in(
        lab, "mac", ["linkctl", "probe", "--json", "--no-throughput", "--samples", str(samples)]
    )
    (data,) = json.loads(r.stdout)  # one peer: a list of one report
    if data.get("stopped"):
        raise SystemExit(f"probe stopped: {data['stopped']}")
    return data["latency"]["tcp"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--seconds", type=int, default=3, help="sockperf run length per round")
    ap.add_argument(
        "--samples", type=int, default=50000, help="linkctl round trips per size per round"
    )
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if os.geteuid() != 0:
        print("bench/probe_latency needs root (network namespaces)", file=sys.stderr)
        return 2
    own_state = "LINKCTL_STATE_DIR" not in os.environ
    if own_state:
        os.environ["LINKCTL_STATE_DIR"] = tempfile.mkdtemp(prefix="linkctl-bench-")
    name = "b" + uuid.uuid4().hex[:8]
    prof, _ = load_profile("dgx-mac")
    lab = netns.up(prof, name)
    resp = None
    try:
        for h in ("dgx", "mac"):
            r = run_in(lab, h, ["linkctl", "setup"])
            if r.returncode:
                raise SystemExit(f"setup {h} failed: {r.stderr}")
        addr = lab.host("dgx").address.split("/")[0]
        sock_rounds, lk_rounds = [], []
        for _ in range(args.rounds):
            sock_rounds.append(sockperf_round(lab, addr, args.seconds))
            resp = spawn_in(lab, "dgx", ["linkctl", "responder", "--json"])
            wait_line(resp, 30)
            lk_rounds.append(linkctl_round(lab, args.samples))
            stop(resp)
            resp = None
        # The default probe, throughput included, timed from process start.
        resp = spawn_in(lab, "dgx", ["linkctl", "responder", "--json"])
        wait_line(resp, 30)
        t0 = time.monotonic()
        r = run_in(lab, "mac", ["linkctl", "probe", "--json"])
        wall = time.monotonic() - t0
        (one,) = json.loads(r.stdout)  # one peer: a list of one report
        default = parse(ProbeRecord, one, "stdout", "probe report", "rerun")
        stop(resp)
        resp = None
    finally:
        if resp:
            stop(resp)
        netns.down(name)
        if own_state:
            shutil.rmtree(os.environ["LINKCTL_STATE_DIR"], ignore_errors=True)

    sock_p50 = statistics.median(x["p50_us"] for x in sock_rounds)
    lk_p50 = statistics.median(x["1"]["p50_us"] for x in lk_rounds)
    # Both tools are bimodal on this 2-vCPU VM (client and server on one vCPU or two:
    # ~7-10 us versus ~15-25 us per round, for sockperf as much as for linkctl), so
    # also compare the best round of each: the tools' own overhead, placement aside.
    sock_best = min(x["p50_us"] for x in sock_rounds)
    lk_best = min(x["1"]["p50_us"] for x in lk_rounds)
    result = {
        "rounds": args.rounds,
        "sockperf_pp_tcp_14B_full_rtt": {"p50_us_median": sock_p50, "rounds": sock_rounds},
        "linkctl_tcp_1B": {"p50_us_median": lk_p50, "rounds": [x["1"] for x in lk_rounds]},
        "linkctl_tcp_32KiB_p50_us_median": statistics.median(
            x["32768"]["p50_us"] for x in lk_rounds
        ),
        "linkctl_tcp_128KiB_p50_us_median": statistics.median(
            x["131072"]["p50_us"] for x in lk_rounds
        ),
        "ratio_linkctl_over_sockperf": round(lk_p50 / sock_p50, 3),
        "best_round": {
            "sockperf_p50_us": sock_best,
            "linkctl_p50_us": lk_best,
            "ratio": round(lk_best / sock_best, 3),
        },
        "default_probe": {
            "wall_s": round(wall, 2),
            "probe_elapsed_s": default.elapsed_s,
            "exit_code": r.returncode,
            "duration_s_per_iperf3_run": prof.probe.duration_s,
            "not_pass": [
                f"{c.name}: {c.verdict} {c.value} ({c.detail})"
                for c in default.checks
                if c.verdict is not Verdict.PASS
            ],
        },
    }
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(f"rounds: {args.rounds} (medians of per-round p50)")
        print(
            f"sockperf pp --tcp 14 B --full-rtt p50 : {sock_p50:8.1f} us "
            f"({', '.join(str(x['p50_us']) for x in sock_rounds)})"
        )
        print(
            f"linkctl TCP 1 B p50                   : {lk_p50:8.1f} us "
            f"({', '.join(str(x['1']['p50_us']) for x in lk_rounds)})"
        )
        print(f"ratio linkctl / sockperf              : {lk_p50 / sock_p50:8.2f}  (target <= 1.5)")
        print(
            f"best round p50 linkctl / sockperf     : {lk_best:.1f} / {sock_best:.1f} us = "
            f"{lk_best / sock_best:.2f}"
        )
        print(
            f"linkctl TCP 32 KiB / 128 KiB p50      : "
            f"{result['linkctl_tcp_32KiB_p50_us_median']:.1f} / "
            f"{result['linkctl_tcp_128KiB_p50_us_median']:.1f} us"
        )
        print(
            f"default probe wall time               : {wall:8.2f} s (probe itself "
            f"{default['elapsed_s']:.2f} s, exit {r.returncode}; target < 10 s)"
        )
        for line in result["default_probe"]["not_pass"]:
            print(f"  default probe: {line}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
