"""Checks before anything is written: everything the services run must exist in the root
where they will run it (else refuse, exit 2, nothing written), and the serve identity."""

from __future__ import annotations

import os
import shutil
import stat
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

from linkctl.core.errors import InputError
from linkctl.core.profile import HostSpec, Profile
from linkctl.llama.bins import RPC_NAMES
from linkctl.service.manager import manager_for
from linkctl.service.render import ENV, ServicePaths


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
        from linkctl.llama.bins import find_bins
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
    if (
        host.role == "head"
        and manager_for(host).name == "systemd"
        and not _is_exe(in_root(root, ENV))
    ):
        raise InputError(
            f"{ENV} is not in {root}: the serve unit re-probes with it",
            "install coreutils there",
        )
    if host.role == "head":
        from linkctl.serve.auth import serve_auth

        serve_auth(profile, root)  # serve would refuse an open API at every boot
        model = profile.serve.model
        if not model:
            notes.append("serve.model is empty: linkctl serve will refuse until it is set")
        elif not in_root(root, model).is_file():
            notes.append(f"serve.model {model} is not there (yet): serve retries until it is")
    user = paths.serve_user
    if user is None and manager_for(host).dynamic_user:
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


def check_os(root: Path, host: HostSpec) -> None:
    if str(root) != "/":
        return
    from linkctl.net.backend import current_os

    here = current_os()
    if here != host.os:
        raise InputError(
            f"host {host.name} runs {host.os} but this machine is {here}",
            "run install on that host, or render into a directory with --root DIR",
        )
