"""serve.mode = "disaggregated": what each host runs, from the profile.

    prefill host : llama-server on its link address (--slot-save-path = the kv area)
                   + kv-agent on its link address (areas kv and models)
    head         : llama-server on 127.0.0.1:decode_port (--slot-save-path its own kv dir)
                   + route on serve.host:serve.port, where clients already go

Both servers get the same context, slot count, GPU layers and extra arguments from
the one profile (the same KV cache type among them), and --cache-ram 0 (see
linkctl/disagg/route.py for why). A layer split's --rpc is not used in this mode.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from linkctl.core.paths import state_dir, write_atomic
from linkctl.core.profile import HostSpec, Profile


def kv_dir() -> Path:
    """This host's slot files: the llama-server --slot-save-path and the agent's kv area."""
    return state_dir() / "serve" / "slots"


def models_dir() -> Path:
    """Where `linkctl model sync` puts model files on the prefill host."""
    return state_dir() / "models"


def prefill_model_path(profile: Profile) -> str:
    d = profile.serve.disagg
    if d.prefill_model:
        return d.prefill_model
    return str(models_dir() / Path(profile.serve.model or "model.gguf").name)


def server_argv(profile: Profile, binary: str, model: str, host: str, port: int) -> list[str]:
    s, d = profile.serve, profile.serve.disagg
    argv = [binary, "-m", model, "-c", str(s.ctx), "-np", str(d.slots), "-ngl", str(s.ngl)]
    argv += ["--host", host, "--port", str(port), "--slot-save-path", str(kv_dir())]
    argv += ["--cache-ram", "0"]
    if s.api_key_file:
        # Both servers check the key: route forwards the client's Authorization header
        # on every call made for the client (linkctl.disagg.route._client_headers) and uses
        # the first key for its own (/props, slot actions: RouteConfig.own_headers).
        argv += ["--api-key-file", s.api_key_file]
    if s.threads:
        argv += ["-t", str(s.threads)]
    return argv + list(s.extra_args)


# The llama-server flags that change what a slot file holds. A state file records the
# cache's types and whether V is stored transposed (no flash attention), and
# llama.cpp refuses to restore one that differs (src/llama-kv-cache.cpp,
# state_read_meta/state_read_data); /props does not report them, so both sides
# report the flags they were started with. Defaults as `llama-server --help` prints.
KV_FLAGS = {
    "cache_type_k": (("-ctk", "--cache-type-k"), "f16"),
    "cache_type_v": (("-ctv", "--cache-type-v"), "f16"),
    "flash_attn": (("-fa", "--flash-attn"), "auto"),
}


def kv_layout(argv: list[str]) -> dict[str, str]:
    """The KV cache flags of a llama-server argv (last one wins, as in its parser)."""
    out = {k: default for k, (_names, default) in KV_FLAGS.items()}
    for i, a in enumerate(argv[:-1]):
        for key, (names, _default) in KV_FLAGS.items():
            if a in names:
                out[key] = argv[i + 1]
    return out


@dataclass
class DisaggPlan:
    profile: str
    host: str
    role: str  # "prefill" or "decode"
    argv: list[str]  # this host's llama-server
    prefill_argv: list[str]
    decode_argv: list[str]
    prefill_url: str
    decode_url: str
    agent: str  # host:port of the kv-agent
    route_listen: str
    threshold_tokens: int | None
    notes: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def build_plan(
    profile: Profile, host: HostSpec, binary: str = "llama-server", model: str | None = None
) -> DisaggPlan:
    s, d = profile.serve, profile.serve.disagg
    pre = profile.prefill_host
    model = model or s.model
    notes = []
    if not model:
        notes.append("serve.model is empty: set it in the profile or pass --model")
    pre_argv = server_argv(profile, binary, prefill_model_path(profile), pre.ip, d.prefill_port)
    dec_argv = server_argv(profile, binary, model or "MODEL", "127.0.0.1", d.decode_port)
    role = "decode" if host.role == "head" else "prefill"
    if role == "prefill" and host.name != pre.name:
        notes.append(f"{host.name} is not the prefill host ({pre.name}): it runs nothing")
    return DisaggPlan(
        profile=profile.name,
        host=host.name,
        role=role,
        argv=dec_argv if role == "decode" else pre_argv,
        prefill_argv=pre_argv,
        decode_argv=dec_argv,
        prefill_url=f"http://{pre.ip}:{d.prefill_port}",
        decode_url=f"http://127.0.0.1:{d.decode_port}",
        agent=f"{pre.ip}:{d.agent_port}",
        route_listen=f"{s.host}:{s.port}",
        threshold_tokens=d.threshold_tokens,
        notes=notes,
    )


def resolve_route_config(profile: Profile, model: str | None, threshold: int | None = None):
    """route_config with the threshold from --threshold, else the profile, else the
    estimate (linkctl/estimate/ttft.py)."""
    from linkctl.estimate.ttft import threshold_for_profile

    if threshold is not None or profile.serve.disagg.threshold_tokens is not None:
        return route_config(profile, threshold)
    est = threshold_for_profile(profile, model or profile.serve.model)
    return route_config(profile, est.tokens, source=est.source, from_estimate=True)


def route_config(
    profile: Profile, threshold: int | None = None, source: str = "", from_estimate: bool = False
):
    """The RouteConfig for the head, from the profile; ``threshold`` overrides both
    serve.disagg.threshold_tokens and the estimate."""
    from linkctl.disagg.route import RouteConfig, Upstream
    from linkctl.serve.plan import read_api_keys

    s, d = profile.serve, profile.serve.disagg
    pre = profile.prefill_host
    head = profile.head
    if threshold is not None:
        t, why = threshold, source if from_estimate else "--threshold"
    elif d.threshold_tokens is not None:
        t, why = d.threshold_tokens, "serve.disagg.threshold_tokens"
    else:
        t, why = 512, source or "default (no estimate)"
    return RouteConfig(
        decode=Upstream("127.0.0.1", d.decode_port),
        decode_slot_dir=kv_dir(),
        prefill=Upstream(pre.ip, d.prefill_port, source=head.ip),
        agent_host=pre.ip,
        agent_port=d.agent_port,
        source=head.ip,
        threshold_tokens=t,
        threshold_source=why,
        slots=d.slots,
        listen_host=str(s.host),
        listen_port=s.port,
        api_keys=read_api_keys(s.api_key_file) if s.api_key_file else [],
    )


# ---- running (serve.mode = "disaggregated") ------------------------------------------


def _say(log, who: str):
    import sys

    from linkctl.serve.supervise import stamp

    def say(msg: str) -> None:
        stream = log or sys.stderr
        stream.write(f"{stamp()} linkctl[{who}] {msg}\n")
        stream.flush()

    return say


def run_prefill(
    plan: DisaggPlan, profile: Profile, host: HostSpec, backend, *, log=None, policy=None
) -> int:
    """The prefill host: kv-agent on the link address, supervised llama-server on the
    link address (ready when /health answers)."""
    import os

    from linkctl.core.records import status_path
    from linkctl.disagg import kvxfer
    from linkctl.serve.plan import check_bind_on_link, http_ok
    from linkctl.serve.supervise import ChildSpec, Supervisor

    check_bind_on_link(host, backend)
    for d in (kv_dir(), models_dir()):
        d.mkdir(parents=True, exist_ok=True)
    # Slot files are per request (route fetches them with delete); any left here are
    # from requests whose transfer failed before a restart.
    for stale in kv_dir().glob("linkctl-*.kv*"):
        stale.unlink(missing_ok=True)
    say = _say(log, "kv-agent")
    agent = kvxfer.Agent(
        host.ip,
        profile.serve.disagg.agent_port,
        {"kv": kv_dir(), "models": models_dir()},
        profile.link.subnet,
        log=say,
        model=prefill_model_path(profile),
        kv_layout=kv_layout(plan.argv),
    ).start()
    say(f"listening on {host.ip}:{agent.port} (peers {profile.link.subnet} only)")
    try:
        model = prefill_model_path(profile)

        def model_here() -> str | None:
            # The agent is up already, so `linkctl model sync` on the head can bring it.
            if os.path.isfile(model):
                return None
            return f"no model at {model}: run `linkctl model sync` on {profile.head.name}"

        spec = ChildSpec(
            "llama-server",
            plan.argv,
            ready=lambda: http_ok(f"{plan.prefill_url}/health", timeout=1.0),
            ready_timeout=300,
            before_start=model_here,
        )
        return Supervisor(spec, policy=policy, log=log, status_path=status_path("prefill")).run()
    finally:
        agent.stop()


def run_decode(
    plan: DisaggPlan,
    profile: Profile,
    model: str,
    *,
    threshold: int | None = None,
    log=None,
    policy=None,
    wait_s: float = 300.0,
) -> int:
    """The head: supervised decode llama-server on 127.0.0.1, and route in front of it
    once both servers answer and match (a mismatch stops serve with exit 2)."""
    import threading

    from linkctl.core.errors import LinkctlError
    from linkctl.core.records import RouteStatus, dump, status_path
    from linkctl.disagg import kvxfer
    from linkctl.disagg import route as rt
    from linkctl.serve.plan import http_ok
    from linkctl.serve.supervise import ChildSpec, Supervisor

    say = _say(log, "route")
    cfg = resolve_route_config(profile, model, threshold)
    cfg.decode_slot_dir.mkdir(parents=True, exist_ok=True)
    spec = ChildSpec(
        "llama-server",
        plan.argv,
        ready=lambda: http_ok(f"{plan.decode_url}/health", timeout=1.0),
        ready_timeout=300,
    )
    sup = Supervisor(spec, policy=policy, log=log, status_path=status_path("head"))
    failed: list[LinkctlError] = []
    servers: list[rt.RouteServer] = []
    route_status = status_path("route")
    route_status.unlink(missing_ok=True)

    def start_route() -> None:
        try:
            local = {**kvxfer.fingerprint(model), "kv_layout": kv_layout(plan.argv)}
            remote = kvxfer.remote_model(cfg.agent_host or "", cfg.agent_port, source=cfg.source)
            rt.check_pair(cfg, (local, remote), wait_s=wait_s, say=say)
            servers.append(rt.RouteServer(rt.Router(cfg, log=log)).start())
        except LinkctlError as e:
            say(f"route not started: {e.line()}")
            failed.append(e)
            sup.request_stop()
            return
        except rt.UpstreamError as e:
            say(f"route not started: {e}")
            failed.append(LinkctlError(str(e)))
            sup.request_stop()
            return
        st = RouteStatus(
            listen=f"{cfg.listen_host}:{cfg.listen_port}",
            threshold_tokens=cfg.threshold_tokens,
            threshold_source=cfg.threshold_source,
        )
        write_atomic(route_status, dump(st, exclude_unset=False))
        say(
            f"listening on {cfg.listen_host}:{cfg.listen_port}; disaggregating prompts of "
            f"{cfg.threshold_tokens}+ tokens ({cfg.threshold_source})"
        )

    threading.Thread(target=start_route, daemon=True).start()
    try:
        rc = sup.run()
    finally:
        for s in servers:
            s.stop()
        route_status.unlink(missing_ok=True)
    if failed:
        raise failed[0]
    return rc


# ---- doctor (serve.mode = "disaggregated") -------------------------------------------


def doctor_checks(
    res, profile: Profile, host: HostSpec, answered: dict[str, bool], timeout_s: float
) -> None:
    """The extra preconditions of disaggregated serving, as doctor lines: the model on
    this host, the slot directory, and from the head the kv-agent's model (same file?)
    and the two servers' /props (same build, context, slots, template)."""
    import os

    from linkctl.core.errors import InputError
    from linkctl.disagg import kvxfer
    from linkctl.disagg import route as rt

    pre = profile.prefill_host
    if host.role == "head":
        model = profile.serve.model
        where = "serve.model"
    elif host.name == pre.name:
        model = prefill_model_path(profile)
        where = "serve.disagg.prefill_model"
    else:
        res.add("disagg role", "PASS", "none", f"{host.name} is not the prefill host ({pre.name})")
        return
    if model and os.path.isfile(model):
        res.add(
            "disagg model",
            "PASS",
            model,
            f"{where} {model} is here ({os.path.getsize(model)} bytes)",
        )
    else:
        fix = "linkctl model sync (on the head)" if host.role != "head" else "set serve.model"
        res.add(
            "disagg model",
            "FAIL",
            model or None,
            f"{where} {model!r} is not a file on {host.name}",
            fix,
        )
    d = kv_dir()
    parent = next((p for p in (d, *d.parents) if p.exists()), None)
    if parent is not None and os.access(parent, os.W_OK):
        res.add("slot directory", "PASS", str(d), f"slot files go to {d} (--slot-save-path)")
    else:
        res.add(
            "slot directory",
            "FAIL",
            str(d),
            f"{d} cannot be created here",
            "check LINKCTL_STATE_DIR",
        )
    if host.role != "head":
        return
    if not answered.get(pre.name):
        res.add("kv-agent", "SKIP", None, f"peer {pre.name} did not answer ARP")
        return
    port = profile.serve.disagg.agent_port
    try:
        theirs = kvxfer.remote_model(pre.ip, port, source=host.ip, timeout=timeout_s)
    except InputError as e:
        res.add(
            "kv-agent",
            "SKIP",
            None,
            f"{pre.ip}:{port}: {e.message} (start `linkctl serve` on {pre.name})",
        )
        return
    mine = kvxfer.fingerprint(model) if model else {}
    if theirs.get("size") and (theirs.get("size"), theirs.get("sha256")) == (
        mine.get("size"),
        mine.get("sha256"),
    ):
        res.add(
            "kv-agent",
            "PASS",
            theirs.get("path"),
            f"{pre.name} serves the same model file ({theirs.get('path')})",
        )
    else:
        res.add(
            "kv-agent",
            "FAIL",
            theirs.get("path"),
            f"{pre.name}'s model {theirs.get('path')} ({theirs.get('size')} bytes) is not this "
            f"host's {model} ({mine.get('size')} bytes)",
            "linkctl model sync",
        )
    try:
        cfg = route_config(profile)
    except InputError as e:
        res.add("servers match", "SKIP", None, f"no API key to ask with: {e.message}")
        return
    try:
        own = cfg.own_headers()
        theirs_p = (
            cfg.prefill.call("GET", "/props", headers=own, timeout=timeout_s) if cfg.prefill else {}
        )
        mine_p = cfg.decode.call("GET", "/props", headers=own, timeout=timeout_s)
    except rt.UpstreamError as e:
        res.add("servers match", "SKIP", None, f"not both servers answer yet: {e}")
        return
    diffs = rt.compare_servers(mine_p, theirs_p)
    diffs += rt.compare_kv_layout(
        kv_layout(list(profile.serve.extra_args)), theirs.get("kv_layout")
    )
    if diffs:
        res.add(
            "servers match",
            "FAIL",
            None,
            "; ".join(diffs),
            "run one llama.cpp build and profile on both",
        )
    else:
        res.add(
            "servers match",
            "PASS",
            mine_p.get("build_info"),
            "decode and prefill servers: same build, n_ctx, slots, template, KV cache flags",
        )
