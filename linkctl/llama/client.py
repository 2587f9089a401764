"""Talking to llama.cpp servers running on this host: llama-server's HTTP API
(/health, /tokenize, /completion, as in llama.cpp tools/server/README.md) and one
ggml-rpc-server request/response round trip.

Used by calibrate (its timed runs), verify (greedy steps) and the demo."""

from __future__ import annotations

import json
import statistics
import struct
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from linkctl.core.errors import CheckFailed

PROMPT_WORDS = (
    "the link between two machines carries activations for every token and every layer "
    "boundary so its latency adds to each step of decoding while its bandwidth matters "
    "mostly for the prompt "
)


@dataclass(frozen=True)
class Timing:
    """One /completion's ``timings`` from llama-server (counts as llama-server gives them)."""

    predicted_per_second: float
    predicted_n: float
    prompt_per_second: float
    prompt_n: float
    predicted_ms: float
    prompt_ms: float


def post(url: str, body: dict[str, Any], timeout: float) -> dict[str, Any]:
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
    r = post(f"http://127.0.0.1:{port}/tokenize", {"content": PROMPT_WORDS * 40}, 60)
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
) -> list[Timing]:
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
    post(url, {**body, "n_predict": 4}, timeout)
    out = []
    for _ in range(runs):
        r = post(url, body, timeout)
        t = r.get("timings") or {}
        if not t.get("predicted_per_second"):
            raise CheckFailed(f"llama-server answered without decode timings: {sorted(r)}")
        out.append(Timing(**{k: float(t.get(k) or 0) for k in Timing.__dataclass_fields__}))
    return out


def rpc_rtt_us(port: int, n: int = 200, host: str = "127.0.0.1") -> float:
    """p50 of GET_DEVICE_MEMORY request/response on one connection to an rpc-server
    (the same kind of exchange as a token's GET_TENSOR, minus the payload)."""
    from linkctl.llama.rpc import RpcCmd, _open_hello

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
