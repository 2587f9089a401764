"""The one llama-server HTTP client: /health, /props, /tokenize, /apply-template,
/completion and the slot actions, as in llama.cpp tools/server/README.md. serve's
readiness, verify's greedy steps, calibrate's timed runs, the demo, route (its own calls
and the streams it relays) and doctor all go through ``LlamaServer``.

Every failure is an ``UpstreamError`` naming the server and the path: nothing answered,
an HTTP error (llama-server's own ``error.message``), or an answer that is not JSON.
"""

from __future__ import annotations

import http.client
import json
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from linkctl.core.errors import CheckFailed
from linkctl.llama.invocation import ServerInvocation

PROMPT_WORDS = (
    "the link between two machines carries activations for every token and every layer "
    "boundary so its latency adds to each step of decoding while its bandwidth matters "
    "mostly for the prompt "
)


class UpstreamError(CheckFailed):
    """A llama-server answered with an error, not at all, or not in JSON (exit 1).
    ``url`` is what was asked; ``status`` the HTTP status, None when nothing answered."""

    def __init__(
        self, message: str, fix: str | None = None, *, url: str, status: int | None = None
    ):
        self.url, self.status = url, status
        super().__init__(message, fix or "check that llama-server runs there and read its log")


class UpstreamTimeout(UpstreamError):
    """The llama-server took the connection and did not answer in time: it is there but
    stuck (its main loop answers /metrics; serve's watch calls that a stall)."""


@dataclass(frozen=True)
class Timing:
    """One /completion's ``timings`` from llama-server (counts as llama-server gives them)."""

    predicted_per_second: float
    predicted_n: float
    prompt_per_second: float
    prompt_n: float
    predicted_ms: float
    prompt_ms: float


@dataclass(frozen=True)
class LlamaServer:
    """One llama-server at host:port. ``source``: the local address to connect from (the
    head's link address, toward the prefill host); ``headers``: sent with every call
    (an API key's Authorization)."""

    host: str
    port: int
    source: str | None = None
    timeout: float = 600.0
    headers: dict[str, str] = field(default_factory=dict)

    @classmethod
    def serving(cls, inv: ServerInvocation, **kw: Any) -> LlamaServer:
        """The server ``inv`` starts, reached from this host (a wildcard listen address
        through loopback)."""
        host = "127.0.0.1" if inv.host == "0.0.0.0" else inv.host
        return cls(host, inv.port, **kw)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def connect(self, timeout: float | None = None) -> http.client.HTTPConnection:
        """A connection for a caller that reads the answer as it comes (route's relay)."""
        return http.client.HTTPConnection(
            self.host,
            self.port,
            timeout=timeout or self.timeout,
            source_address=(self.source, 0) if self.source else None,
        )

    def call(
        self,
        method: str,
        path: str,
        body: dict[str, Any] | None = None,
        headers: dict[str, str] | None = None,
        timeout: float | None = None,
    ) -> dict[str, Any]:
        """A JSON request; the decoded answer, or UpstreamError naming the server."""
        where = f"{self.url}{path}"
        conn = self.connect(timeout)
        try:
            data = json.dumps(body).encode() if body is not None else None
            hdrs = {"Content-Type": "application/json"} | self.headers | (headers or {})
            conn.request(method, path, body=data, headers=hdrs)
            r = conn.getresponse()
            raw = r.read()
        except (OSError, http.client.HTTPException) as e:
            raise UpstreamError(f"{where}: {type(e).__name__}: {e}", url=where) from None
        finally:
            conn.close()
        try:
            out = json.loads(raw) if raw else {}
        except ValueError:
            raise UpstreamError(
                f"{where}: HTTP {r.status}, not JSON: {raw[:200]!r}", url=where, status=r.status
            ) from None
        if r.status != 200:
            err = out.get("error") if isinstance(out, dict) else None
            msg = err.get("message") if isinstance(err, dict) else err
            msg = msg or raw[:200].decode(errors="replace")
            raise UpstreamError(f"{where}: HTTP {r.status}: {msg}", url=where, status=r.status)
        return out if isinstance(out, dict) else {"result": out}

    def healthy(self, timeout: float = 2.0) -> bool:
        """/health answers 200 (the model is loaded)."""
        try:
            self.call("GET", "/health", timeout=timeout)
            return True
        except UpstreamError:
            return False

    def wait_healthy(self, proc: subprocess.Popen, timeout: float, log: Path | None) -> None:
        """Until /health answers 200; CheckFailed if ``proc`` exits or time runs out."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                tail = log.read_text().strip().splitlines()[-3:] if log and log.exists() else []
                raise CheckFailed(
                    f"llama-server exited {proc.returncode} while loading: " + " | ".join(tail),
                    f"see {log}" if log else None,
                )
            if self.healthy(timeout=2.0):
                return
            time.sleep(0.2)
        raise CheckFailed(f"llama-server on {self.url} not healthy within {timeout:g} s")

    def metrics(self, timeout: float = 2.0) -> dict[str, float]:
        """GET /metrics (llama-server --metrics): Prometheus text, ``llamacpp:NAME value``
        lines (tools/server/server-context.cpp, the metrics handler) as {NAME: value}."""
        conn = self.connect(timeout)
        where = f"{self.url}/metrics"
        try:
            conn.request("GET", "/metrics", headers=self.headers)
            r = conn.getresponse()
            raw = r.read().decode(errors="replace")
        except TimeoutError:
            raise UpstreamTimeout(f"{where}: no answer within {timeout:g} s", url=where) from None
        except (OSError, http.client.HTTPException) as e:
            raise UpstreamError(f"{where}: {type(e).__name__}: {e}", url=where) from None
        finally:
            conn.close()
        if r.status != 200:
            raise UpstreamError(f"{where}: HTTP {r.status}", url=where, status=r.status)
        out = {}
        for line in raw.splitlines():
            name, _, value = line.partition(" ")
            if name.startswith("llamacpp:"):
                try:
                    out[name.removeprefix("llamacpp:")] = float(value)
                except ValueError:
                    continue
        return out

    def props(
        self, headers: dict[str, str] | None = None, timeout: float | None = None
    ) -> dict[str, Any]:
        return self.call("GET", "/props", headers=headers, timeout=timeout)

    def tokenize(self, text: str, headers: dict[str, str] | None = None) -> list[int]:
        r = self.call("POST", "/tokenize", {"content": text, "add_special": True}, headers)
        return list(r.get("tokens") or [])

    def apply_template(self, messages: list[Any], headers: dict[str, str] | None = None) -> Any:
        return self.call("POST", "/apply-template", {"messages": messages}, headers).get("prompt")

    def slot(
        self,
        k: int,
        action: str,
        filename: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> dict[str, Any]:
        """POST /slots/k?action=save|restore|erase (files in the server's --slot-save-path)."""
        body = {"filename": filename} if filename else {}
        return self.call("POST", f"/slots/{k}?action={action}", body, headers)

    def prompt_tokens(self, n: int) -> list[int]:
        """``n`` token ids of plain English text, via llama-server's own tokenizer, so a
        prefill measurement has the same length on every model."""
        toks = self.tokenize(PROMPT_WORDS * 40)
        if len(toks) < n:
            toks = (toks * (n // max(1, len(toks)) + 1))[:n]
        return toks[:n]

    def timed_completions(self, tokens: int, runs: int, prompt: str | list[int]) -> list[Timing]:
        """Warm-up, then ``runs`` requests; each run's llama-server timings."""
        body = {
            "prompt": prompt,
            "n_predict": tokens,
            "ignore_eos": True,
            "temperature": 0,
            "cache_prompt": False,
            "seed": 0,
        }
        self.call("POST", "/completion", {**body, "n_predict": 4})
        out = []
        for _ in range(runs):
            r = self.call("POST", "/completion", body)
            t = r.get("timings") or {}
            if not t.get("predicted_per_second"):
                raise CheckFailed(f"llama-server answered without decode timings: {sorted(r)}")
            out.append(Timing(**{k: float(t.get(k) or 0) for k in Timing.__dataclass_fields__}))
        return out
