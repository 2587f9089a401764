"""Serve plan and run: rpc-server on rpc hosts, llama-server on the head.

    profile + host + binaries -> ServePlan (argv lines, endpoints, checks)
      rpc host : bind check (link address only) -> supervised rpc-server,
                 ready when HELLO answers
      head     : probe-report gate -> HELLO every rpc endpoint, protocol
                 version against the local build -> supervised llama-server,
                 ready when /health answers 200; restarted when it loses an
                 rpc endpoint (llama-server cannot reconnect by itself)

rpc-server has no authentication: it binds only to this host's link address,
and only when that address is really on the link interface.
"""

from __future__ import annotations

import json
import os
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import IO, Any

from linkctl.errors import CheckFailed, InputError
from linkctl.llama import LlamaBins, compatible, local_rpc_protocol
from linkctl.paths import state_dir
from linkctl.profile import HostSpec, Profile

PROBE_MAX_AGE_S = 24 * 3600


@dataclass
class ServePlan:
    profile: str
    host: str
    role: str  # "rpc" or "head"
    argv: list[str]  # what this host runs
    rpc_argv: dict[str, list[str]]  # rpc host name -> its rpc-server argv
    head_argv: list[str]
    endpoints: list[str]  # rpc endpoints, host:port, in --rpc order
    bind: str | None = None  # this host's rpc bind address (rpc role)
    health_url: str | None = None  # head only
    model: str | None = None
    notes: list[str] = field(default_factory=list)
    bins: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _bin_for(host: HostSpec, local: HostSpec, bins: LlamaBins, role: str) -> str:
    """The binary path for ``host``: the found one for this host, else the profile's
    llama_bin_dir or the plain name (resolved on that host)."""
    found = bins.rpc_server if role == "rpc-server" else bins.llama_server
    if host.name == local.name and found:
        return found.path
    name = "ggml-rpc-server" if role == "rpc-server" else "llama-server"
    return str(Path(host.llama_bin_dir) / name) if host.llama_bin_dir else name


def rpc_argv(host: HostSpec, binary: str) -> list[str]:
    check_bind_spec(host)
    r = host.rpc
    argv = [binary, "-H", host.rpc_bind, "-p", str(r.port)]
    if r.threads:
        argv += ["-t", str(r.threads)]
    if r.device:
        argv += ["-d", r.device]
    if r.cache:
        argv += ["-c"]
    return argv + list(r.extra_args)


def check_bind_spec(host: HostSpec) -> None:
    """The profile's bind must be this host's own link address (never a wildcard)."""
    import ipaddress

    bind = ipaddress.IPv4Address(host.rpc_bind)
    if bind.is_unspecified or bind != host.address.ip:
        what = "a wildcard" if bind.is_unspecified else f"not {host.name}'s link address {host.ip}"
        raise InputError(
            f"hosts.{host.name}.rpc.bind = {bind} is {what}; rpc-server has no authentication",
            f"remove rpc.bind (defaults to {host.ip}) or set it to {host.ip}",
        )


def head_argv(profile: Profile, binary: str, model: str) -> list[str]:
    s = profile.serve
    endpoints = [h.rpc_endpoint for h in profile.rpc_hosts]
    argv = [
        binary,
        "-m",
        model,
        "--rpc",
        ",".join(endpoints),
        "-ngl",
        str(s.ngl),
        "-c",
        str(s.ctx),
        "--host",
        str(s.host),
        "--port",
        str(s.port),
    ]
    if s.tensor_split:
        # llama.cpp orders devices RPC servers first (in --rpc order), then local ones.
        by_name = {h.name: w for h, w in zip(profile.hosts, s.tensor_split, strict=True)}
        weights = [by_name[h.name] for h in profile.rpc_hosts] + [by_name[profile.head.name]]
        argv += ["-ts", ",".join(f"{w:g}" for w in weights)]
    if s.threads:
        argv += ["-t", str(s.threads)]
    return argv + list(s.extra_args)


def build_plan(
    profile: Profile, host: HostSpec, bins: LlamaBins, model: str | None = None
) -> ServePlan:
    """Both argv lines, for this host's role; no side effects."""
    model = model or profile.serve.model
    notes = []
    if not model:
        notes.append("serve.model is empty: set it in the profile or pass --model")
    rpc_lines = {
        h.name: rpc_argv(h, _bin_for(h, host, bins, "rpc-server")) for h in profile.rpc_hosts
    }
    head = head_argv(profile, _bin_for(profile.head, host, bins, "llama-server"), model or "MODEL")
    if profile.serve.host.is_unspecified:
        notes.append(f"llama-server listens on {profile.serve.host}: every interface")
    for role_bin, b in (("rpc-server", bins.rpc_server), ("llama-server", bins.llama_server)):
        if b is None:
            notes.append(f"{role_bin} not found on this host (searched: {', '.join(bins.tried)})")
    serve_host = "127.0.0.1" if profile.serve.host.is_unspecified else str(profile.serve.host)
    return ServePlan(
        profile=profile.name,
        host=host.name,
        role=host.role,
        argv=rpc_lines[host.name] if host.role == "rpc" else head,
        rpc_argv=rpc_lines,
        head_argv=head,
        endpoints=[h.rpc_endpoint for h in profile.rpc_hosts],
        bind=host.rpc_bind if host.role == "rpc" else None,
        health_url=f"http://{serve_host}:{profile.serve.port}/health"
        if host.role == "head"
        else None,
        model=model or None,
        notes=notes,
        bins=bins.as_dict(),
    )


# ---- checks ------------------------------------------------------------------


def check_bind_on_link(host: HostSpec, backend) -> None:
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


def _parse_time(v: Any) -> float | None:
    if isinstance(v, int | float):
        return float(v)
    if isinstance(v, str):
        try:
            dt = datetime.fromisoformat(v.replace("Z", "+00:00"))
        except ValueError:
            return None
        if dt.tzinfo is None:
            dt = dt.replace(tzinfo=UTC)
        return dt.timestamp()
    return None


def probe_reports(directory: Path | None = None) -> list[tuple[Path, dict[str, Any]]]:
    d = directory or state_dir() / "probe"
    out = []
    if d.is_dir():
        for p in sorted(d.glob("*.json")):
            try:
                data = json.loads(p.read_text())
            except (OSError, ValueError):
                continue
            if isinstance(data, dict):
                out.append((p, data))
    return out


def probe_gate(
    profile: Profile,
    head: HostSpec,
    max_age_s: float = PROBE_MAX_AGE_S,
    now: float | None = None,
    directory: Path | None = None,
) -> list[str]:
    """Every rpc host needs a passing probe report for this profile, newer than
    ``max_age_s``. Returns one summary line per rpc host; raises CheckFailed naming why."""
    now = now or time.time()
    where = directory or state_dir() / "probe"
    reports = probe_reports(directory)
    lines = []
    for peer in profile.rpc_hosts:
        mine = []
        for path, r in reports:
            if r.get("profile") != profile.name:
                continue
            if r.get("peer") not in (None, peer.name) and r.get("peer_address") not in (peer.ip,):
                continue
            t = _parse_time(r.get("time"))
            if t is not None:
                mine.append((t, path, r))
        if not mine:
            raise CheckFailed(
                f"no probe report for profile {profile.name!r} and peer {peer.name} in {where}",
                "run `linkctl probe` first (or pass --skip-probe to serve anyway)",
            )
        t, path, r = max(mine, key=lambda x: x[0])
        age = now - t
        if not r.get("ok"):
            failed = [c.get("name", "?") for c in r.get("checks", []) if c.get("verdict") == "FAIL"]
            raise CheckFailed(
                f"latest probe report {path} for peer {peer.name} failed"
                + (f" ({', '.join(failed)})" if failed else ""),
                "fix the link and rerun `linkctl probe` (or --skip-probe)",
            )
        if age > max_age_s:
            raise CheckFailed(
                f"latest probe report {path} for peer {peer.name} is {age / 3600:.1f} h old "
                f"(limit {max_age_s / 3600:g} h)",
                "rerun `linkctl probe` (or --skip-probe)",
            )
        lines.append(f"probe report {path.name} for {peer.name}: ok, {age:.0f} s old")
    return lines


def _fmt(v: tuple[int, int, int] | None) -> str:
    return ".".join(map(str, v)) if v else "unknown"


def check_endpoints(
    profile: Profile, local: tuple[int, int, int] | None, build: str, timeout: float = 3.0
) -> list[dict[str, Any]]:
    """HELLO every rpc endpoint; refuse a protocol mismatch with the local build.
    Raises RpcError subclasses (busy, no HELLO, refused) and InputError on mismatch."""
    from linkctl import rpc

    out = []
    for h in profile.rpc_hosts:
        info = rpc.query(h.rpc_bind, h.rpc.port, timeout=timeout)
        if local is not None and not compatible(local, info.version):
            raise InputError(
                f"rpc endpoint {h.name} ({h.rpc_endpoint}) speaks RPC protocol {info.version_str} "
                f"({info.hello_format} HELLO), this head's build speaks {_fmt(local)} ({build}): "
                "llama-server would refuse it",
                f"build the same llama.cpp release on {h.name} and here (scripts/build-llama.sh)",
            )
        out.append({"name": h.name, **info.as_dict()})
    return out


# ---- running -----------------------------------------------------------------


def http_ok(url: str, timeout: float = 2.0) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


def rpc_connections_lost(pid: int, endpoints: list[str]) -> str | None:
    """None while ``pid`` holds an ESTABLISHED TCP connection to every endpoint."""
    import psutil

    try:
        conns = psutil.Process(pid).net_connections(kind="tcp")
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return None  # exit is noticed by the supervisor itself
    states: dict[str, str] = {}
    for c in conns:
        if c.raddr:
            key = f"{c.raddr.ip}:{c.raddr.port}"
            if states.get(key) != "ESTABLISHED":
                states[key] = c.status
    lost = [
        f"{e} ({states.get(e, 'no connection')})"
        for e in endpoints
        if states.get(e) != "ESTABLISHED"
    ]
    return f"lost rpc endpoint {', '.join(lost)}" if lost else None


def status_path(role: str) -> Path:
    return state_dir() / "serve" / f"{role}.json"


def run_rpc(
    plan: ServePlan, host: HostSpec, backend, *, log: IO[str] | None = None, policy=None
) -> int:
    from linkctl import rpc
    from linkctl.supervise import ChildSpec, Supervisor

    check_bind_spec(host)
    check_bind_on_link(host, backend)
    port = host.rpc.port

    def ready() -> bool:
        try:
            rpc.hello(host.rpc_bind, port, timeout=1.0)
            return True
        except InputError:
            return False

    spec = ChildSpec("rpc-server", plan.argv, ready=ready, ready_timeout=60)
    sup = Supervisor(spec, policy=policy, log=log, status_path=status_path("rpc"))
    return sup.run()


def run_head(
    plan: ServePlan,
    profile: Profile,
    bins: LlamaBins,
    *,
    log: IO[str] | None = None,
    wait_s: float = 60.0,
    policy=None,
) -> int:
    from linkctl import rpc
    from linkctl.supervise import ChildSpec, Supervisor, stamp

    out = log
    local = None
    if bins.rpc_server:
        local = local_rpc_protocol(bins)
    build = bins.build()

    def say(msg: str) -> None:
        import sys

        stream = out or sys.stderr
        stream.write(f"{stamp()} linkctl[serve] {msg}\n")
        stream.flush()

    if local is None:
        say(
            "warning: no local rpc-server binary, so the local RPC protocol version is unknown; "
            "endpoint versions are reported but not compared"
        )
    else:
        say(f"local build speaks RPC protocol {_fmt(local)} ({build})")

    # First contact: wait for every endpoint (an rpc host may still be starting),
    # but refuse at once what can never work (another protocol, no HELLO).
    deadline = time.monotonic() + wait_s
    last = None
    while True:
        try:
            infos = check_endpoints(profile, local, build)
            break
        except rpc.RpcNoHello:
            raise
        except rpc.RpcError as e:
            if time.monotonic() > deadline:
                raise
            if e.message != last:
                say(f"waiting for rpc endpoints: {e.message}")
                last = e.message
            time.sleep(0.5)
        except InputError as e:
            if "speaks RPC protocol" in e.message or time.monotonic() > deadline:
                raise
            if e.message != last:
                say(f"waiting for rpc endpoints: {e.message}")
                last = e.message
            time.sleep(0.5)
    for i in infos:
        mem = ", ".join(
            f"{d['free'] / 2**20:.0f}/{d['total'] / 2**20:.0f} MiB free" for d in i["devices"]
        )
        say(
            f"rpc endpoint {i['name']} {i['host']}:{i['port']}: "
            f"protocol {i['version']} ({i['hello_format']} HELLO), devices: {mem or 'none'}"
        )

    def before_start() -> str | None:
        try:
            check_endpoints(profile, local, build, timeout=2.0)
            return None
        except InputError as e:
            return e.message

    spec = ChildSpec(
        "llama-server",
        plan.argv,
        ready=lambda: http_ok(plan.health_url or "", timeout=1.0),
        ready_timeout=300,
        healthy=lambda pid: rpc_connections_lost(pid, plan.endpoints),
        health_interval=0.5,
        before_start=before_start,
    )
    sup = Supervisor(spec, policy=policy, log=log, status_path=status_path("head"))
    return sup.run()


def model_path_check(model: str | None) -> str:
    if not model:
        raise InputError("no model: serve.model is empty", "set serve.model or pass --model PATH")
    if not os.path.isfile(model):
        raise InputError(f"model {model} does not exist", "set serve.model or pass --model PATH")
    return model
