"""Running serve.mode = "disaggregated": the prefill host's kv-agent and llama-server,
the head's decode llama-server with route in front of it, each supervised."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from dataclasses import asdict
from typing import IO, TYPE_CHECKING

from linkctl.core.errors import LinkctlError
from linkctl.core.log import speaker
from linkctl.core.paths import make_dirs, private_dir, write_atomic
from linkctl.core.profile import HostSpec, Profile
from linkctl.core.records import RouteStatus, dump, status_path
from linkctl.disagg.plan import (
    DisaggPlan,
    kv_dir,
    models_dir,
    prefill_key_path,
    prefill_model_path,
    resolve_route_config,
)
from linkctl.disagg.router import RestoreHealth, prefill_api_key
from linkctl.serve.run import llama_server_child
from linkctl.serve.supervise import Policy, Supervisor
from linkctl.trust.secret import load

if TYPE_CHECKING:
    from linkctl.disagg.kvagent import Agent
    from linkctl.disagg.route import RouteServer
    from linkctl.llama.invocation import KvLayout
    from linkctl.net.backend import Backend


def listening_child(sup: Supervisor, address: str, port: int) -> str | None:
    """None when ``address:port`` is held by the server ``sup`` runs now; else why not
    (stopped, restarting, or another process took the port meanwhile)."""
    import psutil

    proc = sup.proc
    if proc is None or proc.poll() is not None:
        return "the prefill llama-server is not running (restarting, or stopped)"
    try:
        conns = psutil.Process(proc.pid).net_connections(kind="tcp")
    except psutil.Error as e:
        return f"cannot read the prefill server's sockets: {e}"
    if any(
        c.status == psutil.CONN_LISTEN and c.laddr.port == port and c.laddr.ip == address
        for c in conns
    ):
        return None
    return f"{address}:{port} is not held by the llama-server serve started (pid {proc.pid})"


def start_agent(
    profile: Profile,
    host: HostSpec,
    kv: KvLayout,
    log: IO[str] | None = None,
    server_check: Callable[[], str | None] | None = None,
) -> Agent:
    """The kv-agent on this host's link address, serving the kv and models areas, and
    telling the head the model and KV layout this host's llama-server runs (``kv``)."""
    from linkctl.disagg import kvagent

    private_dir(kv_dir())
    make_dirs(models_dir())
    say = speaker("kv-agent", log)
    agent = kvagent.Agent(
        host.ip,
        profile.serve.disagg.agent_port,
        {"kv": kv_dir(), "models": models_dir()},
        profile.link.subnet,
        load(profile.name),
        log=say,
        model=prefill_model_path(profile),
        kv=kv,
        server_check=server_check,
    ).start()
    say(f"listening on {host.ip}:{agent.port} (peers {profile.link.subnet} only)")
    return agent


def run_prefill(
    plan: DisaggPlan,
    profile: Profile,
    host: HostSpec,
    backend: Backend,
    *,
    log: IO[str] | None = None,
    policy: Policy | None = None,
) -> int:
    """The prefill host: kv-agent on the link address, supervised llama-server on the
    link address (ready when /health answers)."""
    from linkctl.serve.run import check_bind_on_link

    check_bind_on_link(host, backend)
    # Slot files are per request (route fetches them with delete); any left here are
    # from requests whose transfer failed before a restart.
    for stale in kv_dir().glob("linkctl-*.kv*"):
        stale.unlink(missing_ok=True)
    model = plan.prefill.model

    def model_here() -> str | None:
        # The agent is up already, so `linkctl model sync` on the head can bring it.
        if os.path.isfile(model):
            return None
        return f"no model at {model}: run `linkctl model sync` on {profile.head.name}"

    # The prefill server's key, from the pair secret; written by this serve, so readable
    # by the unit's own user whatever it is, and by no other.
    write_atomic(prefill_key_path(), prefill_api_key(load(profile.name)) + "\n", mode=0o600)
    spec = llama_server_child(plan.prefill, before_start=model_here)
    sup = Supervisor(spec, policy=policy, log=log, status_path=status_path("prefill"))
    inv = plan.prefill
    agent = start_agent(
        profile, host, inv.kv, log, lambda: listening_child(sup, inv.host, inv.port)
    )
    try:
        return sup.run()
    finally:
        agent.stop()


def run_decode(
    plan: DisaggPlan,
    profile: Profile,
    *,
    threshold: int | None = None,
    log: IO[str] | None = None,
    policy: Policy | None = None,
    wait_s: float = 300.0,
) -> int:
    """The head: supervised decode llama-server on 127.0.0.1, and route in front of it
    once both servers answer and match (a mismatch stops serve with exit 2)."""
    from linkctl.disagg import kvxfer
    from linkctl.disagg import route as rt
    from linkctl.disagg.fingerprint import fingerprint
    from linkctl.disagg.pair import check_pair

    say = speaker("route", log)
    model = plan.decode.model
    cfg = resolve_route_config(profile, model, threshold)
    private_dir(cfg.decode_slot_dir)
    spec = llama_server_child(plan.decode)
    sup = Supervisor(spec, policy=policy, log=log, status_path=status_path("head"))
    failed: list[LinkctlError] = []
    servers: list[RouteServer] = []
    route_status = status_path("route")
    route_status.unlink(missing_ok=True)

    st = RouteStatus(
        listen=f"{cfg.listen_host}:{cfg.listen_port}",
        threshold_tokens=cfg.threshold_tokens,
        threshold_source=cfg.threshold_source,
    )
    lock = threading.Lock()

    def restores_seen(health: dict[str, RestoreHealth]) -> None:
        """`linkctl status` shows how restores go, and a model route stopped moving."""
        with lock:
            st.restores = {m: asdict(h) for m, h in health.items()}
            write_atomic(route_status, dump(st, exclude_unset=False))

    def start_route() -> None:
        try:
            local = fingerprint(model, plan.decode.kv)
            remote = kvxfer.remote_model(
                cfg.agent_host or "", cfg.agent_port, secret=cfg.secret, source=cfg.source
            )
            check_pair(cfg, (local, remote), wait_s=wait_s, say=say)
            router = rt.Router(cfg, log=log, on_restores=restores_seen)
            servers.append(rt.RouteServer(router).start())
        except LinkctlError as e:
            say(f"route not started: {e.line()}")
            failed.append(e)
            sup.request_stop()
            return
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
