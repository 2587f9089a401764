"""Predicted vs measured decode tokens/s over the lab link, with injected delay.

Needs root (namespaces) and the llama.cpp binaries (scripts/build-llama.sh).

1. A fresh lab (`linkctl lab up --profile dgx-mac`), `linkctl setup` on both ends.
2. A tiny random-weight llama GGUF (linkctl.tinymodel; F32, 8 layers x 512 wide,
   ~110 MB: big enough that a token is memory-bound work, small enough for CI).
3. `linkctl calibrate --rpc` inside the dgx namespace: this host's real decode
   bandwidth and the fixed per-token cost of one RPC boundary (loopback).
4. ggml-rpc-server on dgx 198.18.100.2:50052; the delay proxy (python -m
   linkctl.delayproxy) in the dgx namespace on :50053 in front of it, delaying
   each direction by D ms; llama-server in the mac namespace with
   --rpc 198.18.100.2:50053 (CPU-only build: every layer is on the rpc device,
   the head keeps the input embeddings).
5. For D in 0, 0.25, 1, 2 ms:
   - the link round trip through the proxy, from mac: p50 of 200
     GET_DEVICE_MEMORY exchanges (before llama-server connects: rpc-server
     serves one client at a time);
   - measured: the fastest of --runs /completion runs of N tokens (llama-server's
     timings.predicted_per_second; other load only slows runs down), median beside it;
   - round trips per token: the proxy's counters across two requests of 16 and
     16+N tokens, difference / N (prefill cancels out);
   - predicted: `linkctl estimate --json` in the mac namespace with that RTT,
     the link throughput (iperf3 between the namespaces), the dgx calibration,
     and --ctx = the run's mean context.
6. A table with the error of each point; target +-15%.

    sudo .venv/bin/python bench/estimate_accuracy.py [--tokens 64] [--threads 1] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PY = sys.executable
DELAYS_MS = (0.0, 0.25, 1.0, 2.0)
TARGET_PCT = 15.0

# Runs inside a namespace: timed /completion requests against llama-server on 127.0.0.1.
COMPLETE = r"""
import json, sys, urllib.request
port, n, runs = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
prompt = sys.argv[4]
def post(n_predict):
    body = json.dumps({"prompt": prompt, "n_predict": n_predict, "ignore_eos": True,
                       "temperature": 0, "cache_prompt": False, "seed": 0}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/completion", body,
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.loads(r.read())["timings"]
out = [post(n) for _ in range(runs)]
print(json.dumps(out))
"""

HEALTH = r"""
import sys, time, urllib.request
port, deadline = int(sys.argv[1]), time.monotonic() + float(sys.argv[2])
while time.monotonic() < deadline:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
            if r.status == 200:
                sys.exit(0)
    except Exception:
        pass
    time.sleep(0.2)
sys.exit(1)
"""

RTT = r"""
import sys
from linkctl.calibrate import rpc_rtt_us
print(rpc_rtt_us(int(sys.argv[2]), 200, host=sys.argv[1]))
"""


def run(argv: list[str], timeout: float = 600, check: bool = True, env=None) -> str:
    r = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=env)
    if check and r.returncode != 0:
        raise SystemExit(f"failed: {' '.join(argv)}\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}")
    return r.stdout


def linkctl(*args: str, timeout: float = 600) -> str:
    return run([PY, "-m", "linkctl", *args], timeout=timeout)


def in_ns(lab: str, host: str, *argv: str, timeout: float = 600) -> str:
    return linkctl("lab", "exec", host, "--name", lab, "--", *argv, timeout=timeout)


class Proc:
    """A child in a namespace, stopped by its own pid."""

    def __init__(self, lab: str, host: str, argv: list[str], log: Path):
        self.log = log
        self.f = log.open("w")
        self.p = subprocess.Popen(
            [PY, "-m", "linkctl", "lab", "exec", host, "--name", lab, "--", *argv],
            stdout=self.f,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def stop(self) -> None:
        if self.p.poll() is None:
            os.killpg(self.p.pid, 15)
            try:
                self.p.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(self.p.pid, 9)
                self.p.wait(5)
        self.f.close()


def wait_port(lab: str, host: str, addr: str, port: int, timeout: float = 30) -> None:
    code = (
        "import socket,sys,time\nd=time.monotonic()+float(sys.argv[3])\n"
        "while time.monotonic()<d:\n s=socket.socket()\n s.settimeout(0.5)\n"
        " if s.connect_ex((sys.argv[1],int(sys.argv[2])))==0: sys.exit(0)\n"
        " s.close(); time.sleep(0.1)\nsys.exit(1)"
    )
    in_ns(lab, host, PY, "-c", code, addr, str(port), str(timeout), timeout=timeout + 10)


def proxy_stats(path: Path) -> dict:
    for _ in range(50):
        try:
            return json.loads(path.read_text())
        except (OSError, ValueError):
            time.sleep(0.1)
    raise SystemExit(f"no proxy stats in {path}")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--keep", action="store_true", help="leave the lab up")
    a = ap.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("needs root (network namespaces)")
    from linkctl.llama import find_bins
    from linkctl.tinymodel import TinySpec, write_tiny_llama

    bins = find_bins(versions=False)
    if not (bins.rpc_server and bins.llama_server):
        raise SystemExit("llama.cpp binaries not found: run scripts/build-llama.sh")
    name = "ea" + uuid.uuid4().hex[:6]
    work = Path(tempfile.mkdtemp(prefix="estimate-accuracy-"))
    env_state = os.environ.setdefault("LINKCTL_STATE_DIR", str(work / "state"))
    procs: list[Proc] = []
    rows = []
    try:
        linkctl("lab", "up", "--profile", "dgx-mac", "--name", name, "--json")
        lab = json.loads((Path(env_state) / "lab" / name / "lab.json").read_text())
        for h in ("dgx", "mac"):
            in_ns(name, h, "linkctl", "setup")
        # The lab's llama.cpp is a CPU build: both ends are "cpu" devices here (a CPU-only
        # head holds no layers), whatever the real profile says.
        import tomllib

        import tomli_w

        pdata = tomllib.loads(Path(lab["profile_path"]).read_text())
        for h in pdata["hosts"]:
            h["device"], h["memory_gb"] = "cpu", 16
        cpu_profile = work / "profile-cpu.toml"
        cpu_profile.write_text(tomli_w.dumps(pdata))
        dgx_ip = next(h["address"] for h in lab["hosts"] if h["name"] == "dgx").split("/")[0]
        model = write_tiny_llama(
            work / "tiny.gguf", TinySpec(n_layer=8, n_embd=512, n_head=8, n_ff=1536, n_ctx=1024)
        )
        mpath = model["path"]
        t = str(a.threads)

        # Calibrate on the host that will run the layers (dgx), alone and via loopback RPC.
        cal = json.loads(
            in_ns(
                name,
                "dgx",
                "linkctl",
                "calibrate",
                "--profile",
                str(cpu_profile),
                "--model",
                mpath,
                "--rpc",
                "--threads",
                t,
                "--tokens",
                str(a.tokens),
                "--runs",
                str(a.runs),
                "--json",
                timeout=1200,
            )
        )
        cal_file = Path(cal["saved_to"])

        # Link throughput, as `linkctl probe` would measure it (iperf3 between the ends).
        srv = Proc(name, "dgx", ["iperf3", "-s", "-B", dgx_ip], work / "iperf3-s.log")
        procs.append(srv)
        wait_port(name, "dgx", dgx_ip, 5201)
        ip = json.loads(in_ns(name, "mac", "iperf3", "-c", dgx_ip, "-t", "2", "-J"))
        thr_gbps = ip["end"]["sum_received"]["bits_per_second"] / 1e9
        srv.stop()
        procs.remove(srv)

        rpc = Proc(
            name,
            "dgx",
            [bins.rpc_server.path, "-H", dgx_ip, "-p", "50052", "-t", t],
            work / "rpc-server.log",
        )
        procs.append(rpc)
        wait_port(name, "dgx", dgx_ip, 50052)
        prompt = "the link between two machines carries activations for every token " * 2
        for delay in DELAYS_MS:
            stats = work / f"proxy-{delay}.json"
            proxy = Proc(
                name,
                "dgx",
                [
                    PY,
                    "-m",
                    "linkctl.delayproxy",
                    "--listen",
                    f"{dgx_ip}:50053",
                    "--target",
                    f"{dgx_ip}:50052",
                    "--delay-ms",
                    str(delay),
                    "--stats-file",
                    str(stats),
                ],
                work / f"proxy-{delay}.log",
            )
            procs.append(proxy)
            wait_port(name, "dgx", dgx_ip, 50053)
            rtt = float(in_ns(name, "mac", PY, "-c", RTT, dgx_ip, "50053").strip())
            head = Proc(
                name,
                "mac",
                [
                    bins.llama_server.path,
                    "-m",
                    mpath,
                    "-c",
                    "1024",
                    "-np",
                    "1",
                    "-ngl",
                    "99",
                    "-t",
                    t,
                    "--host",
                    "127.0.0.1",
                    "--port",
                    "8080",
                    "--rpc",
                    f"{dgx_ip}:50053",
                ],
                work / f"llama-server-{delay}.log",
            )
            procs.append(head)
            in_ns(name, "mac", PY, "-c", HEALTH, "8080", "300", timeout=320)
            in_ns(name, "mac", PY, "-c", COMPLETE, "8080", "4", "1", prompt)  # warm-up
            s0 = proxy_stats(stats)
            in_ns(name, "mac", PY, "-c", COMPLETE, "8080", "16", "1", prompt)
            time.sleep(0.5)
            s1 = proxy_stats(stats)
            timings = json.loads(
                in_ns(name, "mac", PY, "-c", COMPLETE, "8080", str(16 + a.tokens), "1", prompt)
            )
            time.sleep(0.5)
            s2 = proxy_stats(stats)
            runs = json.loads(
                in_ns(name, "mac", PY, "-c", COMPLETE, "8080", str(a.tokens), str(a.runs), prompt)
            )
            # The fastest run, as calibrate keeps: the other engineers' jobs on this 2-core
            # machine only ever slow a run down. The median is reported beside it.
            measured = max(r["predicted_per_second"] for r in runs)
            measured_median = statistics.median(r["predicted_per_second"] for r in runs)
            prompt_n = runs[0]["prompt_n"]
            turns_per_tok = ((s2["turns"] - s1["turns"]) - (s1["turns"] - s0["turns"])) / a.tokens
            cmds = {
                k: (
                    (s2["rpc_commands"].get(k, 0) - s1["rpc_commands"].get(k, 0))
                    - (s1["rpc_commands"].get(k, 0) - s0["rpc_commands"].get(k, 0))
                )
                / a.tokens
                for k in s2["rpc_commands"]
            }
            bytes_per_tok = (
                ((s2["c2s_bytes"] + s2["s2c_bytes"]) - (s1["c2s_bytes"] + s1["s2c_bytes"]))
                - ((s1["c2s_bytes"] + s1["s2c_bytes"]) - (s0["c2s_bytes"] + s0["s2c_bytes"]))
            ) / a.tokens
            head.stop()
            procs.remove(head)
            proxy.stop()
            procs.remove(proxy)
            est = json.loads(
                in_ns(
                    name,
                    "mac",
                    "linkctl",
                    "estimate",
                    "--profile",
                    str(cpu_profile),
                    "--model",
                    mpath,
                    "--rtt-us",
                    f"{rtt:.1f}",
                    "--throughput-gbps",
                    f"{thr_gbps:.3f}",
                    "--calibration",
                    str(cal_file),
                    "--ctx",
                    str(int(prompt_n + a.tokens / 2)),
                    "--json",
                )
            )
            predicted = est["split"]["decode_tok_s"]
            rows.append(
                {
                    "delay_ms": delay,
                    "rtt_us": rtt,
                    "measured_tok_s": measured,
                    "measured_runs": [r["predicted_per_second"] for r in runs],
                    "measured_median_tok_s": measured_median,
                    "predicted_tok_s": predicted,
                    "error_pct": (predicted - measured) / measured * 100,
                    "round_trips_per_token": turns_per_tok,
                    "rpc_commands_per_token": {k: v for k, v in cmds.items() if v},
                    "wire_bytes_per_token": bytes_per_tok,
                    "predicted_terms_us": est["split"]["terms_us"],
                    "timings_16_plus_n": timings,
                }
            )
    finally:
        for p in reversed(procs):
            p.stop()
        if not a.keep:
            run([PY, "-m", "linkctl", "lab", "down", "--name", name], check=False)
    ok = all(abs(r["error_pct"]) <= TARGET_PCT for r in rows)
    result = {
        "model": model,
        "threads": a.threads,
        "tokens": a.tokens,
        "link_throughput_gbps": thr_gbps,
        "calibration": {
            k: cal.get(k)
            for k in ("decode_tok_s", "effective_bandwidth_gbs", "rpc_overhead_us", "rpc")
        },
        "rows": rows,
        "target_pct": TARGET_PCT,
        "all_within_target": ok,
    }
    if a.json:
        print(json.dumps(result, indent=2))
    else:
        c = result["calibration"]
        print(
            f"tiny model {model['bytes'] / 1e6:.0f} MB F32, {a.threads} thread(s); calibrated "
            f"local {c['decode_tok_s']:.1f} tok/s = {c['effective_bandwidth_gbs']:.2f} GB/s, "
            f"RPC overhead {c['rpc_overhead_us']:.0f} µs/token; link {thr_gbps:.1f} Gbit/s"
        )
        print(
            f"{'one-way delay':>14}{'RTT':>9}{'measured':>10}{'predicted':>11}{'error':>8}"
            f"{'RT/token':>10}"
        )
        for r in rows:
            print(
                f"{r['delay_ms']:>11.2f} ms{r['rtt_us']:>6.0f} µs{r['measured_tok_s']:>10.1f}"
                f"{r['predicted_tok_s']:>11.1f}{r['error_pct']:>+7.1f}%"
                f"{r['round_trips_per_token']:>10.2f}"
            )
        print(
            f"target +-{TARGET_PCT:.0f}%: {'met' if ok else 'NOT met'} at every point"
            if ok
            else f"target +-{TARGET_PCT:.0f}%: NOT met at every point"
        )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
