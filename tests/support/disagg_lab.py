"""The disaggregated pair in the lab, as tests/disagg/ drive it: a profile that serves a
model disaggregated (dgx prefills, mac decodes behind route), the two serves started
in order, and requests made from inside mac (tests/support/route_client.py)."""

from __future__ import annotations

import contextlib
import json
import sys
from collections.abc import Iterator
from pathlib import Path

from support.paths import SUPPORT
from support.serve_lab import Serve

DECODE, ROUTE = 8080, 9999
KEY = "k" * 32
AUTH = {"Authorization": f"Bearer {KEY}"}


def disagg_profile(lab, tmp_path: Path, model: str, threshold: int) -> Path:
    """The lab's profile in serve.mode = "disaggregated" for ``model``, with an API key
    (both llama-servers want one), after `linkctl setup` on both hosts."""
    import tomllib

    import tomli_w

    for h in ("dgx", "mac"):
        r = lab.run(h, "setup")
        assert r.returncode == 0, r.stderr
    data = tomllib.loads(Path(lab.profile_path).read_text())
    keyfile = tmp_path / "keys"
    keyfile.write_text(KEY + "\n")
    keyfile.chmod(0o600)
    data["serve"] |= {
        "api_key_file": str(keyfile),
        "mode": "disaggregated",
        "model": model,
        "ctx": 4096,
        "disagg": {"threshold_tokens": threshold},
    }
    prof = tmp_path / "disagg.toml"
    prof.write_text(tomli_w.dumps(data))
    return prof


@contextlib.contextmanager
def serving(lab, prof: Path, tmp_path: Path) -> Iterator[tuple[Serve, Serve]]:
    """Both serves, ready: the prefill host's (its model brought by `linkctl model sync`)
    and the head's with route listening; stopped at the end."""
    pre = Serve(lab, "dgx", "prefill", ["--profile", str(prof)], tmp_path / "dgx.log")
    head = None
    try:
        pre.wait(lambda s: s["state"] == "waiting", 60, "prefill waiting for the model")
        r = lab.run("mac", "model", "sync", "--profile", str(prof), "--json")
        assert r.returncode == 0, r.stderr
        pre.wait(lambda s: s["state"] == "ready", 120, "prefill llama-server ready")
        head = Serve(
            lab, "mac", "head", ["--profile", str(prof), "--skip-probe"], tmp_path / "mac.log"
        )
        head.wait(lambda s: s["state"] == "ready", 120, "decode llama-server ready")
        route_status = head.status_path.with_name("route.json")
        head.wait(lambda s: route_status.exists(), 60, "route listening")
        yield pre, head
    finally:
        if head:
            head.stop()
        pre.stop()


def ops(lab, *items: dict, timeout: float = 600) -> list[dict]:
    """Requests from inside mac, with the API key unless an op gives its own headers."""
    r = lab.exec(
        "mac",
        sys.executable,
        str(SUPPORT / "route_client.py"),
        json.dumps([{"headers": AUTH} | op for op in items]),
        timeout=timeout,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout)


def route_stats(lab) -> dict:
    """route's /linkctl/stats, asked from inside mac."""
    code = (
        "import json, sys; sys.path.insert(0, sys.argv[1]); from route_client import stats; "
        "print(json.dumps(stats(int(sys.argv[2]), json.loads(sys.argv[3]))))"
    )
    r = lab.exec("mac", sys.executable, "-c", code, str(SUPPORT), str(ROUTE), json.dumps(AUTH))
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout)


def greedy(prompt: str, n: int = 24, **extra) -> dict:
    return {
        "prompt": prompt,
        "n_predict": n,
        "temperature": 0,
        "seed": 42,
        "ignore_eos": True,
        "return_tokens": True,
    } | extra


def chat(content: str, n: int = 16, **extra) -> dict:
    return {
        "messages": [{"role": "user", "content": content}],
        "max_tokens": n,
        "temperature": 0,
        "seed": 42,
    } | extra
