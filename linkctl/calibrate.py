"""`linkctl calibrate`: measure this host's real llama.cpp figures and store them.

1. llama-server runs the given model alone on this host (127.0.0.1 only). One
   warm-up request, then ``runs`` timed /completion requests of ``tokens``
   decode tokens each (ignore_eos, prompt cache off); llama-server's own
   ``timings`` give decode tok/s (predicted_per_second) and prefill tok/s
   (prompt_per_second); the fastest run is kept (other load on the host only
   ever slows a run down, so the fastest is the least disturbed).
2. effective decode bandwidth = bytes read per token x decode tok/s, with bytes
   per token from the GGUF header exactly as the estimate counts them (active
   weights + output head + KV cache at the mean context of the run). Per-token
   fixed costs (sampling, graph launch) are folded into this figure, as they are
   in any real decode on this host.
3. effective prefill compute = FLOPs per prompt token x prefill tok/s.
4. ``--rpc``: the same model through a ggml-rpc-server on 127.0.0.1 (all layers
   on the RPC device), as this host works when it is the rpc end of a split.
   Its per-token time minus the loopback round trip (timed with
   GET_DEVICE_MEMORY before llama-server connects) gives this host's effective
   bandwidth *as an RPC device* (rpc_effective_bandwidth_gbs), which folds in
   the RPC processing cost (request (de)serialisation, the rpc-server's graph
   dispatch); the estimate uses it for this host's rpc role. The difference to
   the local run is reported as rpc_overhead_us (noisy on a busy host).

The record goes to state_dir()/calibration.json under this host's profile name.
"""

from __future__ import annotations

import json
import socket
import statistics
import struct
import subprocess
import time
import urllib.error
import urllib.request
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from linkctl.errors import CheckFailed, InputError
from linkctl.profile import Profile
from linkctl.runner import Runner, default_runner

PROMPT_WORDS = (
    "the link between two machines carries activations for every token and every layer "
    "boundary so its latency adds to each step of decoding while its bandwidth matters "
    "mostly for the prompt "
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(url: str, body: dict[str, Any], timeout: float) -> dict[str, Any]:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as e:
        detail = e.read().decode(errors="replace")[:300]
        raise CheckFailed(f"llama-server {url} answered HTTP {e.code}: {detail}") from None
    except (urllib.error.URLError, TimeoutError, ConnectionError) as e:
        raise CheckFailed(f"llama-server {url}: {e}") from None


def prompt_tokens(port: int, n: int) -> list[int]:
    """``n`` token ids of plain English text, via llama-server's own tokenizer, so the
    prefill measurement has the same length on every model."""
    r = _post(f"http://127.0.0.1:{port}/tokenize", {"content": PROMPT_WORDS * 40}, 60)
    toks = r.get("tokens") or []
    if len(toks) < n:
        toks = (toks * (n // max(1, len(toks)) + 1))[:n]
    return toks[:n]


def wait_health(port: int, proc: subprocess.Popen, timeout: float, log: Path | None) -> None:
    deadline = time.monotonic() + timeout
    url = f"http://127.0.0.1:{port}/health"
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = log.read_text().strip().splitlines()[-3:] if log and log.exists() else []
            raise CheckFailed(
                f"llama-server exited {proc.returncode} while loading: " + " | ".join(tail)
            )
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
            pass
        time.sleep(0.2)
    raise CheckFailed(f"llama-server on 127.0.0.1:{port} not healthy within {timeout:g} s")


def timed_completions(
    port: int, tokens: int, runs: int, prompt: str | list[int], timeout: float = 600
) -> list[dict[str, float]]:
    """Warm-up, then ``runs`` requests; each run's llama-server timings."""
    url = f"http://127.0.0.1:{port}/completion"
    body = {
        "prompt": prompt,
        "n_predict": tokens,
        "ignore_eos": True,
        "temperature": 0,
        "cache_prompt": False,
        "seed": 0,
    }
    _post(url, {**body, "n_predict": 4}, timeout)
    out = []
    for _ in range(runs):
        r = _post(url, body, timeout)
        t = r.get("timings") or {}
        if not t.get("predicted_per_second"):
            raise CheckFailed(f"llama-server answered without decode timings: {sorted(r)}")
        out.append(
            {
                k: float(t.get(k) or 0)
                for k in (
                    "predicted_per_second",
                    "predicted_n",
                    "prompt_per_second",
                    "prompt_n",
                    "predicted_ms",
                    "prompt_ms",
                )
            }
        )
    return out


def best_run(runs: list[dict[str, float]]) -> dict[str, float]:
    return max(runs, key=lambda r: r["predicted_per_second"])


def rpc_rtt_us(port: int, n: int = 200, host: str = "127.0.0.1") -> float:
    """p50 of GET_DEVICE_MEMORY request/response on one connection to an rpc-server
    (the same kind of exchange as a token's GET_TENSOR, minus the payload)."""
    from linkctl.rpc import CMD_GET_DEVICE_MEMORY, _open_hello

    conn, _v, _f = _open_hello(host, port, 5.0)
    try:
        conn.deadline = time.monotonic() + 60
        ts = []
        for _ in range(n):
            t = time.perf_counter()
            conn.call(CMD_GET_DEVICE_MEMORY, struct.pack("<I", 0))
            ts.append((time.perf_counter() - t) * 1e6)
    finally:
        conn.close()
    return statistics.median(ts)


def decode_bytes_per_token(model, ctx_mean: float) -> int:
    """What the estimate counts for one token with every layer on one device."""
    return (
        sum(model.layer_active_bytes())
        + model.output_bytes
        + int(model.kv_bytes_per_token_per_layer * ctx_mean * model.block_count)
    )


def prefill_flops_per_token(model, ctx_mean: float) -> float:
    params = sum(model.layer_params(active=True)) + model.output_params
    attn = 4 * model.head_count * (model.key_length or 1) * ctx_mean * model.block_count
    return 2 * params + attn


class _Servers:
    """Children started here; all stopped (by their own pid) on exit."""

    def __init__(self, runner: Runner):
        self.runner, self.procs = runner, []

    def spawn(self, argv: list[str], log: Path) -> subprocess.Popen:
        fh = log.open("w")
        p = self.runner.spawn(argv, stdout=fh, stderr=subprocess.STDOUT)
        self.procs.append(p)
        return p

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        for p in reversed(self.procs):
            if p.poll() is None:
                p.terminate()
                try:
                    p.wait(10)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait(5)


def calibrate(
    prof: Profile,
    model_path: Path,
    *,
    host: str | None,
    tokens: int = 64,
    runs: int = 5,
    threads: int | None = None,
    rpc: bool = False,
    bin_dir: str | None = None,
    dry_run: bool = False,
    runner: Runner | None = None,
) -> dict[str, Any]:
    from linkctl.catalog import get_device, load_catalog, save_calibration
    from linkctl.gguf_info import read_model
    from linkctl.llama import find_bins
    from linkctl.paths import state_dir

    if tokens < 8 or runs < 1:
        raise InputError(
            f"--tokens {tokens} --runs {runs}: need tokens >= 8 and runs >= 1",
            "e.g. --tokens 64 --runs 3",
        )
    if host is None:
        from linkctl.backend import get_backend
        from linkctl.link import identify_host

        host = identify_host(prof, get_backend(), None).name
    h = prof.host(host)
    dev = get_device(load_catalog(), h.device, f"host {h.name}")
    model = read_model(model_path)
    if not model.data_present:
        raise InputError(
            f"{model_path}: header only, tensor data absent", "calibrate needs a real model file"
        )
    runner = runner or default_runner()
    bins = find_bins(bin_dir or h.llama_bin_dir, runner, versions=False)
    if bins.llama_server is None or (rpc and bins.rpc_server is None):
        raise InputError(
            f"llama.cpp binaries not found (tried {', '.join(bins.tried)})",
            "run scripts/build-llama.sh or pass --bin-dir",
        )
    ctx = min(2048, model.context_length or 2048)
    n_prompt = max(16, min(256, ctx - tokens - 16))
    if ctx - tokens - 16 < 16:
        raise InputError(
            f"--tokens {tokens} does not fit the model's context {ctx}", "use fewer --tokens"
        )
    common = [
        "-m",
        str(model_path),
        "-c",
        str(ctx),
        "-np",
        "1",
        "-ngl",
        "99",
        "--host",
        "127.0.0.1",
    ]
    if threads:
        common += ["-t", str(threads)]
    port = _free_port()
    local_argv = [bins.llama_server.path, *common, "--port", str(port)]
    rpc_port = _free_port()
    rpc_argv = [
        bins.rpc_server.path if bins.rpc_server else "ggml-rpc-server",
        "-H",
        "127.0.0.1",
        "-p",
        str(rpc_port),
        *(["-t", str(threads)] if threads else []),
    ]
    port2 = _free_port()
    head_argv = [
        bins.llama_server.path,
        *common,
        "--port",
        str(port2),
        "--rpc",
        f"127.0.0.1:{rpc_port}",
    ]
    if dev.kind == "gpu":
        head_argv += ["--device", f"RPC0[127.0.0.1:{rpc_port}]"]
    if dry_run:
        return {
            "host": h.name,
            "dry_run": True,
            "commands": [local_argv] + ([rpc_argv, head_argv] if rpc else []),
        }

    logs = state_dir() / "calibrate"
    logs.mkdir(parents=True, exist_ok=True)
    with _Servers(runner) as srv:
        p = srv.spawn(local_argv, logs / "llama-server.log")
        wait_health(port, p, 300, logs / "llama-server.log")
        prompt = prompt_tokens(port, n_prompt)
        local_runs = timed_completions(port, tokens, runs, prompt)
        p.terminate()
        p.wait(10)
    best = best_run(local_runs)
    ctx_mean = best["prompt_n"] + best["predicted_n"] / 2
    bpt = decode_bytes_per_token(model, ctx_mean)
    bw = bpt * best["predicted_per_second"] / 1e9
    tflops = (
        (prefill_flops_per_token(model, best["prompt_n"] / 2) * best["prompt_per_second"] / 1e12)
        if best["prompt_per_second"]
        else None
    )
    rec: dict[str, Any] = {
        "host": h.name,
        "device": dev.key,
        "model": str(model_path),
        "model_name": model.name or Path(model_path).name,
        "measured_at": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "threads": threads,
        "tokens": tokens,
        "runs": local_runs,
        "decode_tok_s": best["predicted_per_second"],
        "prefill_tok_s": best["prompt_per_second"],
        "bytes_per_token": bpt,
        "effective_bandwidth_gbs": bw,
        "effective_tflops": tflops,
        "catalog_effective_bandwidth_gbs": dev.decode.bw_gbs,
        "llama_server": bins.llama_server.path,
    }
    if rpc:
        with _Servers(runner) as srv:
            srv.spawn(rpc_argv, logs / "rpc-server.log")
            from linkctl.rpc import wait_ready

            wait_ready("127.0.0.1", rpc_port, 30)
            loop_rtt = rpc_rtt_us(rpc_port)
            hp = srv.spawn(head_argv, logs / "llama-server-rpc.log")
            wait_health(port2, hp, 300, logs / "llama-server-rpc.log")
            rpc_runs = timed_completions(port2, tokens, runs, prompt)
        rb = best_run(rpc_runs)
        per_tok_local = 1e6 / best["predicted_per_second"]
        per_tok_rpc = 1e6 / rb["predicted_per_second"]
        overhead = per_tok_rpc - per_tok_local - loop_rtt
        # This host as an RPC device: its per-token time behind a (loopback) RPC boundary,
        # less the round trip, over the bytes it reads. Folds in the RPC processing cost.
        rpc_bytes = decode_bytes_per_token(model, rb["prompt_n"] + rb["predicted_n"] / 2)
        rpc_bw = rpc_bytes / max(1.0, per_tok_rpc - loop_rtt) * 1e6 / 1e9
        rec["rpc"] = {
            "runs": rpc_runs,
            "decode_tok_s": rb["predicted_per_second"],
            "loopback_rtt_us": loop_rtt,
            "per_token_us": per_tok_rpc,
            "local_per_token_us": per_tok_local,
        }
        rec["rpc_overhead_us"] = overhead
        rec["rpc_effective_bandwidth_gbs"] = rpc_bw
    rec["saved_to"] = str(save_calibration(h.name, rec))
    return rec


def render_calibration(rec: dict[str, Any]) -> None:
    from linkctl.output import console

    if rec.get("dry_run"):
        for argv in rec["commands"]:
            console.print(" ".join(argv))
        return
    console.print(f"[bold]{rec['host']}[/] ({rec['device']}) on {rec['model_name']}:")
    console.print(
        f"  decode  {rec['decode_tok_s']:.1f} tok/s x {rec['bytes_per_token'] / 1e6:.1f} "
        f"MB/token = {rec['effective_bandwidth_gbs']:.1f} GB/s effective "
        f"(catalog: {rec['catalog_effective_bandwidth_gbs']:.1f} GB/s)"
    )
    if rec.get("effective_tflops"):
        console.print(
            f"  prefill {rec['prefill_tok_s']:.0f} tok/s = "
            f"{rec['effective_tflops']:.2f} TFLOPS effective"
        )
    if "rpc" in rec:
        r = rec["rpc"]
        console.print(
            f"  via loopback RPC {r['decode_tok_s']:.1f} tok/s: "
            f"{r['per_token_us']:.0f} µs/token vs {r['local_per_token_us']:.0f} local, "
            f"loopback RTT {r['loopback_rtt_us']:.0f} µs -> as an RPC device "
            f"{rec['rpc_effective_bandwidth_gbs']:.1f} GB/s effective (RPC costs "
            f"{rec['rpc_overhead_us']:+.0f} µs per token over local)"
        )
    console.print(f"  saved to {rec['saved_to']}")
