"""route bounds what one client can make it do: body size, time, connections; every
refusal is a 4xx/5xx JSON error, never a hang or a dropped connection.

route (the real RouteServer) runs on 127.0.0.1 in front of a small HTTP upstream written
here, a stand-in for llama-server's HTTP surface: the subject is route's own framing and
limits, not llama-server (tests/disagg/test_route.py runs route against the real one).
The upstream echoes what it got, streams server-sent events without end, or holds a
request open, and records when route closes its connection.
"""

from __future__ import annotations

import http.client
import json
import select
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import psutil
import pytest

from linkctl.disagg.route import RouteConfig, Router, RouteServer
from linkctl.llama.client import LlamaServer

LIMIT = 64 * 1024
KEY = "k" * 32


class Upstream(ThreadingHTTPServer):
    """The decode server's stand-in. POST body {"hang": true}: hold the request until
    route closes the connection; {"stream": true}: SSE events until the socket fails;
    anything else: echo path, body and Authorization as JSON."""

    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _UpstreamHandler)
        self.seen: list[str] = []  # every request's path
        self.opened: list[str] = []
        self.closed: list[tuple[str, float]] = []
        self.changed = threading.Condition()

    def note(self, what: list, item: Any) -> None:
        with self.changed:
            what.append(item)
            self.changed.notify_all()

    def wait_for(self, what: list, n: int, timeout: float) -> bool:
        with self.changed:
            return self.changed.wait_for(lambda: len(what) >= n, timeout)


class _UpstreamHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: Upstream

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def _json(self, data: Any, status: int = 200) -> None:
        raw = json.dumps(data).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(raw)))
        self.end_headers()
        self.wfile.write(raw)

    def do_GET(self) -> None:
        self.server.note(self.server.seen, self.path)
        self._json({"path": self.path})

    def do_POST(self) -> None:
        self.server.note(self.server.seen, self.path)
        raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        try:
            body = json.loads(raw)
        except ValueError:
            body = None
        if not isinstance(body, dict):
            self._json({"path": self.path, "raw": raw.decode(errors="replace")}, 400)
            return
        if body.get("hang"):
            self.server.note(self.server.opened, self.path)
            self.connection.settimeout(30)
            try:
                while self.connection.recv(1):  # llama-server polls is_connection_closed
                    pass
            except OSError:
                pass
            self.server.note(self.server.closed, (self.path, time.monotonic()))
            self.close_connection = True
            return
        if body.get("stream"):
            self.server.note(self.server.opened, self.path)
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            event = b"data: " + json.dumps({"content": "x" * 32000}).encode() + b"\n\n"
            chunk = f"{len(event):x}\r\n".encode() + event + b"\r\n"
            n = int(body.get("events", 10**9))
            try:
                for _ in range(n):
                    self.wfile.write(chunk)
                    self.wfile.flush()
                self.wfile.write(b"0\r\n\r\n")
                return
            except OSError:
                self.server.note(self.server.closed, (self.path, time.monotonic()))
                self.close_connection = True
                return
        self._json({"path": self.path, "body": body, "auth": self.headers.get("Authorization")})


@pytest.fixture
def upstream():
    up = Upstream()
    threading.Thread(target=up.serve_forever, daemon=True).start()
    yield up
    up.shutdown()
    up.server_close()


@pytest.fixture
def front(upstream, tmp_path: Path):
    """start(**RouteConfig fields) -> a started RouteServer in front of ``upstream``."""
    started: list[RouteServer] = []

    def start(**kw: Any) -> RouteServer:
        cfg = RouteConfig(
            decode=LlamaServer("127.0.0.1", upstream.server_address[1]),
            decode_slot_dir=tmp_path,
            listen_port=0,
            max_body_bytes=LIMIT,
            body_timeout_s=1.0,
            header_timeout_s=5.0,
            idle_timeout_s=5.0,
            request_deadline_s=10.0,
            max_connections=64,
        )
        for k, v in kw.items():
            setattr(cfg, k, v)
        s = RouteServer(Router(cfg)).start()
        started.append(s)
        return s

    yield start
    for s in started:
        s.stop()


def call(
    port: int, method: str, path: str, body: Any = None, headers: dict[str, str] | None = None
) -> tuple[int, dict[str, str], bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        raw = json.dumps(body).encode() if body is not None else None
        conn.request(method, path, body=raw, headers=headers or {})
        r = conn.getresponse()
        return r.status, {k.lower(): v for k, v in r.getheaders()}, r.read()
    finally:
        conn.close()


def raw_exchange(port: int, data: bytes, timeout: float = 5.0) -> tuple[int, dict, bytes]:
    """Send ``data`` on a new connection; (status, headers, body) of the answer (read
    until the server closes or the body's Content-Length is in)."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(data)
        return read_answer(s)


def read_answer(s: socket.socket) -> tuple[int, dict, bytes]:
    buf = b""
    while b"\r\n\r\n" not in buf:
        got = s.recv(65536)
        assert got, f"connection closed before an answer: {buf!r}"
        buf += got
    head, _, rest = buf.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    headers = dict(ln.split(": ", 1) for ln in lines[1:])
    headers = {k.lower(): v for k, v in headers.items()}
    n = int(headers.get("content-length", -1))
    while n >= 0 and len(rest) < n:
        got = s.recv(65536)
        if not got:
            break
        rest += got
    return int(lines[0].split()[1]), headers, rest


def route_error(body: bytes, code: int) -> str:
    """The message of route's JSON error, checking its shape."""
    err = json.loads(body)["error"]
    assert err["code"] == code and err["type"] == "linkctl_route", err
    assert "\n" not in err["message"] and err["message"]
    return err["message"]


def post_head(path: str, *lines: str) -> bytes:
    head = [f"POST {path} HTTP/1.1", "Host: route", "Content-Type: application/json", *lines]
    return ("\r\n".join(head) + "\r\n\r\n").encode()


def test_a_huge_content_length_is_refused_on_its_header(front):
    s = front()
    rss = psutil.Process().memory_info().rss
    t = time.monotonic()
    status, headers, body = raw_exchange(
        s.port, post_head("/completion", f"Content-Length: {10**12}") + b'{"prompt": '
    )
    assert status == 413 and time.monotonic() - t < 1.0
    assert "over route's limit" in route_error(body, 413)
    assert headers["content-type"].startswith("application/json")
    assert psutil.Process().memory_info().rss - rss < 32 * 1024 * 1024


def test_a_lying_content_length_times_out_and_others_are_still_answered(front):
    s = front(body_timeout_s=1.0)
    liar = socket.create_connection(("127.0.0.1", s.port), timeout=5)
    try:
        t = time.monotonic()
        liar.sendall(post_head("/completion", "Content-Length: 100") + b'{"prompt":')
        # Meanwhile, an honest client is answered at once.
        status, headers, body = call(s.port, "POST", "/completion", {"prompt": "hi"})
        assert status == 200 and time.monotonic() - t < 0.9
        assert json.loads(body)["body"]["prompt"] == "hi"
        assert headers["x-linkctl-route"] == "direct"
        status, _, body = read_answer(liar)
        waited = time.monotonic() - t
        assert status == 408 and 0.9 < waited < 3, waited
        assert "not received within 1 s" in route_error(body, 408)
        liar.settimeout(5)
        assert liar.recv(100) == b""  # and the connection is closed
    finally:
        liar.close()


@pytest.mark.parametrize("value", ["-1", "12abc", "1e3", ""])
def test_a_content_length_that_is_not_a_byte_count_is_400(front, value):
    s = front()
    status, _, body = raw_exchange(s.port, post_head("/completion", f"Content-Length: {value}"))
    assert status == 400
    assert route_error(body, 400)


def test_malformed_requests_get_json_errors(front):
    s = front()
    status, _, body = raw_exchange(s.port, b"NOT HTTP AT ALL\r\n\r\n")
    assert status == 400 and route_error(body, 400)
    long_header = f"X-Long: {'a' * 20000}"
    status, _, body = raw_exchange(s.port, post_head("/completion", long_header))
    assert status in (400, 431) and route_error(body, status)
    status, _, body = raw_exchange(s.port, b"DELETE /completion HTTP/1.1\r\nHost: r\r\n\r\n")
    assert status == 405 and "GET and POST" in route_error(body, 405)
    # A broken chunked body: 400, not a closed connection.
    bad = post_head("/completion", "Transfer-Encoding: chunked") + b"zz\r\nabc\r\n0\r\n\r\n"
    status, _, body = raw_exchange(s.port, bad)
    assert status == 400 and route_error(body, 400)


def test_chunked_bodies_are_forwarded_within_the_limit_and_refused_past_it(front):
    s = front()
    payload = json.dumps({"prompt": "y" * 1000}).encode()
    chunks = b"".join(
        f"{len(payload[i : i + 100]):x}\r\n".encode() + payload[i : i + 100] + b"\r\n"
        for i in range(0, len(payload), 100)
    )
    req = post_head("/completion", "Transfer-Encoding: chunked") + chunks + b"0\r\n\r\n"
    status, headers, body = raw_exchange(s.port, req)
    assert status == 200, body
    echoed = json.loads(body)["body"]
    assert echoed["prompt"] == "y" * 1000 and echoed["id_slot"] == 0
    assert headers["x-linkctl-route"] == "direct"

    big = b"z" * 8192
    over = b"".join(f"{len(big):x}\r\n".encode() + big + b"\r\n" for _ in range(LIMIT // 8192 + 2))
    with socket.create_connection(("127.0.0.1", s.port), timeout=5) as c:
        c.sendall(post_head("/completion", "Transfer-Encoding: chunked") + over)
        status, _, body = read_answer(c)
    assert status == 413 and "over route's limit" in route_error(body, 413)


def test_expect_100_continue_is_answered(front):
    s = front()
    payload = json.dumps({"prompt": "hello"}).encode()
    with socket.create_connection(("127.0.0.1", s.port), timeout=5) as c:
        c.sendall(
            post_head("/completion", f"Content-Length: {len(payload)}", "Expect: 100-continue")
        )
        assert c.recv(100).startswith(b"HTTP/1.1 100 Continue\r\n\r\n")
        c.sendall(payload)
        status, _, body = read_answer(c)
    assert status == 200 and json.loads(body)["body"]["prompt"] == "hello"


def test_a_reader_that_reads_nothing_loses_its_slot_at_the_deadline(front, upstream):
    s = front(request_deadline_s=2.0, slots=1)
    slow = socket.socket()
    slow.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    slow.connect(("127.0.0.1", s.port))
    try:
        payload = json.dumps({"prompt": "p", "stream": True}).encode()
        t = time.monotonic()
        slow.sendall(post_head("/completion", f"Content-Length: {len(payload)}") + payload)
        assert upstream.wait_for(upstream.opened, 1, 2)
        time.sleep(0.8)
        # The one slot is the slow reader's: this request waits for it, and gets it
        # when the deadline ends the stream.
        status, headers, body = call(s.port, "POST", "/completion", {"prompt": "next"})
        done = time.monotonic() - t
        assert status == 200 and json.loads(body)["body"]["id_slot"] == 0
        assert headers["x-linkctl-slot"] == "0"
        assert 1.8 < done < 3.5, done
        # route closed the stream's upstream connection (the generation stops).
        assert upstream.wait_for(upstream.closed, 1, 3)
        stats = call(s.port, "GET", "/linkctl/stats")[2]
        recent = json.loads(stats)["recent"]
        assert "past the deadline" in recent[0]["error"], recent
    finally:
        slow.close()


def test_a_stream_is_relayed_event_by_event(front):
    s = front()
    conn = http.client.HTTPConnection("127.0.0.1", s.port, timeout=10)
    try:
        conn.request("POST", "/completion", json.dumps({"stream": True, "events": 3}))
        r = conn.getresponse()
        assert r.status == 200 and r.getheader("Transfer-Encoding") == "chunked"
        assert r.getheader("X-Linkctl-Route") == "direct"
        events = [e for e in r.read().split(b"\n\n") if e]
        assert len(events) == 3 and all(e.startswith(b"data: ") for e in events)
    finally:
        conn.close()


def test_a_client_that_goes_away_cancels_its_generation(front, upstream):
    s = front(slots=1)
    payload = json.dumps({"prompt": "p", "hang": True}).encode()
    c = socket.create_connection(("127.0.0.1", s.port), timeout=5)
    c.sendall(post_head("/completion", f"Content-Length: {len(payload)}") + payload)
    assert upstream.wait_for(upstream.opened, 1, 3)
    gone = time.monotonic()
    c.close()
    # The upstream connection closes: llama-server would stop generating.
    assert upstream.wait_for(upstream.closed, 1, 3)
    assert upstream.closed[0][1] - gone < 2.0
    # And the slot is free again.
    status, _, body = call(s.port, "POST", "/completion", {"prompt": "after"})
    assert status == 200 and json.loads(body)["body"]["id_slot"] == 0
    recent = json.loads(call(s.port, "GET", "/linkctl/stats")[2])["recent"]
    assert recent[0]["error"] == "generate: the client went away", recent


def test_an_idle_flood_does_not_keep_clients_out(front):
    s = front(max_connections=8, header_timeout_s=30.0)
    idle = []
    try:
        for _ in range(200):
            idle.append(socket.create_connection(("127.0.0.1", s.port), timeout=5))
        t = time.monotonic()
        assert call(s.port, "POST", "/completion", {"prompt": "still here"})[0] == 200
        assert time.monotonic() - t < 2.0
        # Route holds at most its cap: the oldest idle connections were closed.
        readable, _, _ = select.select(idle, [], [], 1.0)
        time.sleep(0.2)
        readable, _, _ = select.select(idle, [], [], 0)
        closed = sum(c.recv(1) == b"" for c in readable)
        assert closed >= 200 - 8, closed
    finally:
        for c in idle:
            c.close()


def test_connections_that_send_no_request_are_closed(front):
    s = front(header_timeout_s=0.5)
    quiet = socket.create_connection(("127.0.0.1", s.port), timeout=5)
    slow = socket.create_connection(("127.0.0.1", s.port), timeout=5)
    try:
        t = time.monotonic()
        slow.sendall(b"POST /completion HTTP/1.1\r\nHost: r\r\n")  # never finished
        assert quiet.recv(1) == b""
        assert slow.recv(1) == b""
        assert time.monotonic() - t < 2.0
    finally:
        quiet.close()
        slow.close()


def test_past_the_cap_with_every_connection_busy_is_503(front):
    s = front(max_connections=2, body_timeout_s=2.0)
    busy = [socket.create_connection(("127.0.0.1", s.port), timeout=5) for _ in range(2)]
    try:
        for c in busy:
            c.sendall(post_head("/completion", "Content-Length: 50") + b"{")
        time.sleep(0.3)
        status, headers, body = raw_exchange(s.port, b"")
        assert status == 503 and headers["retry-after"] == "1"
        assert "all busy" in route_error(body, 503)
        for c in busy:
            assert read_answer(c)[0] == 408
        status, _, _ = call(s.port, "GET", "/health")
        assert status == 200
    finally:
        for c in busy:
            c.close()


@pytest.mark.parametrize(
    "path", ["/%73lots/0?action=erase", "/v1/../slots/0", "//slots", "//slots/0?action=erase"]
)
def test_slot_actions_are_refused_however_spelled(front, upstream, path):
    s = front()
    for method in ("GET", "POST"):
        status, _, body = raw_exchange(
            s.port, f"{method} {path} HTTP/1.1\r\nHost: r\r\nContent-Length: 2\r\n\r\n{{}}".encode()
        )
        assert status == 403 and "route owns the slots" in route_error(body, 403)
    assert upstream.seen == []


def test_stats_need_the_key_and_bad_json_goes_to_the_decode_server(front):
    s = front(api_keys=[KEY])
    status, _, body = call(s.port, "GET", "/linkctl/stats")
    assert status == 401 and json.loads(body)["error"]["type"] == "authentication_error"
    status, _, body = call(
        s.port, "GET", "/linkctl/stats", headers={"Authorization": f"Bearer {KEY}"}
    )
    assert status == 200 and "counts" in json.loads(body)
    conn = http.client.HTTPConnection("127.0.0.1", s.port, timeout=5)
    conn.request("POST", "/v1/chat/completions", body=b"{not json", headers={"X-A": "1"})
    r = conn.getresponse()
    assert r.status == 400 and json.loads(r.read())["raw"] == "{not json"
    conn.close()
    # The client's Authorization goes upstream with a generation request.
    status, _, body = call(
        s.port, "POST", "/completion", {"prompt": "a"}, {"Authorization": "Bearer zz"}
    )
    assert status == 200 and json.loads(body)["auth"] == "Bearer zz"


def test_the_decode_server_gone_is_a_502(front, upstream):
    s = front()
    upstream.shutdown()
    upstream.server_close()
    status, _, body = call(s.port, "POST", "/completion", {"prompt": "a"})
    assert status == 502 and "decode server" in route_error(body, 502)
