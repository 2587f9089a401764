"""A client run inside a lab host: the requests of test_route.py and bench/disagg.py.

    python route_client.py OPS_JSON  ->  prints one JSON result per op (a JSON list)

An op: {"port": P, "path": "/completion", "body": {...}, "stream": bool, "headers": {...}},
optionally
"kill": {"status": PATH, "stages": [...]} to SIGKILL the child named in a supervisor
status file while route reports one of those stages for the request.
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import sys
import threading
import time


def prompt_of(n_tokens: int, seed: int = 0) -> str:
    """A text of n_tokens tokens for the tiny model: one token per byte, plus BOS; words
    joined by '-' (a space would be SentencePiece's 3-byte U+2581, 3 tokens)."""
    words = [
        "the",
        "link",
        "moves",
        "a",
        "cache",
        "of",
        "keys",
        "and",
        "values",
        "from",
        "one",
        "host",
        "to",
        "the",
        "other",
    ]
    out, i = [], seed
    while len("-".join(out)) < n_tokens:
        out.append(words[i % len(words)])
        i += 7
    return "-".join(out)[: n_tokens - 1]


def post(port: int, path: str, body: dict, stream: bool, headers: dict | None = None) -> dict:
    t0 = time.monotonic()
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    c.request(
        "POST", path, json.dumps(body), {"Content-Type": "application/json"} | (headers or {})
    )
    r = c.getresponse()
    headers = {k.lower(): v for k, v in r.getheaders()}
    out: dict = {"status": r.status, "headers": headers}
    if stream:
        events, first = [], None
        for line in r:
            if not line.startswith(b"data: "):
                continue
            data = line[6:].strip()
            if data == b"[DONE]":
                out["done_marker"] = True
                continue
            ev = json.loads(data)
            if first is None:
                first = time.monotonic() - t0
            events.append(ev)
        out |= {"events": events, "first_event_s": first}
    else:
        raw = r.read()
        out["body"] = json.loads(raw) if raw else None
    out["total_s"] = time.monotonic() - t0
    c.close()
    return out


def stats(port: int, headers: dict | None = None) -> dict:
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    c.request("GET", "/linkctl/stats", headers=headers or {})
    d = json.loads(c.getresponse().read())
    c.close()
    return d


def run(op: dict) -> dict:
    kill, hdrs = op.get("kill"), op.get("headers")
    if not kill:
        return post(op["port"], op["path"], op["body"], op.get("stream", False), hdrs)
    result: dict = {}
    t = threading.Thread(
        target=lambda: result.update(
            post(op["port"], op["path"], op["body"], op.get("stream"), hdrs)
        )
    )
    t.start()
    seen, deadline = None, time.monotonic() + 120
    while t.is_alive() and time.monotonic() < deadline:
        stages = [i["stage"] for i in stats(op["port"], hdrs)["inflight"]]
        hit = next((s for s in stages if s in kill["stages"]), None)
        if hit:
            with open(kill["status"]) as f:
                pid = json.load(f)["child_pid"]
            os.kill(pid, signal.SIGKILL)
            seen = {"stage": hit, "pid": pid}
            break
        time.sleep(0.002)
    t.join()
    return result | {"killed": seen}


if __name__ == "__main__":
    print(json.dumps([run(op) for op in json.loads(sys.argv[1])]))
