"""One party of tests/test_trust.py, run inside a lab host (`linkctl lab exec`, so
LINKCTL_STATE_DIR is that host's): argv[1] is the role, argv[2] a JSON object.

    agent      the kv-agent on ARGS.bind with ARGS.areas, the host's pair secret;
               prints "ready PORT", serves until stdin closes
    attack     as the third host or a local user: ARGS.key "own" (this host's secret,
               which is not the pair's) or "random"; tries put, get+delete and a planted
               KV file, and the responder's banner; prints one JSON line of outcomes
    pair       as the head, holding the pair's secret: stat, put and get on the agent,
               the responder's banner; prints one JSON line
"""

from __future__ import annotations

import ipaddress
import json
import os
import sys
import tempfile
from pathlib import Path

from linkctl.core.errors import InputError
from linkctl.disagg import kvagent, kvxfer
from linkctl.probe.latency import EchoClient
from linkctl.trust import secret
from linkctl.trust.secret import PairSecret


def outcome(fn) -> str:
    try:
        fn()
    except InputError as e:
        return "refused: " + e.message
    return "done"


def main() -> None:
    role, args = sys.argv[1], json.loads(sys.argv[2])
    profile = args["profile"]
    if role == "agent":
        areas = {k: Path(v) for k, v in args["areas"].items()}
        net = ipaddress.IPv4Network(args["subnet"])
        with kvagent.Agent(args["bind"], 0, areas, net, secret.load(profile)) as a:
            print(f"ready {a.port}", flush=True)
            sys.stdin.read()
        return
    host, port, src = args["agent"], args["port"], args["source"]
    tmp = Path(tempfile.mkdtemp())  # this party's own: user nobody writes here too
    if role == "attack" and args["key"] == "own":
        key = secret.load(profile)  # this host's, which is not the pair's
    elif role == "attack":
        key = PairSecret(os.urandom(32), "guessed")
    else:
        key = secret.load(profile)
    planted = tmp / f"planted-{role}.kv"
    planted.write_bytes(b"planted")

    def put() -> None:
        if role == "attack":  # overwrite the model
            kvxfer.put(host, port, "models", planted, name="model.gguf", secret=key, source=src)
        else:  # a slot file, as route's peer would
            kvxfer.put(host, port, "kv", planted, secret=key, source=src)

    def get() -> None:
        dest = tmp / "got"
        kvxfer.fetch(
            host,
            port,
            "models",
            "model.gguf",
            dest,
            delete=role == "attack",
            secret=key,
            source=src,
        )

    out = {
        "put_model": outcome(put),
        "get_delete": outcome(get),
        "stat": outcome(lambda: kvxfer.stat(host, port, "models", "model.gguf", secret=key)),
        "responder": outcome(
            lambda: EchoClient(args["responder"], args["responder_port"], src, 5, key).close()
        ),
    }
    if role == "attack":
        out["read_secret"] = outcome(lambda: secret.load(profile))
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
