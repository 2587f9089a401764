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

import os
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO, Any

from linkctl.core.errors import CheckFailed, InputError, RpcProtocolMismatch
from linkctl.core.profile import HostSpec, Profile
from linkctl.llama.bins import LlamaBins, compatible, local_rpc_protocol

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
    split: dict[str, Any] | None = None  # head only: SplitChoice.as_dict()
    auth: dict[str, Any] | None = None  # head only: ServeAuth.as_dict()

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


def head_argv(
    profile: Profile, binary: str, model: str, split: SplitChoice | None = None
) -> list[str]:
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
    weights = split.tensor_split if split is not None else legacy_tensor_split(profile)
    if weights:
        # llama.cpp orders devices RPC servers first (in --rpc order), then local ones
        # (src/llama.cpp llama_prepare_model_devices). -fit off: llama.cpp's automatic
        # fitting (common/fit.cpp) may rewrite the split and layer count when memory
        # looks short; an explicit -ngl already stops it, off makes it explicit and
        # skips its extra pass over the model.
        argv += ["-ts", ",".join(f"{w:g}" for w in weights), "-fit", "off"]
    if s.threads:
        argv += ["-t", str(s.threads)]
    if s.api_key_file:
        argv += ["--api-key-file", s.api_key_file]
    return argv + list(s.extra_args)


def legacy_tensor_split(profile: Profile) -> list[float] | None:
    """serve.tensor_split (one weight per host, profile order) in llama.cpp device order."""
    s = profile.serve
    if not s.tensor_split:
        return None
    by_name = {h.name: w for h, w in zip(profile.hosts, s.tensor_split, strict=True)}
    return [by_name[h.name] for h in profile.rpc_hosts] + [by_name[profile.head.name]]


@dataclass
class SplitChoice:
    """The layer split the head runs, where it came from, and what it predicts."""

    mode: str  # "recommended", "llama" or "weights"
    source: str  # "--split", "serve.split in the profile", "serve.tensor_split", "default"
    tensor_split: list[float] | None  # -ts weights, llama.cpp order; None: llama.cpp's own
    order: list[str]  # host of each split device, llama.cpp order
    predicted_decode_tok_s: float | None = None
    predicted_prefill_tok_s: float | None = None
    recommendation: str | None = None
    estimate_source: str | None = None  # link figures and calibrations used
    notes: list[str] = field(default_factory=list)

    def summary(self) -> str:
        ts = ",".join(f"{w:g}" for w in self.tensor_split) if self.tensor_split else None
        what = {
            "recommended": f"recommended -ts {ts}",
            "llama": "llama.cpp's default, by free memory, no -ts",
            "weights": f"-ts {ts}",
        }[self.mode]
        line = f"split: {what} (from {self.source}"
        if self.order:
            line += f"; order {', '.join(self.order)}"
        line += ")"
        if self.predicted_decode_tok_s is not None:
            line += (
                f"; predicted decode {self.predicted_decode_tok_s:.1f} tok/s, prefill "
                f"{self.predicted_prefill_tok_s or 0:.0f} tok/s"
            )
            if self.recommendation:
                line += f"; estimate says: {self.recommendation}"
        return line

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def choose_split(
    profile: Profile,
    model: str | None,
    split: str | None = None,
    *,
    calibration: list[Path] | None = None,
) -> SplitChoice:
    """Resolve --split / serve.split into -ts weights, with the estimate's prediction.

    "recommended" needs the estimate (the model header, the saved probe report, the
    calibrations): when serve.split is only the default and the estimate cannot be
    made, serve falls back to llama.cpp's split and says why; asked for explicitly,
    it refuses (exit 2)."""
    from linkctl.core.profile import parse_split_spec

    s = profile.serve
    if split is not None:
        source, text = "--split", split
    elif s.tensor_split:
        source, text = "serve.tensor_split in the profile", None
    elif s.split is not None:
        source, text = "serve.split in the profile", s.split
    else:
        source, text = "default", "recommended"
    if text is None:
        spec: str | list[float] = legacy_tensor_split(profile) or []
    else:
        try:
            spec = parse_split_spec(text)
        except ValueError as e:
            raise InputError(f"{source.split(' in ')[0]} {text!r}: {e}") from None
    order = [h.name for h in profile.rpc_hosts]
    if isinstance(spec, list):
        n_rpc = len(profile.rpc_hosts)
        if len(spec) not in (n_rpc, n_rpc + 1):
            raise InputError(
                f"{source.split(' in ')[0]} {text or spec}: {len(spec)} weights, the split has "
                f"{n_rpc} rpc host(s) ({', '.join(order)}) and maybe the head's GPU",
                f"give {n_rpc} or {n_rpc + 1} weights in llama.cpp order: rpc hosts in --rpc "
                "order, then the head",
            )
        choice = SplitChoice(
            "weights", source, spec, order + [profile.head.name][: len(spec) - n_rpc]
        )
    else:
        choice = SplitChoice(spec, source, None, order)
    try:
        est = _estimate_for(profile, model, choice, calibration)
    except InputError as e:
        if choice.mode != "recommended":
            choice.notes.append(f"no prediction: {e.line()}")
            return choice
        if source != "default":
            raise InputError(
                f"--split recommended needs the estimate: {e.message}",
                e.fix or "run `linkctl probe` and `linkctl calibrate`, or use --split llama",
            ) from None
        choice.mode = "llama"
        choice.notes.append(
            f"recommended split unavailable ({e.line()}): serving llama.cpp's default split"
        )
        return choice
    sc = est.recommended if choice.mode == "recommended" else est.split
    if sc is None:  # no rpc device in the split: cannot happen with a valid profile
        return choice
    order = list(est.model.get("split_order", order))
    if choice.mode == "recommended":
        choice.tensor_split = [float(c) for c in sc.tensor_split]
        choice.order = order
        choice.recommendation = est.recommendation.value
        from linkctl.estimate.cost import Recommendation

        if est.recommendation is Recommendation.RUN_LOCALLY:
            from linkctl.estimate.report import reason

            choice.notes.append(f"the estimate says run locally: {reason(est.advice)}")
    elif choice.mode == "llama":
        choice.order = order
        choice.notes.append(
            "llama.cpp splits by the free memory each device reports when it loads; "
            "predicted with the profile's memory figures"
        )
    choice.predicted_decode_tok_s = sc.decode_tok_s
    choice.predicted_prefill_tok_s = sc.prefill_tok_s
    choice.estimate_source = est.link.source if est.link else None
    from linkctl.estimate.notes import NoteKind

    choice.notes += [w.text for w in est.warnings if w.kind is NoteKind.CALIBRATION]
    return choice


def _estimate_for(
    profile: Profile, model: str | None, choice: SplitChoice, calibration: list[Path] | None
):
    from linkctl.estimate.run import run_estimate

    if not model or not os.path.isfile(model):
        raise InputError(
            f"model {model or '(none)'} is not a readable file here",
            "set serve.model or pass --model PATH",
        )
    ts = None
    if choice.mode == "weights" and choice.tensor_split:
        ts = ",".join(f"{w:g}" for w in choice.tensor_split)
    return run_estimate(profile, Path(model), tensor_split=ts, calibration=calibration)


# ---- llama-server exposure ------------------------------------------------------


@dataclass(frozen=True)
class ServeAuth:
    """Who can reach llama-server's API, and what stops the rest."""

    exposure: str  # "loopback", "link" (the head's link address) or "exposed"
    mode: str  # "api-key", "unauthenticated" (allowed in the profile) or "not-needed"
    api_key_file: str | None = None
    keys: int = 0

    def summary(self) -> str:
        where = {
            "loopback": "loopback only",
            "link": "the link address only",
            "exposed": "beyond loopback and the link",
        }[self.exposure]
        if self.mode == "api-key":
            return (
                f"llama-server API on {where}: API key required "
                f"({self.keys} key(s) in {self.api_key_file})"
            )
        if self.mode == "unauthenticated":
            return (
                f"llama-server API on {where} WITHOUT authentication "
                "(serve.allow_unauthenticated = true)"
            )
        return f"llama-server API on {where}: no API key needed"

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def read_api_keys(path: str, root: Path = Path("/")) -> list[str]:
    """The keys llama-server will load from ``path`` (--api-key-file), after checking the
    file is private. llama-server (common/arg.cpp, --api-key-file) reads it line by
    line, skips empty lines and lines starting with '#', and keeps the rest verbatim:
    a stray space or CR would become part of the key, and a file with no key line
    starts the server with no authentication at all. Both are refused here. ``root``:
    the file as it is inside an image that `service install --root` writes."""
    inside = "" if str(root) == "/" else f" in {root}"
    field = f"serve.api_key_file = {path!r}{inside}"
    make = f"create it: (umask 077; openssl rand -hex 32 > {path})"
    real = root / path.lstrip("/")
    try:
        st = os.stat(real)
    except FileNotFoundError:
        raise InputError(f"{field}: no such file", make) from None
    except OSError as e:
        raise InputError(f"{field}: cannot stat: {e.strerror}") from None
    import stat as st_mod

    if not st_mod.S_ISREG(st.st_mode):
        raise InputError(f"{field}: not a regular file", make)
    mode = st_mod.S_IMODE(st.st_mode)
    if mode & 0o077:
        raise InputError(
            f"{field}: mode {mode:04o} lets group or others read or change the keys",
            f"chmod 600 {path}",
        )
    try:
        text = real.read_bytes().decode()  # bytes: universal newlines would hide a CR
    except (OSError, UnicodeDecodeError) as e:
        raise InputError(f"{field}: cannot read: {e}", "make it readable by this user") from None
    keys = []
    for n, line in enumerate(text.split("\n"), 1):
        if not line or line.startswith("#"):
            continue
        if line != line.strip():
            raise InputError(
                f"{field}: line {n} has leading or trailing whitespace (or a CR), which "
                "llama-server would keep as part of the key",
                "write one key per line, nothing else on it (Unix line endings)",
            )
        keys.append(line)
    if not keys:
        raise InputError(
            f"{field}: holds no key (only empty or '#' lines): llama-server would start "
            "without authentication",
            make.replace("create it", "put a key in it"),
        )
    return keys


def serve_auth(profile: Profile, root: Path = Path("/")) -> ServeAuth:
    """How the head's llama-server is protected; InputError when it would listen beyond
    loopback and the link with neither an API key file nor an explicit opt-out.
    ``root``: where the key file is looked for (an image for `service install --root`)."""
    s = profile.serve
    if s.host.is_loopback:
        exposure = "loopback"
    elif s.host == profile.head.address.ip:
        exposure = "link"
    else:
        exposure = "exposed"
    if s.api_key_file:
        keys = read_api_keys(s.api_key_file, root)
        return ServeAuth(exposure, "api-key", s.api_key_file, len(keys))
    if exposure != "exposed":
        return ServeAuth(exposure, "not-needed")
    if s.allow_unauthenticated:
        return ServeAuth(exposure, "unauthenticated")
    raise InputError(
        f"serve.host = {str(s.host)!r} puts llama-server's API beyond loopback and the link "
        "(anyone who reaches it can use the model), and the profile gives it no API key",
        "set serve.api_key_file to a mode-0600 file of keys (llama-server --api-key-file), "
        "or serve.allow_unauthenticated = true to serve it open on purpose",
    )


def build_plan(
    profile: Profile,
    host: HostSpec,
    bins: LlamaBins,
    model: str | None = None,
    split: SplitChoice | None = None,
) -> ServePlan:
    """Both argv lines, for this host's role; no side effects."""
    model = model or profile.serve.model
    notes = []
    if not model:
        notes.append("serve.model is empty: set it in the profile or pass --model")
    rpc_lines = {
        h.name: rpc_argv(h, _bin_for(h, host, bins, "rpc-server")) for h in profile.rpc_hosts
    }
    head = head_argv(
        profile, _bin_for(profile.head, host, bins, "llama-server"), model or "MODEL", split
    )
    if profile.serve.host.is_unspecified:
        notes.append(f"llama-server listens on {profile.serve.host}: every interface")
    auth = serve_auth(profile) if host.role == "head" else None
    if auth is not None:
        notes.append(auth.summary())
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
        notes=notes + (split.notes if split and host.role == "head" else []),
        bins=bins.as_dict(),
        split=split.as_dict() if split and host.role == "head" else None,
        auth=auth.as_dict() if auth else None,
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


def probe_gate(
    profile: Profile,
    head: HostSpec,
    max_age_s: float = PROBE_MAX_AGE_S,
    now: float | None = None,
    directory: Path | None = None,
) -> list[str]:
    """Every rpc host needs a passing probe report for this profile, newer than
    ``max_age_s``. Returns one summary line per rpc host; raises CheckFailed naming why."""
    from linkctl.core.records import latest_probe, probe_dir

    now = now or time.time()
    where = directory or probe_dir()
    lines = []
    for peer in profile.rpc_hosts:
        found = latest_probe(profile.name, peer.name, peer.ip, directory)
        if found is None:
            raise CheckFailed(
                f"no probe report for profile {profile.name!r} and peer {peer.name} in {where}",
                "run `linkctl probe` first (or pass --skip-probe to serve anyway)",
            )
        t, path, r = found
        age = now - t
        if not r.ok:
            failed = r.failed
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
    Raises RpcError subclasses (busy, no HELLO), ConnectionRefused / Timeout (nothing
    listens, no answer) and RpcProtocolMismatch."""
    from linkctl.llama import rpc

    out = []
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


def run_rpc(
    plan: ServePlan, host: HostSpec, backend, *, log: IO[str] | None = None, policy=None
) -> int:
    from linkctl.core.records import status_path
    from linkctl.llama import rpc
    from linkctl.serve.supervise import ChildSpec, Supervisor

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


def wait_endpoints(
    profile: Profile,
    local: tuple[int, int, int] | None,
    build: str,
    *,
    wait_s: float,
    say: Callable[[str], None],
) -> list[dict[str, Any]]:
    """First contact: wait up to ``wait_s`` for every endpoint (an rpc host may still be
    starting), but refuse at once what can never work (another protocol, no HELLO)."""
    from linkctl.llama import rpc

    deadline = time.monotonic() + wait_s
    last = None
    while True:
        try:
            return check_endpoints(profile, local, build)
        except (rpc.RpcNoHello, RpcProtocolMismatch):
            raise
        except InputError as e:
            if time.monotonic() > deadline:
                raise
            if e.message != last:
                say(f"waiting for rpc endpoints: {e.message}")
                last = e.message
            time.sleep(0.5)


def run_head(
    plan: ServePlan,
    profile: Profile,
    bins: LlamaBins,
    *,
    log: IO[str] | None = None,
    wait_s: float = 60.0,
    policy=None,
    split: SplitChoice | None = None,
) -> int:
    from linkctl.core.records import status_path
    from linkctl.serve.supervise import ChildSpec, Supervisor, stamp

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
    if split is not None:
        say(split.summary())
        for note in split.notes:
            say(f"split note: {note}")

    infos = wait_endpoints(profile, local, build, wait_s=wait_s, say=say)
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
