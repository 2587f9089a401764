"""Running this host's half of the pair, supervised, behind its gates.

rpc host : bind check (link address only) -> supervised rpc-server,
           ready when HELLO answers
head     : probe-report gate -> HELLO every rpc endpoint, protocol
           version against the local build -> supervised llama-server,
           ready when /health answers 200; restarted when it loses an
           rpc endpoint (llama-server cannot reconnect by itself)
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from linkctl.core.errors import CheckFailed, InputError, RpcProtocolMismatch
from linkctl.core.log import Say, speaker
from linkctl.core.profile import HostSpec, Profile
from linkctl.core.wait import until_answered
from linkctl.llama.bins import LlamaBins, compatible, local_rpc_protocol
from linkctl.llama.client import LlamaServer
from linkctl.llama.invocation import ServerInvocation
from linkctl.llama.rpc import RpcInfo
from linkctl.serve.leftends import LeftEnds
from linkctl.serve.plan import ServePlan, check_bind_spec
from linkctl.serve.split import SplitChoice
from linkctl.serve.supervise import ChildSpec, Policy, Supervisor

if TYPE_CHECKING:
    from collections.abc import Callable

    from linkctl.net.backend import Backend
    from linkctl.probe.report import ProbeReport

    # Probe one peer again and save the report: (the report, where it was saved).
    Reprobe = Callable[[HostSpec], tuple[ProbeReport, Path]]


PROBE_MAX_AGE_S = 24 * 3600


def check_bind_on_link(host: HostSpec, backend: Backend) -> None:
    """The bind address must be configured on the link interface right now."""
    facts = backend.link_facts(host.interface)
    have = [a.split("/")[0] for a in facts.addresses]
    if host.rpc_bind not in have:
        raise InputError(
            f"rpc bind address {host.rpc_bind} is not on link interface {host.interface} "
            f"(it has: {', '.join(facts.addresses) or 'no address'}); rpc-server binds only "
            "to the link address",
            "run `linkctl setup` first",
        )
    if not facts.up:
        raise InputError(f"link interface {host.interface} is down", "run `linkctl setup` first")


def probe_gate(
    profile: Profile,
    head: HostSpec,
    max_age_s: float = PROBE_MAX_AGE_S,
    now: float | None = None,
    directory: Path | None = None,
    reprobe: Reprobe | None = None,
) -> list[str]:
    """Every rpc host needs a passing probe report for this profile, newer than
    ``max_age_s``. A report that has only aged is probed again with ``reprobe`` when
    given (a serve restarted a day after its probe must come back, not refuse), and the
    fresh report decides. Returns one summary line per rpc host; raises CheckFailed
    naming why."""
    from linkctl.core.records import latest_probe, probe_dir

    now = now or time.time()
    where = directory or probe_dir()
    lines = []
    for peer in profile.rpc_hosts:
        found = latest_probe(profile.name, peer.name, peer.ip, directory)
        if found is None:
            raise CheckFailed(
                f"no probe report for profile {profile.name!r} and peer {peer.name} in {where}",
                "run `sudo linkctl probe` first (or pass --skip-probe to serve anyway)",
            )
        t, path, r = found
        age = now - t
        if not r.ok:
            failed = r.failed
            raise CheckFailed(
                f"latest probe report {path} for peer {peer.name} failed"
                + (f" ({', '.join(failed)})" if failed else ""),
                "fix the link and rerun `sudo linkctl probe` (or --skip-probe)",
            )
        if age <= max_age_s:
            lines.append(f"probe report {path.name} for {peer.name}: ok, {age:.0f} s old")
            continue
        old = f"latest probe report {path} for peer {peer.name} is {age / 3600:.1f} h old"
        if reprobe is None:
            raise CheckFailed(
                f"{old} (limit {max_age_s / 3600:g} h)",
                "rerun `sudo linkctl probe` (serve run as root probes again by itself; "
                "or --skip-probe)",
            )
        fresh, fresh_path = reprobe(peer)
        if not fresh.ok:
            raise CheckFailed(
                f"{old}, and probing it again failed: {fresh.why_not()}",
                f"fix the link (see {fresh_path}) and start serve again",
            )
        lines.append(f"{old}: probed again, ok ({fresh_path.name})")
    return lines


def _fmt(v: tuple[int, int, int] | None) -> str:
    return ".".join(map(str, v)) if v else "unknown"


def check_endpoints(
    profile: Profile, local: tuple[int, int, int] | None, build: str, timeout: float = 3.0
) -> dict[str, RpcInfo]:
    """HELLO every rpc endpoint ({rpc host name: what it answered}, in --rpc order);
    refuse a protocol mismatch with the local build.
    Raises RpcError subclasses (busy, no HELLO), ConnectionRefused / Timeout (nothing
    listens, no answer) and RpcProtocolMismatch."""
    from linkctl.llama import rpc

    out = {}
    for h in profile.rpc_hosts:
        info = rpc.query(h.rpc_bind, h.rpc.port, timeout=timeout)
        if local is not None and not compatible(local, info.version):
            raise RpcProtocolMismatch(
                f"rpc endpoint {h.name} ({h.rpc_endpoint}) speaks RPC protocol {info.version_str} "
                f"({info.hello_format} HELLO), this head's build speaks {_fmt(local)} ({build}): "
                "llama-server would refuse it",
                f"build the same llama.cpp release on {h.name} and here (scripts/build-llama.sh)",
                local=local,
                remote=info.version,
            )
        out[h.name] = info
    return out


def rpc_connections_lost(pid: int, endpoints: list[str], left: LeftEnds) -> str | None:
    """None while ``pid`` holds an ESTABLISHED TCP connection to every endpoint; each
    such connection's local end is kept in ``left``."""
    import psutil

    try:
        conns = psutil.Process(pid).net_connections(kind="tcp")
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return None  # exit is noticed by the supervisor itself
    states: dict[str, str] = {}
    for c in conns:
        if c.raddr:
            key = f"{c.raddr.ip}:{c.raddr.port}"
            if c.status == "ESTABLISHED" and key in endpoints:
                left.seen(f"{c.laddr.ip}:{c.laddr.port}", key)
            if states.get(key) != "ESTABLISHED":
                states[key] = c.status
    lost = [
        f"{e} ({states.get(e, 'no connection')})"
        for e in endpoints
        if states.get(e) != "ESTABLISHED"
    ]
    return f"lost rpc endpoint {', '.join(lost)}" if lost else None


def run_rpc(
    plan: ServePlan,
    profile: Profile,
    host: HostSpec,
    backend: Backend,
    *,
    log: IO[str] | None = None,
    policy: Policy | None = None,
) -> int:
    from linkctl.core.records import status_path
    from linkctl.llama import rpc

    check_bind_spec(host)
    check_bind_on_link(host, backend)
    port = host.rpc.port

    def ready() -> bool:
        try:
            rpc.hello(host.rpc_bind, port, timeout=1.0)
            return True
        except InputError:
            return False

    spec = ChildSpec("rpc-server", plan.invocation.argv(), ready=ready, ready_timeout=60)
    sup = Supervisor(spec, policy=policy, log=log, status_path=status_path("rpc"))
    if not profile.serve.watch_interval_s:
        return sup.run()
    from linkctl.serve.guard import RpcGuard, publisher, watch_config
    from linkctl.serve.sampling import Sampler
    from linkctl.serve.watch import Watch

    sampler = Sampler(
        backend,
        host.interface,
        peers=[profile.head.ip],
        ends=[f"{host.rpc_bind}:{port}"],
        child=lambda: sup.status.child_pid,
    )
    pub = publisher(sup.set_watch, profile.serve.metrics_textfile, (profile.name, host.name, "rpc"))
    watch = Watch(watch_config(profile, host, backend), sampler, on_record=pub)
    guard = RpcGuard(watch)
    spec.healthy, spec.on_ready = guard.healthy, guard.on_ready
    spec.health_interval = 0.5
    watch.start()
    try:
        return sup.run()
    finally:
        watch.stop()


def check_freeing(
    profile: Profile,
    local: tuple[int, int, int] | None,
    build: str,
    left: LeftEnds,
    say: Say,
    timeout: float = 3.0,
) -> dict[str, RpcInfo]:
    """check_endpoints; an endpoint still held by a connection an earlier llama-server
    left (an outage longer than its FIN) is freed first, then checked again."""
    try:
        return check_endpoints(profile, local, build, timeout=timeout)
    except InputError as e:
        sent = left.reset(e)
        if not sent:
            raise
        if left.news(sent):
            say(f"{e.message}; reset what llama-server left there ({', '.join(sent)})")
    return check_endpoints(profile, local, build, timeout=timeout)


def wait_endpoints(
    profile: Profile,
    local: tuple[int, int, int] | None,
    build: str,
    *,
    wait_s: float,
    say: Say,
    left: LeftEnds | None = None,
) -> dict[str, RpcInfo]:
    """First contact: wait up to ``wait_s`` for every endpoint (an rpc host may still be
    starting), but refuse at once what can never work (another protocol, no HELLO).
    With ``left``, an endpoint held by what an earlier llama-server left is freed (an
    attempt that frees one takes up to two checks and a SYN's wait per end, so the
    last one can end that much past ``wait_s``)."""
    from linkctl.llama import rpc

    ends = left or LeftEnds()  # one for every attempt: what a SYN freed is not tried again
    return until_answered(
        lambda: check_freeing(profile, local, build, ends, say),
        within=wait_s,
        what="rpc endpoints",
        say=say,
        retry_on=InputError,
        never_retry=(rpc.RpcNoHello, RpcProtocolMismatch),
    )


def _kept_ends(path: Path, endpoints: list[str]) -> dict[str, list[str]]:
    """The ends the last serve of this head recorded for these endpoints (none when
    there is no readable status)."""
    from linkctl.core.records import load_status

    try:
        kept = load_status(path).rpc_ends
    except InputError:
        return {}
    return {e: ends for e, ends in kept.items() if e in endpoints}


def keep_ends(sup: Supervisor, left: LeftEnds) -> None:
    """The supervisor's status carries the ends from its first write on."""
    sup.status.rpc_ends = left.ends()
    left.on_change = sup.set_rpc_ends


def run_head(
    plan: ServePlan,
    profile: Profile,
    bins: LlamaBins,
    *,
    log: IO[str] | None = None,
    wait_s: float = 60.0,
    policy: Policy | None = None,
    split: SplitChoice | None = None,
    backend: Backend | None = None,
) -> int:
    """The head's llama-server, supervised; under the watch (serve.watch_interval_s)
    when ``backend`` is given to read the link with."""
    from linkctl.core.records import status_path

    local = None
    if bins.rpc_server:
        local = local_rpc_protocol(bins)
    build = bins.build()
    say = speaker("serve", log)

    if local is None:
        say(
            "warning: no local rpc-server binary, so the local RPC protocol version is unknown; "
            "endpoint versions are reported but not compared"
        )
    else:
        say(f"local build speaks RPC protocol {_fmt(local)} ({build})")
    if split is not None:
        say(split.summary())
        for note in split.notes:
            say(f"split note: {note}")

    left = LeftEnds(_kept_ends(status_path("head"), plan.endpoints))
    infos = wait_endpoints(profile, local, build, wait_s=wait_s, say=say, left=left)
    for name, i in infos.items():
        mem = ", ".join(f"{d.free / 2**20:.0f}/{d.total / 2**20:.0f} MiB free" for d in i.devices)
        say(
            f"rpc endpoint {name} {i.host}:{i.port}: "
            f"protocol {i.version_str} ({i.hello_format} HELLO), devices: {mem or 'none'}"
        )

    def before_start() -> str | None:
        try:
            check_freeing(profile, local, build, left, say, timeout=2.0)
            return None
        except InputError as e:
            return e.message

    if not profile.serve.watch_interval_s or backend is None:
        spec = llama_server_child(
            plan.head,
            healthy=lambda pid: rpc_connections_lost(pid, plan.endpoints, left),
            health_interval=0.5,
            before_start=before_start,
        )
        sup = Supervisor(spec, policy=policy, log=log, status_path=status_path("head"))
        keep_ends(sup, left)
        return sup.run()
    return _run_head_watched(plan, profile, backend, before_start, left, say, log, policy, split)


def _run_head_watched(
    plan: ServePlan,
    profile: Profile,
    backend: Backend,
    endpoints_answer: Callable[[], str | None],
    left: LeftEnds,
    say: Say,
    log: IO[str] | None,
    policy: Policy | None,
    split: SplitChoice | None,
) -> int:
    """llama-server under the watch and serve.on_fail (linkctl.serve.guard)."""
    from linkctl.core.records import status_path
    from linkctl.serve.auth import own_headers
    from linkctl.serve.canary import fingerprint_for
    from linkctl.serve.guard import HeadGuard, fallback_invocation, publisher, watch_config
    from linkctl.serve.sampling import Sampler

    split_inv = plan.head.changed(metrics=True)
    server = LlamaServer.serving(split_inv, headers=own_headers(profile), timeout=60)
    try:
        fingerprint = fingerprint_for(profile.name, split_inv.model)
    except InputError as e:
        fingerprint = None
        say(f"canary off: {e.message} ({e.fix})")
    alone = fallback_invocation(profile, split_inv)
    if profile.serve.on_fail == "fallback":
        say(f"on_fail = fallback: {alone[1]}")
    cfg = watch_config(profile, profile.head, backend)
    # Decode against the estimate; prefill always against what this serve measures:
    # its rate follows the prompts users send (a short prompt pays the fixed costs).
    if split is not None and split.predicted_decode_tok_s:
        cfg.refs["decode"] = (split.predicted_decode_tok_s, "estimate")
    sampler = Sampler(
        backend,
        profile.head.interface,
        peers=[h.ip for h in profile.rpc_hosts],
        ends=plan.endpoints,
        server=server,
        metrics_timeout_s=min(2.0, cfg.interval_s / 2),
    )
    holder: list[Supervisor] = []
    labels = (profile.name, profile.head.name, "head")
    guard = HeadGuard(
        profile,
        cfg,
        sampler,
        server,
        endpoints_answer,
        alone,
        fingerprint,
        say,
        publisher(lambda r: holder[0].set_watch(r), profile.serve.metrics_textfile, labels),
    )

    def split_healthy(pid: int) -> str | None:
        lost = rpc_connections_lost(pid, plan.endpoints, left)
        return guard.endpoint_lost(lost) if lost else guard.healthy(pid)

    split_spec = llama_server_child(
        split_inv,
        healthy=split_healthy,
        health_interval=0.5,
        before_start=guard.before_start,
        on_ready=guard.on_ready,
        on_exit=guard.on_exit,
    )
    alone_spec = (
        llama_server_child(
            alone[0], healthy=guard.healthy, health_interval=0.5, on_ready=guard.on_ready
        )
        if alone[0] is not None
        else split_spec
    )
    sup = Supervisor(
        split_spec,
        policy=policy,
        log=log,
        status_path=status_path("head"),
        choose=lambda: alone_spec if guard.choose_alone() else split_spec,
    )
    holder.append(sup)
    keep_ends(sup, left)
    guard.watch.start()
    try:
        return sup.run()
    finally:
        guard.watch.stop()


def port_held(host: str, port: int) -> str | None:
    """Why ``host:port`` cannot be ours: another process listens there (an orphan
    server a killed supervisor left, or anything else), else None."""
    import errno
    import socket

    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # TIME_WAIT is not "held"
        try:
            s.bind((host, port))
        except OSError as e:
            if e.errno != errno.EADDRINUSE:
                return None  # not ours to judge (the address comes and goes): start says
            return (
                f"{host}:{port} is held by another process (not started by this serve): "
                f"stop it (ss -ltnp 'sport = :{port}')"
            )
    return None


def llama_server_child(
    inv: ServerInvocation, before_start: Callable[[], str | None] | None = None, **more: Any
) -> ChildSpec:
    """A supervised llama-server, ready once /health answers 200 (the model loaded:
    up to 300 s for a large one). Before every start its port must be free: a server
    this supervisor did not start never answers for it."""
    server = LlamaServer.serving(inv)

    def can_start() -> str | None:
        return port_held(inv.host, inv.port) or (before_start() if before_start else None)

    return ChildSpec(
        "llama-server",
        inv.argv(),
        ready=lambda: server.healthy(timeout=1.0),
        ready_timeout=300,
        before_start=can_start,
        **more,
    )


def model_path_check(model: str | None) -> str:
    if not model:
        raise InputError("no model: serve.model is empty", "set serve.model or pass --model PATH")
    if not os.path.isfile(model):
        raise InputError(f"model {model} does not exist", "set serve.model or pass --model PATH")
    return model
