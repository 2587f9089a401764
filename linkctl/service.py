"""Boot-time services: systemd units (Linux) and launchd daemons (macOS).

``render`` is pure: profile + host + paths in, {absolute target path: file text}
out, from the templates shipped in ``linkctl/data/systemd/`` and ``linkctl/data/launchd/``.
``install`` writes that set into a root directory (``/`` is the real system) with every check first
(refuse, exit 2, nothing written), backups of anything foreign it overwrites
(``FILE.linkctl-bak``), idempotency by content, and a manifest so that
``uninstall`` puts the root back exactly as it was. Only when the root is ``/``
does it talk to the service manager (systemctl / launchctl, through the runner).

Units, both roles (Linux):
  linkctl-link.service       oneshot: setup, then probe as the gate
  linkctl-responder.service  the probe responder the peer's gate measures against
  linkctl-serve.service      rpc host: rpc-server; head: llama-server (linkctl serve)
Daemons (macOS): com.linkctl.{link,probe,responder,serve}; launchd cannot order
jobs, so each retries (KeepAlive + ThrottleInterval) until what it needs is there.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import stat
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any
from xml.sax.saxutils import escape as xml_escape

from linkctl.errors import InputError
from linkctl.llama import RPC_NAMES
from linkctl.paths import SYSTEM_PROFILE_DIR, shipped
from linkctl.profile import HostSpec, Profile
from linkctl.runner import Runner, default_runner

UNIT_DIR = "/etc/systemd/system"
LAUNCHD_DIR = "/Library/LaunchDaemons"
LAUNCHD_LOG_DIR = "/Library/Logs"
PROFILE_DIR = str(SYSTEM_PROFILE_DIR)
MANIFEST = "/var/lib/linkctl/service/manifest.json"
STATE_DIR = "/var/lib/linkctl"
BACKUP_SUFFIX = ".linkctl-bak"
SYSTEMD_UNITS = ("linkctl-link.service", "linkctl-responder.service", "linkctl-serve.service")
LAUNCHD_JOBS = ("link", "probe", "responder", "serve")
LABEL_PREFIX = "com.linkctl."
DEFAULT_WAIT_CARRIER_S = 120.0
# launchd's PATH is /usr/bin:/bin:/usr/sbin:/sbin; iperf3 comes from Homebrew.
LAUNCHD_PATH = "/opt/homebrew/bin:/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin"
GENERATED = "Rendered by `linkctl service install`; edit the template, not this file."


def template_dir(kind: str) -> Path:
    """The shipped systemd/ or launchd/ templates (package data, linkctl/data/)."""
    d = shipped(kind)
    if not d.is_dir():
        raise InputError(
            f"service templates not found at {d}",
            "reinstall linkctl: the package is missing its data files",
        )
    return d


def manager_for(host: HostSpec) -> str:
    return "systemd" if host.os == "linux" else "launchd"


def label(job: str) -> str:
    return LABEL_PREFIX + job


# ---- rendering (pure) ----------------------------------------------------------------


@dataclass(frozen=True)
class ServicePaths:
    """Where things are on the machine the services run on (absolute paths there)."""

    linkctl_bin: str
    llama_bin_dir: str
    profile_path: str
    # Text to install at profile_path; None when the profile already lives there.
    profile_text: str | None = None
    state_dir: str = STATE_DIR
    wait_carrier_s: float = DEFAULT_WAIT_CARRIER_S
    # Linux: None = DynamicUser; "root" = root without capabilities; else User=NAME.
    # macOS: None/"root" = root; else UserName=NAME.
    serve_user: str | None = None


_PLACEHOLDER = re.compile(r"\{([a-z_]+)\}")


def fill(template: str, values: dict[str, str], name: str = "template") -> str:
    """Replace {name} placeholders; an unknown one is a template bug, said plainly."""
    missing = sorted(set(_PLACEHOLDER.findall(template)) - values.keys())
    if missing:
        raise InputError(f"{name}: unknown placeholder(s) {', '.join(missing)}")
    return _PLACEHOLDER.sub(lambda m: values[m.group(1)], template)


def device_unit(ifname: str) -> str:
    """systemd's device unit for a network interface, escaped like `systemd-escape --path`."""
    out = []
    for ch in ifname:
        if ch.isascii() and (ch.isalnum() or ch in ":_."):
            out.append(ch)
        else:
            out.append("".join(f"\\x{b:02x}" for b in ch.encode()))
    return f"sys-subsystem-net-devices-{''.join(out)}.device"


_SAFE_ARG = re.compile(r"^[A-Za-z0-9_@+=:,./-]+$")


def systemd_quote(arg: str) -> str:
    """One argv element for ExecStart= (specifiers and variables escaped)."""
    arg = arg.replace("%", "%%").replace("$", "$$")
    if _SAFE_ARG.match(arg):
        return arg
    return '"' + arg.replace("\\", "\\\\").replace('"', '\\"') + '"'


def systemd_cmd(argv: list[str]) -> str:
    return " ".join(systemd_quote(a) for a in argv)


def _argv(paths: ServicePaths, verb: str, host: HostSpec, *extra: str) -> list[str]:
    return [paths.linkctl_bin, verb, "--profile", paths.profile_path, "--host", host.name, *extra]


def _wait(paths: ServicePaths) -> str:
    return f"{paths.wait_carrier_s:g}"


def commands(host: HostSpec, paths: ServicePaths) -> dict[str, list[str]]:
    """The argv each service runs, by job name (link = setup, probe = the gate)."""
    return {
        "link": _argv(paths, "setup", host, "--wait-carrier", _wait(paths)),
        "probe": _argv(paths, "probe", host),
        "responder": _argv(paths, "responder", host),
        "serve": _argv(paths, "serve", host),
    }


def _ip_filter(profile: Profile, host: HostSpec, kind: str) -> str:
    allow = f"IPAddressDeny=any\nIPAddressAllow=localhost {profile.link.subnet}"
    if kind == "serve" and host.role == "head" and not profile.serve.host.is_loopback:
        return (
            f"# No IP filter: llama-server's API listens on {profile.serve.host}, outside the link."
        )
    return "# Traffic only over the direct link (and loopback).\n" + allow


def _identity(paths: ServicePaths) -> str:
    user = paths.serve_user
    if user is None:
        return (
            "# A throwaway user, allocated at start (no account to create or remove).\n"
            "DynamicUser=yes"
        )
    if user == "root":
        return (
            "# Root without any capability: the interpreter or a binary is not readable by\n"
            "# other users, so a dedicated user could not run it (see `linkctl service status`).\n"
            "User=root"
        )
    return f"User={user}"


def render_systemd(profile: Profile, host: HostSpec, paths: ServicePaths) -> dict[str, str]:
    cmds = commands(host, paths)
    serve_what = (
        f"rpc-server on {host.rpc_endpoint}"
        if host.role == "rpc"
        else f"llama-server on {profile.serve.host}:{profile.serve.port} "
        f"with rpc {', '.join(h.rpc_endpoint for h in profile.rpc_hosts)}"
    )
    common = {
        "generated": GENERATED,
        "profile": profile.name,
        "host": host.name,
        "iface": host.interface,
        "address": str(host.address),
        "device_unit": device_unit(host.interface),
        "state_dir": paths.state_dir,
    }
    values = {
        "linkctl-link.service": {
            **common,
            "setup_cmd": systemd_cmd(cmds["link"]),
            "probe_cmd": systemd_cmd(cmds["probe"]),
            "ip_filter": _ip_filter(profile, host, "link"),
        },
        "linkctl-responder.service": {
            **common,
            "responder_cmd": systemd_cmd(cmds["responder"]),
            "identity": _identity(paths),
            "ip_filter": _ip_filter(profile, host, "responder"),
        },
        "linkctl-serve.service": {
            **common,
            "serve_what": serve_what,
            "serve_cmd": systemd_cmd(cmds["serve"]),
            "serve_state_dir": "/var/lib/linkctl-serve",
            "cache_dir": "/var/cache/linkctl-serve",
            "llama_bin_dir": systemd_quote(paths.llama_bin_dir),
            "identity": _identity(paths),
            "ip_filter": _ip_filter(profile, host, "serve"),
        },
    }
    tdir = template_dir("systemd")
    out = {}
    for unit in SYSTEMD_UNITS:
        text = (tdir / f"{unit}.in").read_text()
        out[f"{UNIT_DIR}/{unit}"] = fill(text, values[unit], f"systemd/{unit}.in")
    return out


_LAUNCHD_JOB = {
    # job: (what, KeepAlive, ThrottleInterval, ProcessType)
    "link": ("the direct link (setup, after waiting for carrier)", "on-failure", 30, "Background"),
    "probe": ("the probe gate (retried until it passes)", "on-failure", 30, "Background"),
    "responder": ("the probe responder", "always", 5, "Background"),
    "serve": ("linkctl serve", "always", 30, "Interactive"),
}


def _plist_strings(items: list[str], indent: str = "\t\t") -> str:
    return "\n".join(f"{indent}<string>{xml_escape(a)}</string>" for a in items)


def _plist_env(env: dict[str, str]) -> str:
    return "\n".join(
        f"\t\t<key>{xml_escape(k)}</key>\n\t\t<string>{xml_escape(v)}</string>"
        for k, v in env.items()
    )


def render_launchd(profile: Profile, host: HostSpec, paths: ServicePaths) -> dict[str, str]:
    cmds = commands(host, paths)
    text = (template_dir("launchd") / "com.linkctl.daemon.plist.in").read_text()
    out = {}
    for job in LAUNCHD_JOBS:
        what, keep, throttle, ptype = _LAUNCHD_JOB[job]
        env = {"PATH": LAUNCHD_PATH, "LINKCTL_STATE_DIR": paths.state_dir}
        if job == "serve":
            env["LINKCTL_LLAMA_BIN"] = paths.llama_bin_dir
        user = ""
        if job == "serve" and paths.serve_user not in (None, "root"):
            user = f"\t<key>UserName</key>\n\t<string>{xml_escape(paths.serve_user)}</string>\n"
        keep_alive = (
            "\t<true/>"
            if keep == "always"
            else "\t<dict>\n\t\t<key>SuccessfulExit</key>\n\t\t<false/>\n\t</dict>"
        )
        values = {
            "generated": GENERATED.replace("`", ""),
            "what": what,
            "profile": xml_escape(profile.name),
            "host": xml_escape(host.name),
            "label": label(job),
            "program_arguments": _plist_strings(cmds[job]),
            "environment": _plist_env(env),
            "user_name": user,
            "keep_alive": keep_alive,
            "throttle": str(throttle),
            "process_type": ptype,
            "log_path": f"{LAUNCHD_LOG_DIR}/linkctl-{job}.log",
        }
        out[f"{LAUNCHD_DIR}/{label(job)}.plist"] = fill(text, values, "launchd plist template")
    return out


def render(profile: Profile, host: HostSpec, paths: ServicePaths) -> dict[str, str]:
    """Every file the services need, by absolute target path (profile copy included)."""
    files = (
        render_systemd(profile, host, paths)
        if manager_for(host) == "systemd"
        else render_launchd(profile, host, paths)
    )
    if paths.profile_text is not None:
        files[paths.profile_path] = paths.profile_text
    return files


def service_names(host: HostSpec) -> list[str]:
    """systemd unit names or launchd labels, in start order."""
    if manager_for(host) == "systemd":
        return list(SYSTEMD_UNITS)
    return [label(j) for j in LAUNCHD_JOBS]


# ---- paths on the target ---------------------------------------------------------------


def in_root(root: Path, path: str) -> Path:
    return root / path.lstrip("/")


def default_linkctl_bin() -> str:
    """The console script that is running (absolute), else the one on PATH or beside Python."""
    argv0 = Path(sys.argv[0])
    if argv0.name == "linkctl" and argv0.is_file():
        return os.path.abspath(argv0)
    found = shutil.which("linkctl")
    if found:
        return os.path.abspath(found)
    beside = Path(sys.executable).parent / "linkctl"
    return str(beside)


def default_llama_bin_dir(host: HostSpec) -> str | None:
    """Where `linkctl serve` would find this host's server binary now (pinned in the unit)."""
    try:
        from linkctl.llama import find_bins
    except ImportError:  # pragma: no cover - llama.py is part of the package
        return host.llama_bin_dir
    bins = find_bins(host.llama_bin_dir, versions=False)
    b = bins.rpc_server if host.role == "rpc" else bins.llama_server
    return str(Path(b.path).parent) if b else None


def _shebang(path: Path) -> str | None:
    try:
        with path.open("rb") as f:
            first = f.readline(256)
    except OSError:
        return None
    if not first.startswith(b"#!"):
        return None
    parts = first[2:].decode(errors="replace").split()
    return parts[0] if parts else None


def _resolve_in(root: Path, path: str, depth: int = 0) -> Path:
    """``path`` on the target, following symlinks inside ``root`` (absolute links re-rooted)."""
    p = in_root(root, path)
    if depth < 16 and p.is_symlink():
        target = os.readlink(p)
        nxt = target if target.startswith("/") else str(Path(path).parent / target)
        return _resolve_in(root, os.path.normpath(nxt), depth + 1)
    return p


def others_can_reach(root: Path, path: str, need: int) -> bool:
    """Whether a user other than the owner can reach ``path`` (x on every directory
    below ``root``) and has ``need`` (stat.S_IROTH / S_IXOTH) on it."""
    target = _resolve_in(root, path)
    try:
        rel = target.relative_to(root)
    except ValueError:
        return False
    cur = root
    for part in rel.parts[:-1]:
        cur = cur / part
        if cur.is_symlink():
            cur = cur.resolve()
        try:
            if not cur.stat().st_mode & stat.S_IXOTH:
                return False
        except OSError:
            return False
    try:
        return bool(target.stat().st_mode & need)
    except OSError:
        return False


@dataclass
class Preflight:
    paths: ServicePaths
    notes: list[str] = field(default_factory=list)


def check_paths(
    root: Path,
    profile: Profile,
    host: HostSpec,
    paths: ServicePaths,
    *,
    package_dir: str | None = None,
) -> Preflight:
    """Everything the services run must exist in ``root`` where they run it; refuse otherwise.
    Also picks the serve identity (dedicated user where the files allow it)."""
    notes: list[str] = []
    for what, p in (("linkctl", paths.linkctl_bin), ("llama.cpp bin dir", paths.llama_bin_dir)):
        if not p.startswith("/"):
            raise InputError(f"{what} path {p!r} is not absolute", "give an absolute path")
    exe = _resolve_in(root, paths.linkctl_bin)
    if not (exe.is_file() and os.access(exe, os.X_OK)):
        raise InputError(
            f"linkctl is not at {paths.linkctl_bin} in {root} (the units would run it there)",
            "install linkctl there or pass --linkctl-bin PATH",
        )
    interp = _shebang(exe)
    if interp and not (_resolve_in(root, interp).is_file()):
        raise InputError(
            f"{paths.linkctl_bin} starts {interp}, which is not in {root}",
            "reinstall linkctl so its interpreter exists there",
        )
    names = RPC_NAMES if host.role == "rpc" else ("llama-server",)
    bins = [n for n in names if _is_exe(in_root(root, f"{paths.llama_bin_dir}/{n}"))]
    if not bins:
        raise InputError(
            f"no {' or '.join(names)} in {paths.llama_bin_dir} (in {root}); "
            f"linkctl serve on {host.name} ({host.role}) would run it from there",
            "run scripts/build-llama.sh, or pass --llama-bin-dir DIR",
        )
    if host.role == "head" and not any(
        _is_exe(in_root(root, f"{paths.llama_bin_dir}/{n}")) for n in RPC_NAMES
    ):
        notes.append(
            f"no rpc-server beside llama-server in {paths.llama_bin_dir}: serve cannot compare "
            "the local RPC protocol version with the rpc hosts'"
        )
    if host.role == "head":
        from linkctl.serve import serve_auth

        serve_auth(profile, root)  # serve would refuse an open API at every boot
        model = profile.serve.model
        if not model:
            notes.append("serve.model is empty: linkctl serve will refuse until it is set")
        elif not in_root(root, model).is_file():
            notes.append(f"serve.model {model} is not there (yet): serve retries until it is")
    user = paths.serve_user
    if user is None and manager_for(host) == "systemd":
        reach = [
            (paths.linkctl_bin, stat.S_IROTH),
            (interp or paths.linkctl_bin, stat.S_IXOTH),
            (f"{paths.llama_bin_dir}/{bins[0]}", stat.S_IXOTH),
        ]
        if package_dir:
            reach.append((f"{package_dir}/__init__.py", stat.S_IROTH))
        model = profile.serve.model
        if host.role == "head" and model and in_root(root, model).exists():
            reach.append((profile.serve.model, stat.S_IROTH))
        blocked = [p for p, need in reach if not others_can_reach(root, p, need)]
        if host.role == "head" and profile.serve.api_key_file and not blocked:
            user = "root"
            notes.append(
                "serve and responder run as root without capabilities, not as a dedicated user: "
                f"llama-server reads {profile.serve.api_key_file}, which only its owner may "
                "read (or pass --serve-user, an account that owns it)"
            )
        if blocked:
            user = "root"
            notes.append(
                "serve and responder run as root without capabilities, not as a dedicated "
                f"user: other users cannot read {', '.join(blocked)} "
                "(install linkctl and llama.cpp system-wide, e.g. under /opt, to fix)"
            )
    return Preflight(ServicePaths(**{**asdict(paths), "serve_user": user}), notes)


def _is_exe(p: Path) -> bool:
    return p.is_file() and os.access(p, os.X_OK)


# ---- install / uninstall ------------------------------------------------------------


@dataclass
class FileAction:
    path: str
    action: str  # create / update / unchanged / replace (foreign file backed up) / remove / restore
    backup: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class ServiceResult:
    action: str  # install / uninstall
    root: str
    manager: str | None
    profile: str | None
    host: str | None
    dry_run: bool
    files: list[FileAction] = field(default_factory=list)
    dirs_created: list[str] = field(default_factory=list)
    dirs_removed: list[str] = field(default_factory=list)
    commands: list[list[str]] = field(default_factory=list)
    started: bool = False
    serve_user: str | None = None  # None: DynamicUser (systemd) / root (launchd)
    notes: list[str] = field(default_factory=list)

    @property
    def changed(self) -> bool:
        return any(f.action != "unchanged" for f in self.files) or bool(
            self.dirs_created or self.dirs_removed
        )

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["changed"] = self.changed
        return d


def _sha(text: str | bytes) -> str:
    data = text.encode() if isinstance(text, str) else text
    return hashlib.sha256(data).hexdigest()


def load_manifest(root: Path) -> dict[str, Any] | None:
    p = in_root(root, MANIFEST)
    if not p.is_file():
        return None
    try:
        data = json.loads(p.read_text())
        if not isinstance(data["files"], list) or not isinstance(data["dirs"], list):
            raise TypeError("files and dirs must be lists")
        return data
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise InputError(
            f"service manifest {p} is unreadable: {e}", "remove it and re-run"
        ) from None


def _missing_dirs(root: Path, path: str) -> list[str]:
    """Target-absolute directories above ``path`` that do not exist yet, parent first."""
    out = []
    cur = Path(path).parent
    while str(cur) != "/" and not in_root(root, str(cur)).exists():
        out.append(str(cur))
        cur = cur.parent
    return list(reversed(out))


def _write(target: Path, text: str) -> None:
    tmp = target.with_name(target.name + ".linkctl-tmp")
    tmp.write_text(text)
    os.chmod(tmp, 0o644)
    if os.geteuid() == 0:
        os.chown(tmp, 0, 0)  # root:root on Linux, root:wheel on macOS
    os.replace(tmp, target)


def _mkdir(target: Path) -> None:
    target.mkdir(mode=0o755)
    os.chmod(target, 0o755)


def check_os(root: Path, host: HostSpec) -> None:
    if str(root) != "/":
        return
    from linkctl.backend import current_os

    here = current_os()
    if here != host.os:
        raise InputError(
            f"host {host.name} runs {host.os} but this machine is {here}",
            "run install on that host, or render into a directory with --root DIR",
        )


def install(
    profile: Profile,
    host: HostSpec,
    paths: ServicePaths,
    *,
    root: Path = Path("/"),
    dry_run: bool = False,
    runner: Runner | None = None,
    package_dir: str | None = None,
) -> ServiceResult:
    root = Path(root)
    if not root.is_dir():
        raise InputError(f"--root {root} is not a directory", "create it or give another")
    check_os(root, host)
    pre = check_paths(root, profile, host, paths, package_dir=package_dir)
    paths = pre.paths
    manager = manager_for(host)
    result = ServiceResult(
        "install", str(root), manager, profile.name, host.name, dry_run, notes=list(pre.notes)
    )
    result.serve_user = paths.serve_user
    files = render(profile, host, paths)
    old = load_manifest(root) or {"files": [], "dirs": []}
    old_files = {f["path"]: f for f in old["files"]}
    entries: list[dict[str, Any]] = []
    dirs: list[str] = list(old["dirs"])
    ops: list[Callable[[], None]] = []
    undo: list[Callable[[], None]] = []
    planned: set[str] = set()

    def need_dirs(path: str) -> None:
        for d in _missing_dirs(root, path):
            if d in planned:
                continue
            planned.add(d)
            ops.append(_mkdir_op(in_root(root, d), undo))
            if d not in dirs:
                dirs.append(d)
                result.dirs_created.append(d)

    for path, text in files.items():
        target = in_root(root, path)
        mine = old_files.get(path)
        ours = bool(mine) and not mine.get("preexisting")
        entry = {"path": path, "sha256": _sha(text), "backup": None, "preexisting": False}
        if ours:
            entry["backup"] = mine.get("backup")
        if target.is_file() and target.read_text(errors="replace") == text:
            if not ours:
                entry["preexisting"] = True  # already there, identical: not ours to remove
            result.files.append(FileAction(path, "unchanged", entry["backup"]))
        elif target.exists() and not ours:
            bak = path + BACKUP_SUFFIX
            if in_root(root, bak).exists():
                raise InputError(
                    f"{path} would be replaced but a backup {bak} already exists",
                    "move one of them away first",
                )
            entry["backup"] = bak
            result.files.append(FileAction(path, "replace", bak))
            ops.append(_backup_op(target, in_root(root, bak), undo))
            ops.append(_write_op(target, text, undo))
        else:
            need_dirs(path)
            result.files.append(FileAction(path, "update" if target.exists() else "create"))
            ops.append(_write_op(target, text, undo))
        entries.append(entry)
    # Files an earlier install wrote that this one no longer renders (another profile).
    for path, f in old_files.items():
        if path not in files:
            result.files.append(FileAction(path, "remove", f.get("backup")))
            ops.append(_remove_op(root, f, undo))
    if manager == "launchd":
        need_dirs(LAUNCHD_LOG_DIR + "/any.log")  # launchd opens log files, not directories
    need_dirs(MANIFEST)
    manifest = {
        "version": 1,
        "manager": manager,
        "profile": profile.name,
        "host": host.name,
        "services": service_names(host),
        "files": entries,
        "dirs": dirs,
    }
    manifest_text = json.dumps(manifest, indent=2) + "\n"
    mpath = in_root(root, MANIFEST)
    if not (mpath.is_file() and mpath.read_text() == manifest_text):
        ops.append(_write_op(mpath, manifest_text, undo))
    live = str(root) == "/"
    result.commands = _install_commands(host, result) if live else []
    if not live:
        result.notes.append(
            f"--root {root}: files only; nothing enabled or started "
            f"({'systemctl enable --now' if manager == 'systemd' else 'launchctl bootstrap system'}"
            " on the target does that)"
        )
    if dry_run:
        return result
    try:
        for op in ops:
            op()
    except OSError as e:
        for u in reversed(undo):
            with contextlib.suppress(OSError):
                u()
        raise InputError(f"install into {root} failed and was undone: {e}") from None
    if live:
        runner = runner or default_runner()
        for argv in result.commands:
            run_live(runner, argv)
        result.started = True
    return result


def _backup_op(target: Path, bak: Path, undo: list) -> Callable[[], None]:
    def op() -> None:
        os.replace(target, bak)
        undo.append(lambda: os.replace(bak, target))

    return op


def _write_op(target: Path, text: str, undo: list) -> Callable[[], None]:
    def op() -> None:
        before = target.read_bytes() if target.is_file() else None
        _write(target, text)
        undo.append(lambda: target.write_bytes(before) if before is not None else target.unlink())

    return op


def _mkdir_op(target: Path, undo: list) -> Callable[[], None]:
    def op() -> None:
        _mkdir(target)
        undo.append(lambda: target.rmdir())

    return op


def _remove_op(root: Path, entry: dict[str, Any], undo: list) -> Callable[[], None]:
    def op() -> None:
        _remove_entry(root, entry)

    return op


def _remove_entry(root: Path, entry: dict[str, Any]) -> str:
    """Undo one manifest entry: delete our file, put back what it replaced."""
    target = in_root(root, entry["path"])
    if entry.get("preexisting"):
        return "kept (was there before)"
    if target.exists() or target.is_symlink():
        target.unlink()
    bak = entry.get("backup")
    if bak and in_root(root, bak).exists():
        os.replace(in_root(root, bak), target)
        return "restored"
    return "removed"


def _install_commands(host: HostSpec, result: ServiceResult) -> list[list[str]]:
    names = service_names(host)
    changed = [f for f in result.files if f.action != "unchanged"]
    if manager_for(host) == "systemd":
        cmds: list[list[str]] = []
        if changed:
            cmds.append(["systemctl", "daemon-reload"])
        # --no-block: the link unit's gate may wait minutes for the peer.
        cmds.append(["systemctl", "enable", "--now", "--no-block", *names])
        units_changed = [Path(f.path).name for f in changed if f.path.startswith(UNIT_DIR)]
        if units_changed:
            cmds.append(["systemctl", "try-restart", "--no-block", *units_changed])
        return cmds
    cmds = []
    for f in result.files:
        if not f.path.startswith(LAUNCHD_DIR):
            continue
        lab = Path(f.path).stem
        if f.action == "remove":
            cmds.append(["launchctl", "bootout", f"system/{lab}"])
            continue
        if f.action != "unchanged":
            # bootout is allowed to fail (not loaded yet); bootstrap loads the new plist.
            cmds.append(["launchctl", "bootout", f"system/{lab}"])
        cmds.append(["launchctl", "enable", f"system/{lab}"])
        cmds.append(["launchctl", "bootstrap", "system", f.path])
    return cmds


def run_live(runner: Runner, argv: list[str]) -> None:
    """Manager commands on the real system: bootout/bootstrap of something not loaded
    (or already loaded) is not an error for an idempotent install."""
    r = runner.run(argv, timeout=120, check=False)
    if r.ok:
        return
    tolerated = argv[:2] in (["launchctl", "bootout"], ["launchctl", "bootstrap"])
    if not tolerated:
        from linkctl.runner import CommandFailed

        raise CommandFailed(r)


def uninstall(
    *, root: Path = Path("/"), dry_run: bool = False, runner: Runner | None = None
) -> ServiceResult:
    root = Path(root)
    manifest = load_manifest(root)
    if manifest is None:
        res = ServiceResult("uninstall", str(root), None, None, None, dry_run)
        res.notes.append(f"nothing installed in {root} (no {MANIFEST})")
        return res
    res = ServiceResult(
        "uninstall", str(root), manifest["manager"], manifest["profile"], manifest["host"], dry_run
    )
    live = str(root) == "/"
    names = manifest.get("services", [])
    if live:
        if manifest["manager"] == "systemd":
            res.commands = [
                ["systemctl", "disable", "--now", *names],
                ["systemctl", "daemon-reload"],
                ["systemctl", "reset-failed", *names],
            ]
        else:
            res.commands = [["launchctl", "bootout", f"system/{n}"] for n in reversed(names)]
    for f in manifest["files"]:
        if f.get("preexisting"):
            res.files.append(FileAction(f["path"], "unchanged"))
        else:
            res.files.append(
                FileAction(f["path"], "restore" if f.get("backup") else "remove", f.get("backup"))
            )
    dirs = [d for d in reversed(manifest["dirs"]) if in_root(root, d).is_dir()]
    if dry_run:
        res.dirs_removed = dirs
        return res
    runner = runner or default_runner()
    systemd = manifest["manager"] == "systemd"
    if live:
        # Stop first, so nothing runs from files about to go.
        for argv in res.commands[:1] if systemd else res.commands:
            run_live(runner, argv)
    for f in manifest["files"]:
        _remove_entry(root, f)
    in_root(root, MANIFEST).unlink()
    for d in dirs:
        p = in_root(root, d)
        try:
            p.rmdir()
            res.dirs_removed.append(d)
        except OSError:
            res.notes.append(f"kept {d}: not empty")
    if live and systemd:
        for argv in res.commands[1:]:
            runner.run(argv, timeout=60, check=False)
    return res


# ---- status ----------------------------------------------------------------------------


@dataclass
class ServiceStatus:
    root: str
    installed: bool
    manager: str | None = None
    profile: str | None = None
    host: str | None = None
    files: list[dict[str, Any]] = field(default_factory=list)
    services: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        if not self.installed:
            return False
        if any(f["state"] != "ok" for f in self.files):
            return False
        return all(s.get("ok", True) for s in self.services)

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["ok"] = self.ok
        return d


def status(*, root: Path = Path("/"), runner: Runner | None = None) -> ServiceStatus:
    root = Path(root)
    manifest = load_manifest(root)
    if manifest is None:
        return ServiceStatus(str(root), False, notes=[f"not installed in {root}"])
    st = ServiceStatus(str(root), True, manifest["manager"], manifest["profile"], manifest["host"])
    for f in manifest["files"]:
        p = in_root(root, f["path"])
        if not p.is_file():
            state = "missing"
        elif _sha(p.read_bytes()) != f["sha256"]:
            state = "modified"
        else:
            state = "ok"
        st.files.append({"path": f["path"], "state": state, "backup": f.get("backup")})
    if str(root) != "/":
        st.notes.append(f"--root {root}: files only; services are not queried")
        return st
    runner = runner or default_runner()
    for name in manifest.get("services", []):
        if manifest["manager"] == "systemd":
            st.services.append(_systemd_state(runner, name))
        else:
            st.services.append(_launchd_state(runner, name))
    return st


def _systemd_state(runner: Runner, unit: str) -> dict[str, Any]:
    r = runner.run(
        ["systemctl", "show", unit, "-p", "ActiveState,SubState,UnitFileState,Result,MainPID"],
        check=False,
        timeout=15,
    )
    props = dict(line.split("=", 1) for line in r.stdout.splitlines() if "=" in line)
    active = props.get("ActiveState", "unknown")
    return {
        "name": unit,
        "active": active,
        "sub": props.get("SubState"),
        "enabled": props.get("UnitFileState"),
        "result": props.get("Result"),
        "pid": int(props.get("MainPID", "0") or 0) or None,
        "ok": active in ("active", "activating", "reloading"),
    }


def _launchd_state(runner: Runner, lab: str) -> dict[str, Any]:
    r = runner.run(["launchctl", "print", f"system/{lab}"], check=False, timeout=15)
    if not r.ok:
        return {"name": lab, "active": "not loaded", "ok": False}
    props: dict[str, str] = {}
    for line in r.stdout.splitlines():
        line = line.strip()
        if " = " in line and not line.endswith("{"):
            k, v = line.split(" = ", 1)
            props.setdefault(k, v)
    state = props.get("state", "unknown")
    job = lab.removeprefix(LABEL_PREFIX)
    one_shot = _LAUNCHD_JOB.get(job, ("", "always"))[1] == "on-failure"
    last = props.get("last exit code")
    ok = state == "running" or (one_shot and last in ("0", "(never exited)"))
    return {
        "name": lab,
        "active": state,
        "pid": int(props["pid"]) if props.get("pid", "").isdigit() else None,
        "result": last,
        "ok": ok,
    }
