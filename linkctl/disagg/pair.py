"""Can the two servers of disaggregated serving share slots? route refuses to start
(and doctor FAILs) when they cannot: another llama.cpp build, model file type, slot
count, context or chat template (/props), another model file or KV cache layout
(linkctl.disagg.fingerprint)."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from linkctl.core.errors import InputError
from linkctl.core.log import Say, quiet
from linkctl.core.wait import until_answered
from linkctl.disagg.fingerprint import ModelFingerprint
from linkctl.llama.client import LlamaServer, UpstreamError

if TYPE_CHECKING:
    from linkctl.disagg.router import RouteConfig

# /props fields both servers must agree on (tools/server/server-context.cpp get_res_props).
SAME_PROPS = (
    ("build_info", "llama.cpp build"),
    ("model_ftype", "model file type"),
    ("total_slots", "slot count (-np)"),
    ("chat_template", "chat template"),
)


def compare_servers(decode: dict[str, Any], prefill: dict[str, Any]) -> list[str]:
    """The differences between the two servers' /props that make a slot file from one
    unusable (or a different answer) on the other; empty when they match."""
    diffs = []
    for key, what in SAME_PROPS:
        a, b = decode.get(key), prefill.get(key)
        if a != b:
            diffs.append(f"{what} ({key}): decode {_short(a)}, prefill {_short(b)}")
    a = (decode.get("default_generation_settings") or {}).get("n_ctx")
    b = (prefill.get("default_generation_settings") or {}).get("n_ctx")
    if a != b:
        diffs.append(f"context per slot (n_ctx): decode {a}, prefill {b}")
    return diffs


def _short(v: Any) -> str:
    s = json.dumps(v) if not isinstance(v, str) else repr(v)
    return s if len(s) <= 60 else s[:57] + "..."


def wait_props(
    up: LlamaServer, deadline_s: float, say: Say, headers: dict[str, str]
) -> dict[str, Any]:
    """/props of a server, waiting while it loads (503) or is not up yet."""
    return until_answered(
        lambda: up.props(headers, timeout=5),
        within=deadline_s,
        what=up.url,
        say=say,
        retry_on=UpstreamError,
    )


def check_pair(
    cfg: RouteConfig,
    fingerprints: tuple[ModelFingerprint, ModelFingerprint] | None = None,
    wait_s: float = 120.0,
    say: Say = quiet,
) -> list[str]:
    """Refuse (InputError naming the difference) when the two servers cannot share
    slots: another build, model type, context, slot count or template (/props), or
    another model file or KV cache layout (``fingerprints``: decode side, prefill side)."""
    if cfg.prefill is None:
        return []
    d = wait_props(cfg.decode, wait_s, say, cfg.own_headers())
    p = wait_props(cfg.prefill, wait_s, say, cfg.prefill_headers())
    diffs = compare_servers(d, p)
    if fingerprints:
        decode, prefill = fingerprints
        diffs += [d.text("decode", "prefill") for d in decode.diff(prefill)]
    if diffs:
        raise InputError(
            "the decode and prefill servers differ: " + "; ".join(diffs),
            "run the same llama.cpp build, model file (`linkctl model sync`), ctx, -np and KV "
            "cache flags (-ctk, -ctv, -fa) on both",
        )
    n_ctx = (d.get("default_generation_settings") or {}).get("n_ctx")
    line = (
        f"decode {cfg.decode.url} and prefill {cfg.prefill.url} match: "
        f"build {d.get('build_info')}, n_ctx {n_ctx}, slots {d.get('total_slots')}"
    )
    say(line)
    return [line]
