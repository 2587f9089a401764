"""A client inside the head's namespace sending completions one after the other, each
logged as one JSON line: what a client of the pair saw while faults came and went."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

TIMEOUT_S = 30.0  # the client's own limit
HUNG_S = 10.0  # longer than this, a request hung: a switch answers its clients within 2 s

LOOP = r"""
import json, sys, time, urllib.error, urllib.request
url, log, timeout = sys.argv[1], sys.argv[2], float(sys.argv[3])
# Prefill of about a hundred tokens per request: prefill is where a slow link shows.
prompt = "the quick brown fox jumps over the lazy dog " * 2
body = json.dumps({"prompt": prompt, "n_predict": 32, "ignore_eos": True, "temperature": 0,
                   "cache_prompt": False}).encode()
with open(log, "a", buffering=1) as out:
    while True:
        t0 = time.time()
        rec = {"t0": t0}
        try:
            req = urllib.request.Request(url, body, {"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=timeout) as r:
                rec |= {"ok": True, "tokens": json.loads(r.read())["tokens_predicted"]}
        except urllib.error.HTTPError as e:
            rec |= {"ok": False, "error": f"HTTP {e.code}: {e.read()[:200]!r}"}
        except Exception as e:
            rec |= {"ok": False, "error": f"{type(e).__name__}: {e}"}
            time.sleep(0.2)  # nothing listens (a restart): do not spin
        rec["s"] = round(time.time() - t0, 3)
        out.write(json.dumps(rec) + "\n")
"""


class Client:
    def __init__(self, lab, log: Path, url: str = "http://127.0.0.1:9999/completion"):
        self.log = log
        self.proc = subprocess.Popen(
            ["ip", "netns", "exec", lab.netns("mac"), sys.executable, "-c", LOOP, url,
             str(log), str(TIMEOUT_S)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )  # fmt: skip
        self._checked = 0  # records already judged by no_hang

    def records(self) -> list[dict]:
        try:
            lines = self.log.read_text().splitlines()
        except OSError:
            return []
        return [json.loads(ln) for ln in lines if ln.strip()]

    def wait_ok(self, n: int, timeout: float) -> None:
        """``n`` completions that succeed, all started from now."""
        t = time.time()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if sum(1 for r in self.records() if r["t0"] >= t and r.get("ok")) >= n:
                return
            time.sleep(0.1)
        raise AssertionError(f"{n} completions did not succeed within {timeout} s: "
                             f"{self.records()[-5:]}")  # fmt: skip

    def no_hang(self) -> list[str]:
        """Every request since the last call ended within HUNG_S; returns
        the errors clients saw (printed: what a client saw during the fault)."""
        recs = self.records()[self._checked :]
        self._checked += len(recs)
        hung = [r for r in recs if r["s"] >= HUNG_S]
        assert not hung, hung
        errors = sorted({r["error"][:120] for r in recs if not r.get("ok")})
        ok = sum(1 for r in recs if r.get("ok"))
        print(f"client: {ok} completions, {len(recs) - ok} errors, longest "
              f"{max((r['s'] for r in recs), default=0):.2f} s; errors: {errors}")  # fmt: skip
        return errors

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)
