"""The one llama-server HTTP client, against a small server that answers the way
llama-server does (JSON, an error object, or something else). Server and client run in
a network namespace made for the test, on a 198.18.0.0/15 address of its own: no packet
of these tests is sent anywhere else."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from linkctl.core.errors import CheckFailed, LinkctlError
from linkctl.lab import netns
from linkctl.llama.client import LlamaServer, UpstreamError
from linkctl.llama.invocation import ServerInvocation
from support.cli import need_root_netns

ADDR = "198.18.250.1"


class _Handler(BaseHTTPRequestHandler):
    def log_message(self, *_args: object) -> None:
        pass

    def _send(self, status: int, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        if self.path == "/health":
            self._send(200, b'{"status": "ok"}')
        elif self.path == "/props":
            if self.headers.get("Authorization") != "Bearer k":
                err = {"error": {"code": 401, "message": "Invalid API Key"}}
                self._send(401, json.dumps(err).encode())
            else:
                self._send(200, b'{"total_slots": 1}')
        else:
            self._send(500, b"<html>oops</html>")

    def do_POST(self) -> None:
        n = int(self.headers.get("Content-Length") or 0)
        body = json.loads(self.rfile.read(n) or b"{}")
        if self.path == "/tokenize":
            self._send(200, json.dumps({"tokens": list(range(len(body["content"])))}).encode())
        else:
            self._send(200, json.dumps({"echo": body, "path": self.path}).encode())


@pytest.fixture
def ns() -> Iterator[None]:
    """A namespace of the test's own, its loopback up with ADDR on it; the test body
    (and every socket it opens) runs inside it."""
    need_root_netns()
    name = "lk-client-" + uuid.uuid4().hex[:6]
    subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        subprocess.run(["ip", "-n", name, "link", "set", "lo", "up"], check=True)
        subprocess.run(["ip", "-n", name, "addr", "add", f"{ADDR}/32", "dev", "lo"], check=True)
        with netns.inside(name):
            yield
    finally:
        subprocess.run(["ip", "netns", "del", name], check=True)


@pytest.fixture
def server(ns: None) -> Iterator[LlamaServer]:
    httpd = ThreadingHTTPServer((ADDR, 0), _Handler)  # bound inside the namespace
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        yield LlamaServer(ADDR, httpd.server_address[1], timeout=5)
    finally:
        httpd.shutdown()
        httpd.server_close()


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind((ADDR, 0))
        return s.getsockname()[1]


def test_calls_answer_json(server: LlamaServer):
    assert server.healthy()
    assert server.tokenize("abc") == [0, 1, 2]
    r = server.slot(3, "save", "x.kv")
    assert r == {"echo": {"filename": "x.kv"}, "path": "/slots/3?action=save"}
    assert server.props(headers={"Authorization": "Bearer k"}) == {"total_slots": 1}


def test_each_failure_is_an_upstream_error_naming_server_and_path(server: LlamaServer):
    with pytest.raises(UpstreamError) as e:
        server.props()
    assert e.value.status == 401 and e.value.url == f"{server.url}/props"
    assert "HTTP 401: Invalid API Key" in e.value.message
    with pytest.raises(UpstreamError) as e:
        server.call("GET", "/other")
    assert e.value.status == 500 and "not JSON" in e.value.message
    down = LlamaServer(ADDR, _closed_port(), timeout=2)
    with pytest.raises(UpstreamError) as e:
        down.props()
    assert e.value.status is None and "ConnectionRefusedError" in e.value.message
    assert not down.healthy()
    # It is a check that failed (exit 1), with a fix, like every linkctl error.
    assert isinstance(e.value, CheckFailed) and isinstance(e.value, LinkctlError)
    assert e.value.exit_code == 1 and e.value.fix


def test_wait_healthy_stops_when_the_server_exits(ns: None):
    proc = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    proc.wait()
    with pytest.raises(CheckFailed, match="exited 3 while loading"):
        LlamaServer(ADDR, _closed_port()).wait_healthy(proc, 5, None)


def test_a_wildcard_listen_address_is_reached_through_loopback():
    inv = ServerInvocation("llama-server", "m.gguf", host="0.0.0.0", port=9999)
    assert LlamaServer.serving(inv).url == "http://127.0.0.1:9999"
    inv = inv.changed(host="198.18.100.1")
    assert LlamaServer.serving(inv).url == "http://198.18.100.1:9999"
