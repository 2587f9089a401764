"""doctor's checks for serve.mode = "disaggregated": the model on this host, the slot
directory, and from the head the kv-agent's model (the same file, the same KV layout)
and the two servers' /props (same build, context, slots, template)."""

from __future__ import annotations

import os
from typing import Any

from linkctl.core.checks import Check, Verdict
from linkctl.core.errors import InputError
from linkctl.core.profile import HostSpec, Profile
from linkctl.disagg.plan import kv_dir, kv_layout, prefill_model_path, route_config


def _check(name: str, verdict: Verdict, value: Any, detail: str, fix: str | None = None) -> Check:
    return Check(name, verdict, value, detail=detail, fix=fix)


def restore_check(model_path: str) -> Check:
    """ "slot restores": a WARN, not a FAIL, for a model whose slot restores do not take
    (route copes: it checks each one and prefills locally when it did not)."""
    from linkctl.estimate.ttft import restore_risk
    from linkctl.gguf.info import read_model

    name = "slot restores"
    try:
        model = read_model(model_path)
    except InputError as e:
        return _check(name, Verdict.SKIP, None, e.message)
    risk, arch = restore_risk(model), model.architecture
    if risk is None:
        return _check(name, Verdict.PASS, arch, f"{arch}: restores reuse the moved cache")
    fix = 'serve a full-attention model, or serve.mode = "split"'
    return _check(name, Verdict.WARN, arch, risk.text(), fix)


def doctor_checks(
    profile: Profile, host: HostSpec, answered: dict[str, bool], timeout_s: float
) -> list[Check]:
    """The lines doctor adds in disaggregated mode (``answered``: which peers answered
    ARP; the kv-agent and the servers are asked only then)."""
    pre = profile.prefill_host
    if host.role == "head":
        model, where = profile.serve.model, "serve.model"
    elif host.name == pre.name:
        model, where = prefill_model_path(profile), "serve.disagg.prefill_model"
    else:
        return [
            _check(
                "disagg role",
                Verdict.PASS,
                "none",
                f"{host.name} is not the prefill host ({pre.name})",
            )
        ]
    out = [_model_here(model, where, host), _slot_dir()]
    if host.role == "head":
        out += _pair(profile, host, model, answered, timeout_s)
    return out


def _model_here(model: str, where: str, host: HostSpec) -> Check:
    if model and os.path.isfile(model):
        size = os.path.getsize(model)
        return _check(
            "disagg model", Verdict.PASS, model, f"{where} {model} is here ({size} bytes)"
        )
    fix = "linkctl model sync (on the head)" if host.role != "head" else "set serve.model"
    detail = f"{where} {model!r} is not a file on {host.name}"
    return _check("disagg model", Verdict.FAIL, model or None, detail, fix)


def _slot_dir() -> Check:
    d = kv_dir()
    parent = next((p for p in (d, *d.parents) if p.exists()), None)
    if parent is not None and os.access(parent, os.W_OK):
        return _check(
            "slot directory", Verdict.PASS, str(d), f"slot files go to {d} (--slot-save-path)"
        )
    return _check(
        "slot directory",
        Verdict.FAIL,
        str(d),
        f"{d} cannot be created here",
        "check LINKCTL_STATE_DIR",
    )


def _pair(
    profile: Profile, host: HostSpec, model: str, answered: dict[str, bool], timeout_s: float
) -> list[Check]:
    from linkctl.disagg import kvxfer
    from linkctl.disagg.fingerprint import MODEL_FILE, fingerprint
    from linkctl.disagg.pair import compare_servers
    from linkctl.llama.client import UpstreamError
    from linkctl.trust.secret import load

    pre = profile.prefill_host
    if not answered.get(pre.name):
        detail = f"peer {pre.name} not reached by ARP (see its line)"
        return [_check("kv-agent", Verdict.SKIP, None, detail)]
    port = profile.serve.disagg.agent_port
    try:
        theirs = kvxfer.remote_model(
            pre.ip, port, secret=load(profile.name), source=host.ip, timeout=timeout_s
        )
    except InputError as e:
        detail = f"{pre.ip}:{port}: {e.message} (start `linkctl serve` on {pre.name})"
        return [_check("kv-agent", Verdict.SKIP, None, detail)]
    mine = fingerprint(model, kv_layout(profile))
    if mine.same_file(theirs):
        agent = _check(
            "kv-agent",
            Verdict.PASS,
            theirs.path,
            f"{pre.name} serves the same model file ({theirs.path})",
        )
    else:
        agent = _check(
            "kv-agent",
            Verdict.FAIL,
            theirs.path,
            f"{pre.name}'s model {theirs.path} ({theirs.size} bytes) is not this "
            f"host's {model} ({mine.size} bytes)",
            "linkctl model sync",
        )
    try:
        cfg = route_config(profile)
    except InputError as e:
        detail = f"no API key to ask with: {e.message}"
        return [agent, _check("servers match", Verdict.SKIP, None, detail)]
    own = cfg.own_headers()
    try:
        theirs_p = cfg.prefill.props(cfg.prefill_headers(), timeout_s) if cfg.prefill else {}
        mine_p = cfg.decode.props(own, timeout_s)
    except UpstreamError as e:
        detail = f"not both servers answer yet: {e.message}"
        return [agent, _check("servers match", Verdict.SKIP, None, detail)]
    diffs = compare_servers(mine_p, theirs_p)
    # The file itself is the kv-agent line's; here the layout the servers run.
    diffs += [d.text("decode", "prefill") for d in mine.diff(theirs) if d.field != MODEL_FILE]
    if diffs:
        match = _check(
            "servers match",
            Verdict.FAIL,
            None,
            "; ".join(diffs),
            "run one llama.cpp build and profile on both",
        )
    else:
        match = _check(
            "servers match",
            Verdict.PASS,
            mine_p.get("build_info"),
            "decode and prefill servers: same build, n_ctx, slots, template, KV cache flags",
        )
    return [agent, match]
