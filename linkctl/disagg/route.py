"""`linkctl route`: the HTTP front on the head that runs long prompts disaggregated.

What it decides and how it disaggregates is linkctl/disagg/router.py (blocking code, run
in threads). This module is the server: aiohttp's, not ``http.server``, because request
framing (Content-Length, chunked bodies, pipelining), header limits, keep-alive, and
noticing that a client went away are a maintained library's job, not code written here.

Every request is bounded (RouteConfig; serve.disagg.max_body_bytes in the profile):

- body: at most ``max_body_bytes`` (413), refused on its Content-Length before a byte is
  read, and counted as it is read (aiohttp's client_max_size), chunked or not; the whole
  body within ``body_timeout_s`` (408, a Content-Length that lies stalls into this);
- header: within ``header_timeout_s`` of connecting, and within ``idle_timeout_s`` of the
  previous answer on a kept-alive connection (aiohttp's keepalive_timeout); lines and
  counts past aiohttp's limits are a 400;
- time: the whole request, slot wait, prefill and transfer, generation and a stream's last
  byte, within ``request_deadline_s``: past it a 504, or mid-stream the connection ends
  (a client that reads nothing cannot hold its slot: the write waits on it, and the
  deadline ends the wait);
- connections: at most ``max_connections``; one more closes the longest-idle connection
  (no request in progress), or, when all are busy, is answered 503;
- a client that goes away cancels its request (handler_cancellation): the upstream
  connection to the decode server closes, and llama-server stops generating for it.

Every refusal is JSON, ``{"error": {"code", "type": "linkctl_route", "message"}}``, also
aiohttp's own (a malformed request line or header); the connection is never just dropped
with a traceback. A generation request whose body is not a JSON object goes to the decode
server as is: it says what is wrong. The blocking stages run in daemon threads, not
``asyncio.to_thread``'s pool, whose threads a stopping process would wait for, and a slot
goes back to the pool only when the thread using it has finished.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any, TypeVar

import aiohttp
from aiohttp import web
from aiohttp.web_protocol import RequestPayloadError
from multidict import CIMultiDict
from yarl import URL

from linkctl.core.errors import InputError
from linkctl.disagg.router import (
    GENERATE_PATHS,
    HOP_HEADERS,
    OWNED_PREFIX,
    EventSniffer,
    Outcome,
    RouteConfig,
    Router,
    request_path,
    timings_of,
)

__all__ = ["Outcome", "RouteConfig", "RouteServer", "Router", "request_path"]

ERROR_TYPE = "linkctl_route"
CONNECT_S = 10.0  # to the decode server on this host: anything longer is not coming
LINGER_S = 2.0  # reading (and dropping) what a refused client still sends, so it sees the answer
T = TypeVar("T")


def error_response(
    status: int, message: str, headers: dict[str, str] | None = None, kind: str = ERROR_TYPE
) -> web.Response:
    """route's one error shape (llama-server's: error.code, type, message), one line."""
    line = " ".join(str(message).split())[:300] or HTTPStatus(status).phrase
    body = {"error": {"code": status, "type": kind, "message": line}}
    return web.json_response(body, status=status, headers=headers)


def _client_headers(request: web.BaseRequest) -> dict[str, str]:
    """The headers forwarded upstream: authorization (llama-server --api-key) only."""
    auth = request.headers.get("Authorization")
    return {"Authorization": auth} if auth else {}


def _in_thread(fn: Callable[..., T], *args: Any) -> asyncio.Future[T]:
    """``fn(*args)`` in a daemon thread; its result as a future of the running loop."""
    loop = asyncio.get_running_loop()
    fut: asyncio.Future[T] = loop.create_future()

    def settle(result: Any, exc: BaseException | None) -> None:
        if fut.done():
            return
        if exc is None:
            fut.set_result(result)
        else:
            fut.set_exception(exc)

    def run() -> None:
        try:
            result, exc = fn(*args), None
        except BaseException as e:  # handed to the awaiting request
            result, exc = None, e
        with contextlib.suppress(RuntimeError):  # the loop is closed: route stopped
            loop.call_soon_threadsafe(settle, result, exc)

    threading.Thread(target=run, daemon=True, name="route-stage").start()
    return fut


@dataclass
class _Reply:
    """The answer under way, if its status line has gone out (then no error can be sent)."""

    stream: web.StreamResponse | None = None


class _Connection(web.RequestHandler):
    """One client connection: aiohttp's, with route's JSON errors, a deadline for the
    first request's header, and whether a request is in progress (for the cap)."""

    def __init__(self, manager: _Server, **kwargs: Any):
        super().__init__(manager, **kwargs)
        self.front = manager
        self.busy = False
        self.requests = 0
        self.evicted = False
        self._first: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        if self.evicted:  # closed before the loop had made it
            self.force_close()
            return
        delay = self.front.cfg.header_timeout_s
        self._first = asyncio.get_running_loop().call_later(delay, self._no_request)

    def connection_lost(self, exc: BaseException | None) -> None:
        if self._first is not None:
            self._first.cancel()
        self.front.live.pop(self, None)
        super().connection_lost(exc)

    def _no_request(self) -> None:
        # aiohttp closes a connection idle after an answer (keepalive_timeout); one that
        # never completes a first header is closed here.
        if not self.requests:
            self.force_close()

    def handle_error(
        self,
        request: web.BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        """aiohttp's answer to a request it could not parse (400) or a handler that
        failed (500), in route's JSON; the connection is then closed."""
        if request.writer.output_size > 0:
            raise ConnectionError("an answer is under way: no error can be sent now")
        if status >= 500:
            self.front.router.log(f"HTTP {status} on {request.method} {request.path}: {exc!r}")
            message = f"route failed: {type(exc).__name__}" if exc else message
        resp = error_response(status, message or str(exc or ""))
        resp.force_close()
        return resp


class _Refuse(asyncio.Protocol):
    """A connection past max_connections while every one has a request in progress."""

    def __init__(self, cap: int):
        self.cap = cap
        self._later: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.WriteTransport)
        body = json.dumps(
            {
                "error": {
                    "code": 503,
                    "type": ERROR_TYPE,
                    "message": f"route has {self.cap} connections, all busy: retry shortly",
                }
            }
        ).encode()
        head = (
            "HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nRetry-After: 1\r\nConnection: close\r\n\r\n"
        )
        transport.write(head.encode() + body)
        if transport.can_write_eof():
            transport.write_eof()
        # Closed once the client has had a moment to read it (not at once: unread request
        # bytes would make the close a reset that can discard the answer).
        self._later = asyncio.get_running_loop().call_later(LINGER_S, transport.close)

    def connection_lost(self, exc: Exception | None) -> None:
        if self._later is not None:
            self._later.cancel()


class _Server(web.Server):
    """aiohttp's low-level server, making route's connections and requests and holding
    the connection cap."""

    def __init__(self, front: RouteServer, **kwargs: Any):
        self.front = front
        self.router = front.router
        self.cfg = front.router.cfg
        self._conn_kwargs = kwargs
        self.live: dict[_Connection, None] = {}  # oldest first
        super().__init__(
            front.handle,
            request_factory=self._request,
            # A client that goes away cancels its handler, which closes the upstream
            # connection: llama-server then stops the generation.
            handler_cancellation=True,
            **kwargs,
        )

    def _request(
        self,
        message: Any,
        payload: Any,
        protocol: web.RequestHandler,
        writer: Any,
        task: asyncio.Task[None],
    ) -> web.BaseRequest:
        return web.BaseRequest(
            message,
            payload,
            protocol,
            writer,
            task,
            asyncio.get_running_loop(),
            client_max_size=self.cfg.max_body_bytes,
        )

    def __call__(self) -> Any:  # the protocol for a new connection
        # Counted here, not in aiohttp's ``connections``: the loop accepts a backlog's
        # worth of connections before any of them is made.
        live = self.live
        if len(live) >= self.cfg.max_connections:
            idle = next((c for c in live if not c.busy), None)
            if idle is None:
                return _Refuse(self.cfg.max_connections)
            live.pop(idle)
            idle.evicted = True  # the oldest idle: its client reconnects when it needs to
            idle.force_close()
        conn = _Connection(self, loop=asyncio.get_running_loop(), **self._conn_kwargs)
        live[conn] = None
        return conn


class RouteServer:
    """The HTTP front, its event loop in a thread of its own: ``start()``/``stop()``, or
    ``serve_forever()``. Listens from construction (``port``: the port it got)."""

    def __init__(self, router: Router):
        self.router = router
        cfg = self.cfg = router.cfg
        try:
            self.sock = socket.create_server((cfg.listen_host, cfg.listen_port), backlog=128)
        except OSError as e:
            raise InputError(
                f"route cannot listen on {cfg.listen_host}:{cfg.listen_port}: {e}",
                "stop what listens there or set serve.port",
            ) from None
        self.port: int = self.sock.getsockname()[1]
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._runner: web.ServerRunner | None = None
        self._session: aiohttp.ClientSession | None = None
        self._slots: asyncio.Queue[int] | None = None

    # ---- lifecycle ------------------------------------------------------------------

    def start(self) -> RouteServer:
        loop = self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=loop.run_forever, daemon=True, name="route")
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._open(), loop).result(timeout=30)
        return self

    def serve_forever(self) -> None:
        self.start()
        assert self._thread is not None
        self._thread.join()

    def stop(self) -> None:
        loop, self._loop = self._loop, None
        if loop is None:
            self.sock.close()
            return
        try:
            asyncio.run_coroutine_threadsafe(self._close(), loop).result(timeout=30)
        finally:
            loop.call_soon_threadsafe(loop.stop)
            if self._thread is not None:
                self._thread.join(timeout=10)
            if not loop.is_running():
                loop.close()
            self.sock.close()

    async def _open(self) -> None:
        cfg = self.cfg
        self._slots = asyncio.Queue()
        for k in range(cfg.slots):
            self._slots.put_nowait(k)
        up = cfg.decode
        self._session = aiohttp.ClientSession(
            # One upstream connection per request, closed with it: a cancelled request
            # must close its socket, never hand it back to a pool.
            connector=aiohttp.TCPConnector(
                force_close=True,
                limit=0,
                local_addr=(up.source, 0) if up.source else None,
            ),
            # The request deadline bounds the rest; this only catches a server not there.
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=CONNECT_S),
            auto_decompress=False,
            skip_auto_headers=("User-Agent",),
        )
        server = _Server(
            self,
            keepalive_timeout=cfg.idle_timeout_s,
            lingering_time=LINGER_S,
            access_log=None,  # route logs one JSON line per generation instead
        )
        self._runner = web.ServerRunner(server, handle_signals=False, shutdown_timeout=2.0)
        await self._runner.setup()
        await web.SockSite(self._runner, self.sock).start()

    async def _close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
        if self._session is not None:
            await self._session.close()

    # ---- one request ----------------------------------------------------------------

    async def handle(self, request: web.BaseRequest) -> web.StreamResponse:
        conn = request.protocol
        if isinstance(conn, _Connection):
            conn.requests += 1
            conn.busy = True
        reply = _Reply()
        try:
            async with asyncio.timeout(self.cfg.request_deadline_s):
                return await self._answer(request, reply)
        except TimeoutError:
            if reply.stream is None:
                msg = f"not answered within route's {self.cfg.request_deadline_s:g} s deadline"
                return error_response(504, msg)
            # Mid-stream: nothing more can be said. Abort, not close: a close would
            # wait to flush to a client that may be reading nothing.
            if request.transport is not None:
                request.transport.abort()
            return reply.stream
        except web.HTTPException as e:  # aiohttp's own (413 from read), in route's shape
            resp = error_response(e.status, e.text or e.reason)
            resp.force_close()
            return resp
        finally:
            if isinstance(conn, _Connection):
                conn.busy = False

    async def _answer(self, request: web.BaseRequest, reply: _Reply) -> web.StreamResponse:
        cfg = self.cfg
        path, target = request_path(request.raw_path)
        if request.method not in ("GET", "POST"):
            return error_response(405, f"{request.method}: route forwards GET and POST")
        n = request.content_length
        if n is not None and n > cfg.max_body_bytes:
            # Refused on the header: nothing of it is read or allocated.
            resp = error_response(413, f"request body of {n} bytes is over {self._limit()}")
            resp.force_close()
            return resp
        expect = request.headers.get("Expect", "")
        if expect.lower() == "100-continue" and request.version >= (1, 1):
            await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        elif expect:
            return error_response(417, f"Expect: {expect[:40]!r} is not supported")
        try:
            async with asyncio.timeout(cfg.body_timeout_s):
                raw = await request.read()
        except TimeoutError:
            resp = error_response(408, f"request body not received within {cfg.body_timeout_s:g} s")
            resp.force_close()
            return resp
        except web.HTTPRequestEntityTooLarge:
            resp = error_response(413, f"request body is over {self._limit()}")
            resp.force_close()
            return resp
        except RequestPayloadError as e:  # malformed chunked framing and the like
            resp = error_response(400, f"request body: {e}")
            resp.force_close()
            return resp
        if path == OWNED_PREFIX or path.startswith(OWNED_PREFIX + "/"):
            return error_response(403, "route owns the slots; slot actions are not forwarded")
        if request.method == "GET":
            if path == "/linkctl/stats":
                keys = cfg.api_keys
                auth = request.headers.get("Authorization", "")
                if keys and auth.removeprefix("Bearer ") not in keys:
                    return error_response(401, "Invalid API Key", kind="authentication_error")
                return web.json_response(self.router.stats())
            return await self._relay(request, "GET", target, None, None, None, reply)
        if path not in GENERATE_PATHS:
            return await self._relay(request, "POST", target, raw, None, None, reply)
        try:
            body = json.loads(raw or b"{}")
        except ValueError:
            body = None
        if not isinstance(body, dict):  # the decode server says what is wrong
            return await self._relay(request, "POST", target, raw, None, None, reply)
        return await self._generate(request, path, target, body, reply)

    def _limit(self) -> str:
        n = self.cfg.max_body_bytes
        return f"route's limit of {n} bytes (serve.disagg.max_body_bytes)"

    async def _generate(
        self,
        request: web.BaseRequest,
        path: str,
        target: str,
        body: dict[str, Any],
        reply: _Reply,
    ) -> web.StreamResponse:
        router, slots = self.router, self._slots
        assert slots is not None
        hdrs = _client_headers(request)
        o = router.begin(path)
        k: int | None = None
        stages: asyncio.Future[None] | None = None
        try:
            k = o.slot = await slots.get()
            stages = _in_thread(router.prepare, path, body, hdrs, o)
            # Shielded: the thread cannot be cancelled, and owns the slot until it ends.
            await asyncio.shield(stages)
            o.stage = "generate"
            fwd = json.dumps(body | {"id_slot": k, "cache_prompt": True}).encode()
            return await self._relay(request, "POST", target, fwd, o, hdrs, reply)
        except asyncio.CancelledError:  # the deadline (handle() says so), or the client
            gone = request.transport is None or request.transport.is_closing()
            o.error = f"{o.stage}: " + ("the client went away" if gone else "past the deadline")
            raise
        finally:
            if k is not None:
                if stages is None or stages.done():
                    slots.put_nowait(k)
                else:
                    stages.add_done_callback(functools.partial(_free, slots, k))
            router.done(o)

    async def _relay(
        self,
        request: web.BaseRequest,
        method: str,
        target: str,
        raw: bytes | None,
        o: Outcome | None,
        hdrs: dict[str, str] | None,
        reply: _Reply,
    ) -> web.StreamResponse:
        """Send the request to the decode server and copy its answer back as it arrives
        (an SSE stream chunk by chunk). For a generation (``o``), the answer's timings go
        to ``Router.answered`` as it passes: read from the whole body, which a
        non-streamed answer's headers wait for anyway (so they say whether a restore
        took), or from a stream's events, none held back."""
        up, session = self.cfg.decode, self._session
        assert session is not None
        headers = {"Content-Type": "application/json", "Accept-Encoding": "identity"}
        headers |= hdrs if hdrs is not None else _client_headers(request)
        try:
            upstream = await session.request(
                method,
                URL(up.url + target, encoded=True),  # already quoted by request_path
                data=raw,
                headers=headers,
                allow_redirects=False,
            )
        except (aiohttp.ClientError, OSError) as e:
            return error_response(502, f"decode server {up.url}: {e}", _headers(o))
        try:
            out: CIMultiDict[str] = CIMultiDict(
                (k, v) for k, v in upstream.headers.items() if k.lower() not in HOP_HEADERS
            )
            if upstream.content_length is not None:
                data = await upstream.read()
                if o is not None:
                    self.router.answered(o, timings_of(data))
                out.update(_headers(o))
                return web.Response(
                    status=upstream.status, reason=upstream.reason, body=data, headers=out
                )
            out.update(_headers(o))
            stream = web.StreamResponse(status=upstream.status, reason=upstream.reason)
            stream.headers.extend(out)
            reply.stream = stream
            await stream.prepare(request)
            sniff = EventSniffer()
            async for chunk in upstream.content.iter_any():
                await stream.write(chunk)
                sniff.feed(chunk)
            await stream.write_eof()
            if o is not None:
                self.router.answered(o, sniff.timings)
            return stream
        except (aiohttp.ClientError, ConnectionError) as e:
            # The decode server, or the client, went away mid-answer.
            if reply.stream is None:
                return error_response(502, f"decode server {up.url}: {e}", _headers(o))
            if request.transport is not None:
                request.transport.abort()
            return reply.stream
        finally:
            upstream.close()  # also on cancellation: llama-server sees the socket close


def _headers(o: Outcome | None) -> dict[str, str]:
    """route's own headers on a generation's answer (what it did, so far)."""
    return o.headers() if o is not None else {}


def _free(slots: asyncio.Queue[int], k: int, done: asyncio.Future[None]) -> None:
    """Slot ``k`` back to the pool once the stages that used it have ended."""
    if not done.cancelled():
        done.exception()  # retrieved: the request it failed has already ended
    slots.put_nowait(k)
