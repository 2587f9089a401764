"""`linkctl up`: this host's end of the pair, from a bare machine to serving, in stages.

1. preflight  root, the profile matches this machine (OS, interface), setup's own checks,
              the llama.cpp binary of this host's role, the model and the API key rule
              (head), iperf3, the service manager: any refusal here changes nothing
2. state      the state directory as it is, kept for `linkctl down` (first up only)
3. link       `linkctl setup` (idempotent; NetworkManager keeps it across boots)
4. calibrate  when this host has no calibration for this llama-server build: the
              responder hands it to the peer, whose probe stores it
5. services   responder, the link unit (setup + the probe gate, retried until the peer
              answers) and serve, through the host's service manager; at every boot too
              unless --no-boot (then where the manager forgets them at the next boot)
6. peer       wait until the gate passed: a passing probe report, newer than this up
7. serve      wait until this host's server answers (rpc HELLO / llama-server /health)

A failure or a signal before the services are up on a first `up` undoes what it did
(`linkctl down`); a peer that stays away past --wait is such a failure, with the
probe's own reason. A second `up` finds every stage done and says so.
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from linkctl.core.errors import CheckFailed, InputError
from linkctl.core.log import Say
from linkctl.core.profile import HostSpec, Profile
from linkctl.core.runner import Runner
from linkctl.lifecycle import record as up_record
from linkctl.lifecycle.reach import Reach, reach
from linkctl.lifecycle.stage import Stage, run_stage

if TYPE_CHECKING:
    from linkctl.llama.bins import LlamaBins
    from linkctl.net.backend import Backend
    from linkctl.service import ServicePaths


@dataclass
class UpOptions:
    boot: bool = True
    wait_s: float = 300.0  # for the peer: both owners may be minutes apart
    serve_wait_s: float = 300.0  # for this host's server once the gate passed
    llama_bin_dir: str | None = None
    linkctl_bin: str | None = None
    serve_user: str | None = None
    dry_run: bool = False


@dataclass
class UpResult:
    profile: str
    profile_path: str
    host: str
    role: str
    boot: bool
    dry_run: bool
    reach: Reach
    stages: list[Stage] = field(default_factory=list)
    elapsed_s: float = 0.0

    @property
    def changed(self) -> bool:
        return any(s.changed for s in self.stages)

    def summary(self) -> str:
        if self.dry_run:
            return f"up --dry-run: nothing changed; once up: {self.reach.line()}"
        head = "nothing changed" if not self.changed else f"up in {self.elapsed_s:.0f} s"
        return f"{head}; {self.reach.line()}"

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["changed"] = self.changed
        d["summary"] = self.summary()
        return d


@dataclass
class Waits:
    """How up knows the peer's gate passed and this host serves. The defaults read the
    probe reports and ask the server; a test of the Mac's commands, which has no peer,
    gives its own."""

    gate: Callable[[Profile, HostSpec, float | None, float, Say], tuple[bool, str]]
    serving: Callable[[Profile, HostSpec, float, Say], tuple[bool, str]]


class PeerUnreachable(CheckFailed):
    """The probe gate did not pass within --wait; carries the probe's last reason."""


@dataclass
class Prepared:
    """What preflight found, handed to the stages."""

    bins: LlamaBins
    paths: ServicePaths
    build: str | None  # llama-server --version of this host's build (calibration's key)


def preflight(
    prof: Profile, h: HostSpec, backend: Backend, opts: UpOptions, runner: Runner, root: Path
) -> Prepared:
    """Every refusal `up` can make before it changes anything (InputError, exit 2)."""
    from linkctl import service as svc
    from linkctl.core.privilege import require_root
    from linkctl.llama.bins import find_bins, server_version
    from linkctl.net import link
    from linkctl.probe.responder import iperf3_path
    from linkctl.trust.secret import load as load_secret

    require_root("up configures the link and installs the services")
    if h.os != backend.os_name:
        raise InputError(
            f"profile {prof.name!r}: host {h.name} runs {h.os}, this machine runs "
            f"{backend.os_name}",
            "run up on that host, or pass --host NAME of this machine",
        )
    if h.interface not in backend.interfaces():
        raise InputError(
            f"profile {prof.name!r}: host {h.name}'s interface {h.interface!r} is not on this "
            f"machine (it has: {', '.join(sorted(backend.interfaces()))})",
            "pass --host NAME of this machine, or fix hosts.interface in the profile",
        )
    link.setup(prof, h, backend, dry_run=True)  # setup's own checks: default route, overlap
    bins = find_bins(opts.llama_bin_dir or h.llama_bin_dir, runner)
    bins.need("rpc-server" if h.role == "rpc" else "llama-server")
    if bins.llama_server:  # calibration reads the device's catalog terms
        from linkctl.estimate.catalog import get_device, load_catalog

        get_device(load_catalog(), h.device, f"host {h.name}")
    if h.role == "head":
        from linkctl.serve.auth import serve_auth
        from linkctl.serve.run import model_path_check

        model_path_check(prof.serve.model)
        serve_auth(prof)
    iperf3_path(runner)
    load_secret(prof.name)  # the responder and the kv-agent answer only its holders
    mgr = svc.manager_for(h)
    if runner.which(mgr.tool) is None:
        raise InputError(
            f"{mgr.tool} not found: up runs this host's services through {mgr.name}",
            "run the stages by hand (docs/walkthrough.md), or install it",
        )
    installed = svc.load_manifest(root)
    if installed is not None:
        if (installed["profile"], installed["host"]) != (prof.name, h.name):
            raise InputError(
                f"services of {installed['profile']}/{installed['host']} are installed here",
                f"run `sudo linkctl down --profile {installed['profile']}` first",
            )
        if installed.get("boot", True) != opts.boot:
            now, asked = ("at boot", "--no-boot") if opts.boot is False else ("now only", "boot")
            raise InputError(
                f"this host's services are installed to run {now}; up was asked for {asked}",
                "run `sudo linkctl down` first",
            )
    bin_dir = opts.llama_bin_dir or svc.default_llama_bin_dir(h)
    assert bin_dir is not None  # bins.need found the binary
    paths = svc.ServicePaths(
        linkctl_bin=opts.linkctl_bin or svc.default_linkctl_bin(),
        llama_bin_dir=os.path.abspath(bin_dir),
        profile_path=f"{svc.PROFILE_DIR}/{prof.name}.toml",
        profile_text=None,
        serve_user=opts.serve_user,
        boot=opts.boot,
    )
    build = server_version(bins.llama_server.path, runner) if bins.llama_server else None
    return Prepared(bins, paths, build)


def _profile_paths(paths: ServicePaths, profile_path: Path) -> ServicePaths:
    """The units read the profile from /etc/linkctl/profiles: its text is installed
    there, unless that is where it already lives."""
    from dataclasses import replace

    same = os.path.realpath(profile_path) == os.path.realpath(paths.profile_path)
    return replace(paths, profile_text=None if same else profile_path.read_text())


def up(
    prof: Profile,
    profile_path: Path,
    h: HostSpec,
    backend: Backend,
    opts: UpOptions,
    *,
    say: Say,
    runner: Runner | None = None,
    root: Path = Path("/"),
    waits: Waits | None = None,
) -> UpResult:
    """Bring this host up (see the module's stages). ``root``: where the service files
    go (``/``; a test's directory stands in for a Mac); they are started either way."""
    from linkctl.core.runner import default_runner
    from linkctl.core.stopflag import sigterm_as_interrupt

    runner = runner or backend.runner or default_runner()
    waits = waits or Waits(functools.partial(_wait_gate, backend=backend), _wait_serving)
    t0 = time.monotonic()
    started = time.time()
    res = UpResult(
        prof.name, str(profile_path), h.name, h.role, opts.boot, opts.dry_run, reach(prof, h)
    )
    prep = preflight(prof, h, backend, opts, runner, root)
    prep.paths = _profile_paths(prep.paths, profile_path)
    if opts.dry_run:
        res.stages = _dry_stages(prof, h, backend, prep, opts, root)
        return res
    first = up_record.load_record(prof.name, h.name) is None
    with sigterm_as_interrupt():
        try:
            if first:
                _keep_state(prof, profile_path, h, opts, root)
            run_stage(res.stages, say, "link", lambda: _link(prof, h, backend))
            run_stage(res.stages, say, "calibration", lambda: _calibrate(prof, h, prep, say))
            svc_stage = run_stage(
                res.stages, say, "services", lambda: _services(prof, h, prep, root, runner)
            )
            # Unchanged services that run already passed their gate on an earlier up.
            since = started if svc_stage.changed else None
            run_stage(res.stages, say, "peer", lambda: waits.gate(prof, h, since, opts.wait_s, say))
        except BaseException as e:
            if first:
                why = "interrupted" if isinstance(e, KeyboardInterrupt) else "failed"
                say(f"{why}: undoing what up did (as `linkctl down` would)")
                from linkctl.lifecycle.down import down

                down(prof, profile_path, h, backend, say=say, runner=runner, root=root)
            raise
    run_stage(res.stages, say, "serve", lambda: waits.serving(prof, h, opts.serve_wait_s, say))
    res.elapsed_s = time.monotonic() - t0
    return res


def _keep_state(
    prof: Profile, profile_path: Path, h: HostSpec, opts: UpOptions, root: Path
) -> None:
    from linkctl import service as svc

    absent = [
        p for p in svc.manager_for(h).purge_paths() if not os.path.lexists(svc.in_root(root, p))
    ]
    up_record.save(
        up_record.UpRecord(
            profile=prof.name,
            profile_path=str(profile_path),
            host=h.name,
            started_at=up_record.now(),
            boot=opts.boot,
            state=up_record.snapshot(prof.name, h.name),
            absent_before=absent,
        )
    )


def _link(prof: Profile, h: HostSpec, backend: Backend) -> tuple[bool, str]:
    from linkctl.net import link

    r = link.setup(prof, h, backend)
    if r.nothing_to_do:
        return False, f"{h.interface} is as profiled, nothing to do"
    changes = "; ".join(c.summary for c in r.plan.changes)
    return True, f"{h.interface}: applied {len(r.plan.changes)} change(s): {changes}"


def _calibration_needed(h: HostSpec, prep: Prepared) -> tuple[bool, str]:
    from linkctl.core.records import calibration_of

    if prep.bins.llama_server is None:
        return False, (
            f"no llama-server on {h.name}: the estimate keeps the catalog's terms for it"
        )
    kept = calibration_of(h.name)
    # A build that cannot be told (no --version line) keeps what was measured.
    if kept is not None and prep.build in (None, kept.build):
        return False, f"kept (measured {kept.measured_at}, {kept.build or 'build unknown'})"
    if kept is None:
        return True, f"none for {h.name} yet"
    return True, f"the kept one measured {kept.build}, this host runs {prep.build}"


def _calibrate(prof: Profile, h: HostSpec, prep: Prepared, say: Say) -> tuple[bool, str]:
    from linkctl.calibrate.measure import measure
    from linkctl.calibrate.plan import plan
    from linkctl.calibrate.solve import record
    from linkctl.core.log import speaker
    from linkctl.core.records import save_calibration

    needed, why = _calibration_needed(h, prep)
    if not needed:
        return False, why
    say(f"calibration: {why}; measuring (a minute or two) ...")
    p = plan(prof, [], host=h.name, bin_dir=prep.paths.llama_bin_dir)
    rec = record(p, measure(p, say=speaker("calibrate")))
    path = save_calibration(h.name, rec)
    return True, (
        f"measured {rec.effective_bandwidth_gbs:.1f} GB/s effective, "
        f"{rec.layer_us:.1f} µs per block ({rec.build}); saved to {path}"
    )


def _services(
    prof: Profile, h: HostSpec, prep: Prepared, root: Path, runner: Runner
) -> tuple[bool, str]:
    import linkctl
    from linkctl import service as svc

    pkg = str(Path(linkctl.__file__).parent) if str(root) == "/" else None
    r = svc.install(prof, h, prep.paths, root=root, runner=runner, package_dir=pkg, live=True)
    when = "now and at every boot" if prep.paths.boot else "now only (--no-boot)"
    names = ", ".join(svc.manager_for(h).service_names())
    if not r.changed:
        return False, f"{names} installed and unchanged ({r.manager}, {when})"
    return True, f"{names} installed and started ({r.manager}, {when})"


def _wait_gate(
    prof: Profile,
    h: HostSpec,
    since: float | None,
    wait_s: float,
    say: Say,
    backend: Backend | None = None,
) -> tuple[bool, str]:
    """Until every peer has a passing probe report (newer than ``since``): the link
    unit's gate, which retries until the peer's responder answers. Each new reason a
    failed attempt gave is said once; past ``wait_s`` the last one is the refusal."""
    from linkctl.core.records import latest_probe
    from linkctl.probe import choose_peers

    peers = choose_peers(prof, h)
    t0 = time.monotonic()
    said: set[str] = set()
    last: dict[str, str] = {}
    next_note = t0 + 30
    while True:
        passed = {}
        for p in peers:
            found = latest_probe(prof.name, p.name, p.ip)
            if found is None or (since is not None and found[0] < since - 1):
                last[p.name] = _before_any_report(h, backend)
                continue
            t, path, r = found
            if r.ok:
                passed[p.name] = (t, path)
                continue
            last[p.name] = r.why_not()
            if last[p.name] not in said:
                said.add(last[p.name])
                say(f"peer: probe -> {p.name} did not pass: {last[p.name]} (retrying)")
        if len(passed) == len(peers):
            changed = since is not None
            detail = ", ".join(
                f"{n} probed ok ({path.name}, {time.time() - t:.0f} s ago)"
                for n, (t, path) in passed.items()
            )
            return changed, detail
        now = time.monotonic()
        if now - t0 > wait_s:
            missing = [p.name for p in peers if p.name not in passed]
            why = "; ".join(f"{n}: {last.get(n, 'no report')}" for n in missing)
            raise PeerUnreachable(
                f"peer {', '.join(missing)} not reachable through the link after "
                f"{wait_s:g} s: {why}",
                f"run `sudo linkctl up` on {', '.join(missing)} (within --wait), check the "
                "cable, and see `linkctl probe` for the reason",
            )
        if now >= next_note:
            say(
                f"peer: waiting for {', '.join(p.name for p in peers if p.name not in passed)} "
                f"({now - t0:.0f} s of {wait_s:g} s; run `sudo linkctl up` there)"
            )
            next_note = now + 30
        time.sleep(1.0)


def _rpc_serving(h: HostSpec) -> str:
    """rpc-server answers HELLO, or listens while busy: it serves one client at a time,
    and once the head's llama-server holds it, a HELLO (even a TCP connect, past its
    listen backlog) gets no answer until that client goes."""
    import psutil

    from linkctl.core.errors import Timeout
    from linkctl.llama import rpc

    try:
        rpc.hello(h.rpc_bind, h.rpc.port, timeout=1.0)
        return "answers HELLO"
    except (rpc.RpcBusy, Timeout):
        listening = any(
            c.status == psutil.CONN_LISTEN
            and c.laddr
            and tuple(c.laddr) == (h.rpc_bind, h.rpc.port)
            for c in psutil.net_connections(kind="tcp")
        )
        if not listening:
            raise
        return "listens, busy with a client (the head's llama-server)"


def _before_any_report(h: HostSpec, backend: Backend | None) -> str:
    """Why the link unit has not probed yet: it waits for carrier first (setup
    --wait-carrier), and a port without one is the usual reason."""
    if backend is not None:
        try:
            carrier = backend.link_facts(h.interface).carrier
        except InputError:
            carrier = None
        if carrier is False:
            return (
                f"no carrier on {h.interface}: the peer's port is down (is up running "
                "there?) or the cable is out"
            )
    return "no probe report yet (the link unit probes first)"


def _wait_serving(prof: Profile, h: HostSpec, wait_s: float, say: Say) -> tuple[bool, str]:
    """Until this host's server answers: rpc-server's HELLO, llama-server's /health."""
    from linkctl.core.wait import until_answered
    from linkctl.llama.client import LlamaServer

    r = reach(prof, h)
    t0 = time.monotonic()
    if h.role == "rpc":
        how = until_answered(
            lambda: _rpc_serving(h),
            within=wait_s,
            what=f"rpc-server on {h.rpc_endpoint}",
            say=say,
            interval=1.0,
        )
        return False, f"{r.endpoint} {how} ({time.monotonic() - t0:.0f} s)"
    else:
        assert r.url is not None
        host, port = r.url.removeprefix("http://").rsplit(":", 1)
        server = LlamaServer(host, int(port))

        def health() -> None:
            if not server.healthy(timeout=2.0):
                raise CheckFailed(f"llama-server at {r.url} does not answer /health yet")

        until_answered(health, within=wait_s, what="llama-server", say=say, interval=1.0)
    return False, f"{r.endpoint} answers ({time.monotonic() - t0:.0f} s)"


def _dry_stages(
    prof: Profile, h: HostSpec, backend: Backend, prep: Prepared, opts: UpOptions, root: Path
) -> list[Stage]:
    from linkctl import service as svc
    from linkctl.net import link
    from linkctl.probe import choose_peers

    plan = link.setup(prof, h, backend, dry_run=True)
    changes = "; ".join(c.summary for c in plan.plan.changes) or "nothing to do"
    needed, why = _calibration_needed(h, prep)
    r = svc.install(prof, h, prep.paths, root=root, dry_run=True, live=True)
    files = ", ".join(f"{f.action} {f.path}" for f in r.files)
    cmds = "; ".join(" ".join(c) for c in r.commands)
    peers = ", ".join(p.name for p in choose_peers(prof, h))
    return [
        Stage("link", not plan.nothing_to_do, f"would apply: {changes}"),
        Stage("calibration", needed, f"would calibrate: {why}" if needed else why),
        Stage("services", r.changed, f"would write {files}; would run {cmds}"),
        Stage("peer", True, f"would wait up to {opts.wait_s:g} s for the probe gate ({peers})"),
        Stage(
            "serve",
            False,
            f"would wait up to {opts.serve_wait_s:g} s for {reach(prof, h).endpoint}",
        ),
    ]
