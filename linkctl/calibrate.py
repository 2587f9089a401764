"""`linkctl calibrate`: measure this host's real llama.cpp figures and store them.

1. llama-server runs the given model alone on this host (127.0.0.1 only). One
   warm-up request, then ``runs`` timed /completion requests of ``tokens``
   decode tokens each (ignore_eos, prompt cache off); llama-server's own
   ``timings`` give decode tok/s (predicted_per_second) and prefill tok/s
   (prompt_per_second); the median run is kept (by decode tok/s). Not the fastest:
   on a busy host one run in five can catch the CPUs free (lab, 2 shared cores:
   40.7, 55.6, 44.1, 41.9, 41.4 tok/s), and a split served later on that host
   runs at the typical speed, not at that outlier's (bench/split_gain.py).
2. The two decode terms, per-block cost and effective bandwidth, are solved from
   two models (or more) of different shape: t = blocks x layer_us + bytes / bw for
   each, bytes per token from the GGUF header exactly as the estimate counts them
   (active weights + output head + KV cache at the mean context of the run). The
   models are the given --model(s) plus generated ones (linkctl.tinymodel: 24 thin
   blocks, 2 wide blocks) until two differ in blocks per byte.
3. effective prefill compute = FLOPs per prompt x prefill tok/s, on the model
   with the most FLOPs.
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
import math
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
from linkctl.llama import free_port
from linkctl.profile import Profile
from linkctl.runner import Runner, default_runner
from linkctl.tinymodel import TinySpec

PROMPT_WORDS = (
    "the link between two machines carries activations for every token and every layer "
    "boundary so its latency adds to each step of decoding while its bandwidth matters "
    "mostly for the prompt "
)


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


def typical_run(runs: list[dict[str, float]]) -> dict[str, float]:
    """The median run by decode tok/s (the lower middle one of an even count)."""
    ranked = sorted(runs, key=lambda r: r["predicted_per_second"])
    return ranked[(len(ranked) - 1) // 2]


def rpc_rtt_us(port: int, n: int = 200, host: str = "127.0.0.1") -> float:
    """p50 of GET_DEVICE_MEMORY request/response on one connection to an rpc-server
    (the same kind of exchange as a token's GET_TENSOR, minus the payload)."""
    from linkctl.rpc import RpcCmd, _open_hello

    conn, _v, _f = _open_hello(host, port, 5.0)
    try:
        conn.deadline = time.monotonic() + 60
        ts = []
        for _ in range(n):
            t = time.perf_counter()
            conn.call(RpcCmd.GET_DEVICE_MEMORY, struct.pack("<I", 0))
            ts.append((time.perf_counter() - t) * 1e6)
    finally:
        conn.close()
    return statistics.median(ts)


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


# Generated models for the two-term solve: many thin blocks against few wide ones, so
# the per-block cost and the bandwidth weigh differently in their per-token times.
# The small pair (60-110 MB) is larger than a CPU's last-level cache; the large pair
# (0.6-1.6 GB) is past the tens of MB of a GPU's L2 or an Apple chip's system cache,
# so the bandwidth measured is the memory's (see calibration_models for which).
GENERATED = {
    "cpu": (
        TinySpec(n_layer=24, n_embd=256, n_head=4, n_ff=512),
        TinySpec(n_layer=2, n_embd=1024, n_head=8, n_ff=2816),
    ),
    "gpu": (
        TinySpec(n_layer=48, n_embd=512, n_head=8, n_ff=1536),
        TinySpec(n_layer=2, n_embd=4096, n_head=32, n_ff=11008),
    ),
}


def _blocks_per_byte(model) -> float:
    return model.block_count / max(1, sum(model.layer_active_bytes()))


def _spec_blocks_per_byte(spec: TinySpec) -> float:
    """Blocks per byte of a generated model (F32: 4 x (4 e^2 + 3 e ff) bytes a block)."""
    e, ff = spec.n_embd, spec.n_ff
    return 1.0 / (4 * (4 * e * e + 3 * e * ff))


def calibration_models(given: list[Path], workdir: Path, kind: str = "cpu") -> list[Path]:
    """The given models, plus generated ones until there are two of different shape:
    with one given model, the generated model whose blocks-per-byte differs most from
    it, of the given model's size class (so both sit past the same caches); without
    one, the pair for the device kind."""
    from linkctl.gguf_info import read_model
    from linkctl.tinymodel import write_tiny_llama

    def gen(spec: TinySpec) -> Path:
        p = workdir / f"tiny-{spec.n_layer}L-{spec.n_embd}d.gguf"
        if not p.is_file():
            write_tiny_llama(p, spec)
        return p

    if len(given) >= 2:
        return given
    if not given:
        return [gen(spec) for spec in GENERATED.get(kind, GENERATED["cpu"])]
    m = read_model(given[0])
    pair = GENERATED["gpu" if m.total_bytes > 300e6 else "cpu"]
    r = math.log(_blocks_per_byte(m))
    far = max(pair, key=lambda spec: abs(math.log(_spec_blocks_per_byte(spec)) - r))
    return [given[0], gen(far)]


def solve_two_terms(
    points: list[tuple[float, float, float]],
) -> tuple[float, float]:
    """(layer_us, bandwidth GB/s) from (blocks, bytes per token, measured µs per token)
    of two or more models: t = blocks x layer_us + bytes / bandwidth, least squares on
    relative error, both terms >= 0."""
    from linkctl.devicefit import _nnls

    a = [[blocks / t, nbytes / t] for blocks, nbytes, t in points]
    (c, inv_bw), _ = _nnls(a, [1.0] * len(points))
    if inv_bw <= 0:
        raise CheckFailed(
            "calibration: the measured times do not rise with the bytes read "
            f"({points}); the host was too busy, re-run"
        )
    return c, 1e-3 / inv_bw


def calibrate(
    prof: Profile,
    model_paths: list[Path] | None = None,
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
    from linkctl.catalog import get_device, load_catalog
    from linkctl.estimate import decode_features, prefill_features
    from linkctl.gguf_info import read_model
    from linkctl.llama import find_bins
    from linkctl.paths import state_dir
    from linkctl.records import CalibrationRecord, save_calibration

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
    given = list(model_paths or [])
    for mp in given:
        if not read_model(mp).data_present:
            raise InputError(
                f"{mp}: header only, tensor data absent", "calibrate needs a real model file"
            )
    runner = runner or default_runner()
    bins = find_bins(bin_dir or h.llama_bin_dir, runner, versions=False)
    if bins.llama_server is None or (rpc and bins.rpc_server is None):
        raise InputError(
            f"llama.cpp binaries not found (tried {', '.join(bins.tried)})",
            "run scripts/build-llama.sh or pass --bin-dir",
        )
    logs = state_dir() / "calibrate"
    logs.mkdir(parents=True, exist_ok=True)
    paths = (
        calibration_models(given, logs, dev.kind) if not dry_run else given or [Path("<generated>")]
    )
    infos = [read_model(mp) for mp in paths] if not dry_run else []
    ctxs = [min(2048, m.context_length or 2048) for m in infos] or [2048]
    ctx = min(ctxs)
    n_prompt = max(16, min(256, ctx - tokens - 16))
    if ctx - tokens - 16 < 16:
        raise InputError(
            f"--tokens {tokens} does not fit the model's context {ctx}", "use fewer --tokens"
        )

    def common(mp: Path) -> list[str]:
        argv = ["-m", str(mp), "-c", str(ctx), "-np", "1", "-ngl", "99", "--host", "127.0.0.1"]
        return argv + (["-t", str(threads)] if threads else [])

    local_argvs = []
    for mp in paths:
        local_argvs.append([bins.llama_server.path, *common(mp), "--port", str(free_port())])
    rpc_port = free_port()
    rpc_argv = [
        bins.rpc_server.path if bins.rpc_server else "ggml-rpc-server",
        "-H",
        "127.0.0.1",
        "-p",
        str(rpc_port),
        *(["-t", str(threads)] if threads else []),
    ]
    port2 = free_port()
    head_argv = [
        bins.llama_server.path,
        *common(paths[0]),
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
            "commands": local_argvs + ([rpc_argv, head_argv] if rpc else []),
        }

    # All servers up at once and the timed requests interleaved (A, B, A, B, ...), so a
    # burst of other load on the host hits every model alike instead of skewing the solve.
    measured = []
    ports = [int(argv[-1]) for argv in local_argvs]
    all_runs: list[list[dict[str, float]]] = [[] for _ in paths]
    with _Servers(runner) as srv:
        for i, argv in enumerate(local_argvs):
            log = logs / f"llama-server-{i}.log"
            wait_health(ports[i], srv.spawn(argv, log), 300, log)
        prompt = prompt_tokens(ports[0], n_prompt)
        for _ in range(runs):
            for i, port in enumerate(ports):
                all_runs[i] += timed_completions(port, tokens, 1, prompt)
    for mp, m, model_runs in zip(paths, infos, all_runs, strict=True):
        best = typical_run(model_runs)
        depth = best["prompt_n"] + best["predicted_n"] / 2
        f = decode_features(m, list(range(m.block_count)), True, depth)
        measured.append(
            {
                "model": str(mp),
                "model_name": m.name or mp.name,
                "blocks": m.block_count,
                "bytes_per_token": f[2] + f[3] + f[4],
                "decode_tok_s": best["predicted_per_second"],
                "per_token_us": 1e6 / best["predicted_per_second"],
                "prefill_tok_s": best["prompt_per_second"],
                "prompt_n": best["prompt_n"],
                "runs": model_runs,
                "generated": mp not in given,
            }
        )
    layer_us, bw = solve_two_terms(
        [(x["blocks"], x["bytes_per_token"], x["per_token_us"]) for x in measured]
    )
    for x in measured:
        x["predicted_us"] = x["blocks"] * layer_us + x["bytes_per_token"] / (bw * 1e3)
    # Prefill compute: from the model with the most FLOPs per prompt (the per-micro-batch
    # fixed cost is not separated here; it is small against a whole prompt's FLOPs).
    flops = [
        sum(prefill_features(m, list(range(m.block_count)), True, int(x["prompt_n"]))[2:])
        for m, x in zip(infos, measured, strict=True)
    ]
    k = max(range(len(measured)), key=lambda i: flops[i])
    pk = measured[k]
    tflops = (
        flops[k] / (pk["prompt_n"] / pk["prefill_tok_s"]) / 1e12 if pk["prefill_tok_s"] else None
    )
    first = measured[0]
    rec: dict[str, Any] = {
        "host": h.name,
        "device": dev.key,
        "model": first["model"],
        "model_name": first["model_name"],
        "measured_at": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "threads": threads,
        "tokens": tokens,
        "runs": first["runs"],
        "models": measured,
        "decode_tok_s": first["decode_tok_s"],
        "prefill_tok_s": first["prefill_tok_s"],
        "bytes_per_token": first["bytes_per_token"],
        "layer_us": layer_us,
        "effective_bandwidth_gbs": bw,
        "effective_tflops": tflops,
        "catalog_layer_us": dev.decode.layer_us,
        "catalog_effective_bandwidth_gbs": dev.decode.bw_gbs,
        "llama_server": bins.llama_server.path,
    }
    if rpc:
        model = infos[0]
        with _Servers(runner) as srv:
            srv.spawn(rpc_argv, logs / "rpc-server.log")
            from linkctl.rpc import wait_ready

            wait_ready("127.0.0.1", rpc_port, 30)
            loop_rtt = rpc_rtt_us(rpc_port)
            hp = srv.spawn(head_argv, logs / "llama-server-rpc.log")
            wait_health(port2, hp, 300, logs / "llama-server-rpc.log")
            rpc_runs = timed_completions(port2, tokens, runs, prompt)
        rb = typical_run(rpc_runs)
        per_tok_local = first["per_token_us"]
        per_tok_rpc = 1e6 / rb["predicted_per_second"]
        overhead = per_tok_rpc - per_tok_local - loop_rtt
        # This host as an RPC device: its per-token time behind a (loopback) RPC boundary,
        # less the round trip, over the bytes it reads. Folds in the RPC processing cost.
        f = decode_features(
            model, list(range(model.block_count)), True, rb["prompt_n"] + rb["predicted_n"] / 2
        )
        rpc_bytes = f[2] + f[3] + f[4]
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
    rec["saved_to"] = str(save_calibration(h.name, CalibrationRecord.model_validate(rec)))
    return rec


def render_calibration(rec: dict[str, Any]) -> None:
    from linkctl.output import console

    if rec.get("dry_run"):
        for argv in rec["commands"]:
            console.print(" ".join(argv))
        return
    console.print(f"[bold]{rec['host']}[/] ({rec['device']}):")
    for x in rec.get("models", []):
        console.print(
            f"  {x['model_name']}: {x['blocks']} blocks, {x['bytes_per_token'] / 1e6:.1f} MB/token"
            f" -> {x['decode_tok_s']:.1f} tok/s ({x['per_token_us']:.0f} µs/token, "
            f"two-term fit {x['predicted_us']:.0f} µs)"
        )
    console.print(
        f"  decode terms: {rec.get('layer_us', 0):.1f} µs per block + bytes / "
        f"{rec['effective_bandwidth_gbs']:.1f} GB/s (catalog: "
        f"{rec.get('catalog_layer_us', 0):.1f} µs + bytes / "
        f"{rec['catalog_effective_bandwidth_gbs']:.1f} GB/s)"
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
