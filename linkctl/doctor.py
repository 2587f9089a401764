"""doctor: one read-only pass over everything that must be true before `linkctl serve`.

Each check is one ``linkctl.core.checks.Check`` (PASS / WARN / FAIL, or SKIP when a check
it depends on failed) with the fix for WARN and FAIL. The checks reuse the code that acts on the
same facts, so doctor and the real commands cannot disagree:

    profile          linkctl.core.profile (load_profile)
    host             linkctl.net.link.identify_host
    interface, speed, duplex, address, mtu
                     linkctl.net.nic_checks (what status and probe apply), on the
                     backend's link_facts
    default route    linkctl.net.link.status
    peer <name>      linkctl.probe.peer.check_peer (ARP who-has, pinned MAC)
    llama binaries, rpc protocol, rpc <name>
                     linkctl.llama.bins (find_bins, local_rpc_protocol, compatible),
                     linkctl.llama.rpc
    serve auth       linkctl.serve.auth.serve_auth (head: API key or explicit opt-out)
    watch echo       linkctl.net.echo.unit_echo_check (the watch's idle echo)
    services         linkctl.service.status
    probe report     linkctl.serve.run.probe_gate (head) / records.latest_probe (rpc host)
    disagg model, slot directory, kv-agent, servers match   (serve.mode = "disaggregated")
                     linkctl.disagg.checks.doctor_checks (fingerprint, pair.compare_servers)
    slot restores    linkctl.disagg.checks.restore_check (head, disaggregated: serve.model)

Doctor changes nothing on the network. What it sends: an ARP who-has for each peer's
link address, out of the link interface only; from the head, one TCP connection with
an RPC HELLO to each rpc host's rpc-server endpoint (its link address); in
disaggregated mode also one kv-agent "model" request and one GET /props to the
prefill host's link address, and GET /props to the local decode server (127.0.0.1). Learning the
local build's RPC protocol starts that build's rpc-server on 127.0.0.1 for a moment
(cached per binary by linkctl.llama.bins). No platform branches here: every network fact
comes through the Backend protocol, so the macOS backend answers the same questions.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from linkctl.core.checks import Check, Verdict, worst
from linkctl.core.errors import CheckFailed, ConnectionRefused, InputError, Timeout
from linkctl.core.profile import HostSpec, Profile
from linkctl.net.backend import Backend
from linkctl.net.echo import unit_echo_check
from linkctl.net.netstate import LinkStatus
from linkctl.net.nic_checks import nic_checks, speed_text

PROBE_FIX = "linkctl probe"
DEFAULT_PEER_TIMEOUT_S = 2.0


@dataclass
class DoctorResult:
    lines: list[Check] = field(default_factory=list)
    # 2 when the input itself is bad (profile invalid, host not identifiable): the
    # remaining checks are not run at all.
    bad_input: bool = False
    profile: str | None = None
    profile_path: Path | None = None
    host: str | None = None
    role: str | None = None
    os_name: str | None = None
    elapsed_s: float = 0.0

    def add(
        self,
        check: str,
        verdict: Verdict,
        value: Any = None,
        detail: str = "",
        fix: str | None = None,
    ) -> Check:
        line = Check(check, verdict, value, detail=detail, fix=fix)
        self.lines.append(line)
        return line

    def get(self, check: str) -> Check | None:
        return next((ln for ln in self.lines if ln.name == check), None)

    @property
    def exit_code(self) -> int:
        if self.bad_input:
            return 2
        return 1 if worst(ln.verdict for ln in self.lines) is Verdict.FAIL else 0

    def as_json(self) -> dict[str, Any]:
        """Who was checked (profile, its file, host) and the lines in doctor's documented
        shape: check, verdict, value, detail, fix."""
        return {
            "profile": self.profile,
            "profile_path": str(self.profile_path) if self.profile_path else None,
            "host": self.host,
            "exit_code": self.exit_code,
            "checks": [
                {
                    "check": ln.name,
                    "verdict": ln.verdict.value,
                    "value": ln.value,
                    "detail": ln.detail,
                    "fix": ln.fix,
                }
                for ln in self.lines
            ],
        }


# ---- 1-2: profile and host ---------------------------------------------------------------


def check_profile(res: DoctorResult, profile_arg: str | None) -> Profile | None:
    from linkctl.core.profile import load_chosen

    try:
        prof, path = load_chosen(profile_arg)
    except InputError as e:
        res.add("profile", Verdict.FAIL, profile_arg, e.message, e.fix)
        res.bad_input = True
        return None
    res.profile, res.profile_path = prof.name, path
    res.add(
        "profile",
        Verdict.PASS,
        prof.name,
        f"{prof.name} ({path}): {len(prof.hosts)} hosts, "
        f"link {prof.link.subnet} MTU {prof.link.mtu}, "
        f"expects {speed_text(prof.link.expected_speed_mbps)}",
    )
    return prof


def check_host(
    res: DoctorResult, prof: Profile, backend: Backend, host_arg: str | None
) -> HostSpec | None:
    from linkctl.net.link import identify_host

    if host_arg:
        how = "from --host"
    elif os.environ.get("LINKCTL_HOST"):
        how = "from LINKCTL_HOST"
    else:
        how = f"detected: the one {backend.os_name} host whose interface exists here"
    try:
        host = identify_host(prof, backend, host_arg)
    except InputError as e:
        res.add("host", Verdict.FAIL, host_arg or os.environ.get("LINKCTL_HOST"), e.message, e.fix)
        res.bad_input = True
        return None
    res.host, res.role, res.os_name = host.name, host.role, backend.os_name
    note = "" if host.os == backend.os_name else f"; profile says {host.os}"
    res.add(
        "host",
        Verdict.PASS,
        host.name,
        f"{host.name} ({host.role}, {host.interface}, {host.address}) {how}; "
        f"this machine runs {backend.os_name}{note}",
    )
    return host


# ---- 3-5: interface, address, MTU, default route (link.status) ----------------------------


def check_link(
    res: DoctorResult, prof: Profile, host: HostSpec, backend: Backend
) -> LinkStatus | None:
    """Lines for the interface, speed, duplex, address, MTU and default route.
    Returns the status (None when the interface does not exist)."""
    from linkctl.net.link import status

    ifname = host.interface
    try:
        st = status(prof, host, backend)
    except InputError as e:
        res.add(
            "interface",
            Verdict.FAIL,
            ifname,
            e.message,
            e.fix or "name this machine's direct-link port in the profile (hosts.interface)",
        )
        for name in ("speed", "duplex", "address", "mtu"):
            res.add(name, Verdict.SKIP, None, f"{ifname} does not exist")
        _default_route_line(res, host, backend.default_route())
        return None
    checks = nic_checks(st.facts, host, prof.link)
    res.lines.extend(checks[n] for n in ("interface", "speed", "duplex", "address", "mtu"))

    _default_route_line(res, host, st.default_route)
    return st


def _default_route_line(res: DoctorResult, host: HostSpec, default: Any) -> None:
    if default is None:
        res.add(
            "default route",
            Verdict.WARN,
            None,
            "no default route: this machine has no uplink (WiFi down?)",
            "connect the uplink (WiFi); the link itself does not need it",
        )
    elif default.ifname == host.interface:
        res.add(
            "default route",
            Verdict.FAIL,
            default.ifname,
            f"the default route (via {default.gateway}) goes out of the link port {host.interface}",
            "give the link port a static address without a router (`linkctl setup`) "
            "and let the uplink (WiFi) keep the default route",
        )
    else:
        res.add(
            "default route",
            Verdict.PASS,
            default.ifname,
            f"via {default.gateway} dev {default.ifname}, not the link",
        )


# ---- 6: peers answer ARP ---------------------------------------------------------------------


def check_peers(
    res: DoctorResult,
    prof: Profile,
    host: HostSpec,
    st: LinkStatus | None,
    timeout_s: float,
) -> dict[str, bool]:
    """ARP every other profile host (probe's check_peer); {peer name: answered}."""
    from linkctl.core.privilege import sudo_line
    from linkctl.probe.peer import check_peer
    from linkctl.probe.report import ProbeReport

    answered: dict[str, bool] = {}
    why_not = None
    if st is None:
        why_not = f"{host.interface} does not exist"
    elif not (st.facts.up and st.facts.carrier):
        why_not = f"{host.interface} is down or has no carrier"
    elif not st.facts.has_address(str(host.address)):
        why_not = f"{host.interface} lacks {host.address} (ARP is sent from it)"
    for peer in prof.peers_of(host.name):
        name = f"peer {peer.name}"
        answered[peer.name] = False
        if why_not:
            res.add(name, Verdict.SKIP, None, why_not)
            continue
        scratch = ProbeReport(prof.name, host.name, peer.name, peer.ip)
        try:
            ok = check_peer(scratch, host, peer, timeout_s)
        except InputError as e:
            res.add(name, Verdict.FAIL, None, e.message, e.fix)
            continue
        c = scratch.checks[-1]
        if ok:
            answered[peer.name] = True
            res.add(
                name,
                Verdict.PASS,
                c.value,
                f"{peer.ip} answers ARP in {scratch.arp.elapsed_ms} ms; {c.detail}",
            )
            continue
        if c.name == "peer mac":
            fix = (
                f"check which machine is on the cable, or update hosts.mac of {peer.name} "
                "in the profile"
            )
        elif isinstance(c.value, list):
            fix = f"find the other device that holds {peer.ip} on the segment"
        elif scratch.stop_code == 2:  # ARP could not be sent (PermissionDenied, see check_peer)
            # Doctor runs as a user; only this check needs root: say so, do not fail.
            res.add(name, Verdict.WARN, None, "not checked: ARP needs a raw socket", sudo_line())
            continue
        else:
            fix = f"power {peer.name} on, check the cable, run `linkctl setup` on {peer.name}"
        res.add(name, Verdict.FAIL, c.value, scratch.stopped or c.detail, fix)
    return answered


# ---- 7: llama.cpp binaries and RPC protocol ------------------------------------------------


def check_llama(
    res: DoctorResult,
    prof: Profile,
    host: HostSpec,
    answered: dict[str, bool],
    timeout_s: float,
    hello: Callable[..., tuple[int, int, int]] | None = None,
) -> None:
    from linkctl.llama import bins as llama
    from linkctl.llama import rpc

    hello = hello or rpc.hello
    bins = llama.find_bins(host.llama_bin_dir)
    role_bin = "rpc-server" if host.role == "rpc" else "llama-server"
    try:
        mine = bins.need(role_bin)
    except InputError as e:
        res.add("llama binaries", Verdict.FAIL, None, f"{host.role} host: {e.message}", e.fix)
        mine = None
    if mine:
        versions = [
            f"{Path(b.path).name} {(b.version or 'version unknown').removeprefix('version: ')} "
            f"at {b.path} (via {b.found_via})"
            for b in (bins.llama_server, bins.rpc_server)
            if b
        ]
        res.add("llama binaries", Verdict.PASS, mine.path, "; ".join(versions))

    local: tuple[int, int, int] | None = None
    if bins.rpc_server is None and host.role == "rpc":
        res.add(
            "rpc protocol", Verdict.SKIP, None, "no ggml-rpc-server to ask (see llama binaries)"
        )
    elif bins.rpc_server is None:
        res.add(
            "rpc protocol",
            Verdict.WARN,
            None,
            "no ggml-rpc-server beside llama-server: the local RPC protocol version "
            "cannot be learned, so the rpc hosts' versions cannot be compared",
            "build llama.cpp with -DGGML_RPC=ON (scripts/build-llama.sh)",
        )
    else:
        try:
            local = llama.local_rpc_protocol(bins, timeout=10.0)
            res.add(
                "rpc protocol",
                Verdict.PASS,
                rpc.version_str(local),
                f"RPC protocol {rpc.version_str(local)} of the local build "
                f"({Path(bins.rpc_server.path).name}, HELLO on 127.0.0.1)",
            )
        except InputError as e:
            res.add("rpc protocol", Verdict.FAIL, None, e.message, e.fix)

    if host.role != "head":
        return
    for peer in prof.rpc_hosts:
        name = f"rpc {peer.name}"
        where = peer.rpc_endpoint
        if not answered.get(peer.name):
            res.add(name, Verdict.SKIP, None, f"peer {peer.name} not reached by ARP (see its line)")
            continue
        if local is None:
            res.add(name, Verdict.SKIP, None, "the local RPC protocol version is unknown")
            continue
        try:
            theirs = hello(peer.rpc_bind, peer.rpc.port, timeout=timeout_s)
        except rpc.RpcBusy:
            res.add(
                name,
                Verdict.WARN,
                None,
                f"{where}: busy (llama-server connected): it answers one client at a time",
                "nothing to do if that llama-server is yours; else stop it and re-run doctor",
            )
            continue
        except Timeout:
            # The peer answered ARP: a connect with no answer is a full listen queue, the
            # connects left waiting while a client (the head's llama-server) holds it.
            res.add(
                name,
                Verdict.WARN,
                None,
                f"{where}: busy (its listen queue is full while a client holds it): it answers "
                "one client at a time",
                "nothing to do if that client is your llama-server; else stop it and re-run doctor",
            )
            continue
        except rpc.RpcNoHello as e:
            res.add(name, Verdict.FAIL, None, e.message, e.fix)
            continue
        except ConnectionRefused:
            res.add(
                name,
                Verdict.SKIP,
                None,
                f"nothing listens on {where} yet (start it: `linkctl serve` on {peer.name})",
            )
            continue
        except InputError as e:
            res.add(name, Verdict.FAIL, None, e.message, e.fix)
            continue
        if llama.compatible(local, theirs):
            res.add(
                name,
                Verdict.PASS,
                rpc.version_str(theirs),
                f"{where} speaks RPC {rpc.version_str(theirs)}, compatible with this "
                f"head's {rpc.version_str(local)}",
            )
        else:
            res.add(
                name,
                Verdict.FAIL,
                rpc.version_str(theirs),
                f"{where} speaks RPC {rpc.version_str(theirs)}, this head's build speaks "
                f"{rpc.version_str(local)}: llama-server would refuse it",
                f"build the same llama.cpp release on {peer.name} and here "
                "(scripts/build-llama.sh)",
            )


def check_serve_auth(res: DoctorResult, prof: Profile, host: HostSpec) -> None:
    """Head: what protects llama-server's API where serve.host puts it (the same rule
    `linkctl serve` enforces)."""
    if host.role != "head":
        return
    from linkctl.serve.auth import serve_auth

    try:
        auth = serve_auth(prof)
    except InputError as e:
        res.add("serve auth", Verdict.FAIL, None, e.message, e.fix)
        return
    if auth.mode == "unauthenticated":
        res.add(
            "serve auth",
            Verdict.WARN,
            auth.mode,
            auth.summary(),
            "set serve.api_key_file (a mode-0600 file of keys) unless the network is yours alone",
        )
    else:
        res.add("serve auth", Verdict.PASS, auth.mode, auth.summary())


# ---- 8: services ---------------------------------------------------------------------------


def check_services(
    res: DoctorResult, prof: Profile, host: HostSpec, profile_arg: str, root: Path
) -> None:
    from linkctl import service as svc

    install = f"sudo linkctl service install --profile {profile_arg} --host {host.name}"
    st = svc.status(root=root)
    if not st.installed:
        res.add("services", Verdict.WARN, None, f"boot services not installed in {root}", install)
        return
    if (st.profile, st.host) != (prof.name, host.name):
        res.add(
            "services",
            Verdict.WARN,
            f"{st.profile}/{st.host}",
            f"the installed services are for {st.profile}/{st.host}, not {prof.name}/{host.name}",
            install,
        )
        return
    bad_files = [f"{f.path} {f.state}" for f in st.files if not f.ok]
    down = [f"{s.name} {s.active}" for s in st.services if not s.ok]
    if bad_files:
        res.add(
            "services",
            Verdict.WARN,
            st.manager,
            "installed, but " + "; ".join(bad_files),
            f"re-install: {install}",
        )
    elif down:
        res.add(
            "services",
            Verdict.WARN,
            st.manager,
            "installed, not running: " + "; ".join(down),
            "see `linkctl service status` and the service logs",
        )
    else:
        names = ", ".join(s.name for s in st.services) or "files only"
        res.add("services", Verdict.PASS, st.manager, f"{st.manager}: {names}")


# ---- 9: probe report ---------------------------------------------------------------------


def check_probe_report(
    res: DoctorResult, prof: Profile, host: HostSpec, now: float | None = None
) -> None:
    from linkctl.core.records import latest_probe
    from linkctl.serve.run import PROBE_MAX_AGE_S, probe_gate

    now = now or time.time()
    if host.role == "head":
        # The very gate `linkctl serve` applies on the head.
        try:
            lines = probe_gate(prof, host, now=now)
        except CheckFailed as e:
            res.add("probe report", Verdict.WARN, None, e.message, PROBE_FIX)
            return
        res.add("probe report", Verdict.PASS, len(lines), "; ".join(lines))
        return
    # An rpc host probes the head; serve does not gate on it, doctor still asks.
    head = prof.head
    found = latest_probe(prof.name, head.name)
    if found is None:
        res.add(
            "probe report",
            Verdict.WARN,
            None,
            f"no probe report from {host.name} to {head.name} for profile {prof.name}",
            PROBE_FIX,
        )
        return
    t, path, r = found
    age = now - t
    if not r.ok:
        res.add(
            "probe report",
            Verdict.WARN,
            path.name,
            f"latest probe report {path} failed ({', '.join(r.failed) or r.stopped})",
            f"fix the link, then {PROBE_FIX}",
        )
    elif age > PROBE_MAX_AGE_S:
        res.add(
            "probe report",
            Verdict.WARN,
            path.name,
            f"latest probe report {path} is {age / 3600:.1f} h old "
            f"(limit {PROBE_MAX_AGE_S / 3600:g} h)",
            PROBE_FIX,
        )
    else:
        res.add("probe report", Verdict.PASS, path.name, f"{path.name}: ok, {age:.0f} s old")


# ---- the pass ---------------------------------------------------------------------------------


def run(
    profile_arg: str | None = None,
    host_arg: str | None = None,
    *,
    backend: Backend | None = None,
    peer_timeout_s: float = DEFAULT_PEER_TIMEOUT_S,
    service_root: Path = Path("/"),
    hello: Callable[..., tuple[int, int, int]] | None = None,
    now: float | None = None,
) -> DoctorResult:
    """Every check, in order. Never raises for what it finds: bad input is a FAIL line
    with ``bad_input`` set (exit 2), everything else a line."""
    from linkctl.core.profile import announce
    from linkctl.net.backend import get_backend

    t0 = time.perf_counter()
    res = DoctorResult()
    prof = check_profile(res, profile_arg)
    if prof is None:
        return res
    try:
        backend = backend or get_backend()
    except InputError as e:
        res.add("host", Verdict.FAIL, None, e.message, e.fix)
        res.bad_input = True
        return res
    host = check_host(res, prof, backend, host_arg)
    if host is None:
        return res
    assert res.profile_path is not None
    announce(prof, res.profile_path, host.name)
    st = check_link(res, prof, host, backend)
    answered = check_peers(res, prof, host, st, peer_timeout_s)
    check_llama(res, prof, host, answered, peer_timeout_s, hello)
    check_serve_auth(res, prof, host)
    if prof.serve.watch_interval_s:  # the watch's idle echo, from inside the serve unit
        from linkctl.service.install import load_manifest
        from linkctl.service.manager import serve_unit_gids

        try:
            serve_user = (load_manifest(service_root) or {}).get("serve_user")
        except InputError:  # an unreadable manifest: the services line says so
            serve_user = None
        gids = serve_unit_gids(host, serve_user)
        res.lines.append(unit_echo_check(backend.icmp_socket_groups, gids))
    if prof.serve.mode == "disaggregated":
        from linkctl.disagg.checks import doctor_checks, restore_check

        res.lines += doctor_checks(prof, host, answered, peer_timeout_s)
        if host.role == "head" and os.path.isfile(prof.serve.model):
            res.lines.append(restore_check(prof.serve.model))
    shown = profile_arg or os.environ.get("LINKCTL_PROFILE") or prof.name
    check_services(res, prof, host, shown, service_root)
    check_probe_report(res, prof, host, now)
    res.elapsed_s = time.perf_counter() - t0
    return res
