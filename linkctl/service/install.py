"""install / uninstall: the rendered files written into a root directory (``/`` is the
real system) with every check first (refuse, exit 2, nothing written), backups of
anything foreign it overwrites (``FILE.linkctl-bak``), idempotency by content, and a
manifest so that ``uninstall`` puts the root back exactly as it was. Only when the root
is ``/`` does it talk to the service manager (systemctl / launchctl, through the runner)."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from linkctl.core.errors import InputError
from linkctl.core.profile import HostSpec, Profile
from linkctl.core.runner import CommandFailed, Runner, default_runner
from linkctl.service.base import Action, FileAction
from linkctl.service.manager import manager_for, manager_named
from linkctl.service.preflight import check_os, check_paths, in_root
from linkctl.service.render import ServicePaths
from linkctl.service.transaction import Transaction

MANIFEST = "/var/lib/linkctl/service/manifest.json"
BACKUP_SUFFIX = ".linkctl-bak"


def render(profile: Profile, host: HostSpec, paths: ServicePaths) -> dict[str, str]:
    """Every file the services need, by absolute target path (profile copy included)."""
    files = manager_for(host).render(profile, host, paths)
    if paths.profile_text is not None:
        files[paths.profile_path] = paths.profile_text
    return files


@dataclass
class ServiceResult:
    action: Literal["install", "uninstall"]
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
        return any(f.action != Action.UNCHANGED for f in self.files) or bool(
            self.dirs_created or self.dirs_removed
        )

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["changed"] = self.changed
        return d


def sha256(text: str | bytes) -> str:
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


def _backup_in(root: Path, entry: dict[str, Any]) -> Path | None:
    bak = entry.get("backup")
    return in_root(root, bak) if bak else None


def run_live(runner: Runner, argv: list[str]) -> None:
    """Manager commands on the real system: bootout/bootstrap of something not loaded
    (or already loaded) is not an error for an idempotent install."""
    r = runner.run(argv, timeout=120, check=False)
    tolerated = argv[:2] in (["launchctl", "bootout"], ["launchctl", "bootstrap"])
    if not r.ok and not tolerated:
        raise CommandFailed(r)


def install(
    profile: Profile,
    host: HostSpec,
    paths: ServicePaths,
    *,
    root: Path = Path("/"),
    dry_run: bool = False,
    runner: Runner | None = None,
    package_dir: str | None = None,
    live: bool | None = None,
) -> ServiceResult:
    """Write the rendered files into ``root`` and, when ``live`` (default: the root is
    ``/``), load and start them through the manager."""
    root = Path(root)
    if not root.is_dir():
        raise InputError(f"--root {root} is not a directory", "create it or give another")
    check_os(root, host)
    pre = check_paths(root, profile, host, paths, package_dir=package_dir)
    paths = pre.paths
    mgr = manager_for(host)
    result = ServiceResult(
        "install", str(root), mgr.name, profile.name, host.name, dry_run, notes=list(pre.notes)
    )
    result.serve_user = paths.serve_user
    files = render(profile, host, paths)
    old = load_manifest(root) or {"files": [], "dirs": []}
    old_files: dict[str, dict[str, Any]] = {f["path"]: f for f in old["files"]}
    entries: list[dict[str, Any]] = []
    dirs: list[str] = list(old["dirs"])
    tx = Transaction()
    planned: set[str] = set()

    def need_dirs(path: str) -> None:
        for d in _missing_dirs(root, path):
            if d in planned:
                continue
            planned.add(d)
            tx.mkdir(in_root(root, d))
            if d not in dirs:
                dirs.append(d)
                result.dirs_created.append(d)

    for path, text in files.items():
        target = in_root(root, path)
        mine = old_files.get(path)
        ours = mine is not None and not mine.get("preexisting")
        backup: str | None = mine.get("backup") if ours and mine is not None else None
        preexisting = False
        if target.is_file() and target.read_text(errors="replace") == text:
            preexisting = not ours  # already there, identical: not ours to remove
            result.files.append(FileAction(path, Action.UNCHANGED, backup))
        elif target.exists() and not ours:
            backup = path + BACKUP_SUFFIX
            if in_root(root, backup).exists():
                raise InputError(
                    f"{path} would be replaced but a backup {backup} already exists",
                    "move one of them away first",
                )
            result.files.append(FileAction(path, Action.REPLACE, backup))
            tx.backup(target, in_root(root, backup))
            tx.write(target, text)
        else:
            need_dirs(path)
            result.files.append(
                FileAction(path, Action.UPDATE if target.exists() else Action.CREATE)
            )
            tx.write(target, text)
        entries.append(
            {"path": path, "sha256": sha256(text), "backup": backup, "preexisting": preexisting}
        )
    # Files an earlier install wrote that this one no longer renders (another profile).
    for path, f in old_files.items():
        if path not in files:
            result.files.append(FileAction(path, Action.REMOVE, f.get("backup")))
            if not f.get("preexisting"):
                tx.remove(in_root(root, path), _backup_in(root, f))
    for d in mgr.extra_dirs:
        need_dirs(d + "/any")
    need_dirs(MANIFEST)
    manifest = {
        "version": 1,
        "manager": mgr.name,
        "profile": profile.name,
        "host": host.name,
        "services": mgr.service_names(),
        "boot": paths.boot,
        "serve_user": paths.serve_user,  # who the serve unit runs as (None: the manager picks)
        "files": entries,
        "dirs": dirs,
    }
    manifest_text = json.dumps(manifest, indent=2) + "\n"
    mpath = in_root(root, MANIFEST)
    if not (mpath.is_file() and mpath.read_text() == manifest_text):
        tx.write(mpath, manifest_text)
    live = str(root) == "/" if live is None else live
    result.commands = (
        mgr.install_commands(mgr.service_names(), result.files, paths.boot) if live else []
    )
    if not live:
        result.notes.append(
            f"--root {root}: files only; nothing enabled or started "
            f"({mgr.start_hint} on the target does that)"
        )
    if dry_run:
        return result
    try:
        tx.run()
    except OSError as e:
        raise InputError(f"install into {root} failed and was undone: {e}") from None
    if live:
        runner = runner or default_runner()
        for argv in result.commands:
            run_live(runner, argv)
        result.started = True
    return result


def uninstall(
    *,
    root: Path = Path("/"),
    dry_run: bool = False,
    runner: Runner | None = None,
    purge: bool = False,
    live: bool | None = None,
) -> ServiceResult:
    """Stop the services and remove every file install wrote (restoring what it
    replaced). ``purge`` (`linkctl down`): also what the stopped services wrote through
    their manager (systemd's StateDirectory=/CacheDirectory=, launchd's logs)."""
    root = Path(root)
    manifest = load_manifest(root)
    if manifest is None:
        res = ServiceResult("uninstall", str(root), None, None, None, dry_run)
        res.notes.append(f"nothing installed in {root} (no {MANIFEST})")
        return res
    res = ServiceResult(
        "uninstall", str(root), manifest["manager"], manifest["profile"], manifest["host"], dry_run
    )
    live = str(root) == "/" if live is None else live
    names = manifest.get("services", [])
    stop: list[list[str]] = []
    after: list[list[str]] = []
    if live:
        mgr = manager_named(manifest["manager"])
        stop, after = mgr.uninstall_commands(names)
        if purge:
            stop += mgr.purge_commands(names)
        res.commands = stop + after
    for f in manifest["files"]:
        if f.get("preexisting"):
            res.files.append(FileAction(f["path"], Action.UNCHANGED))
        else:
            undo = Action.RESTORE if f.get("backup") else Action.REMOVE
            res.files.append(FileAction(f["path"], undo, f.get("backup")))
    dirs = [d for d in reversed(manifest["dirs"]) if in_root(root, d).is_dir()]
    if dry_run:
        res.dirs_removed = dirs
        return res
    runner = runner or default_runner()
    # Stop first, so nothing runs from files about to go.
    for argv in stop:
        run_live(runner, argv)
    tx = Transaction()
    for f in manifest["files"]:
        if not f.get("preexisting"):
            tx.remove(in_root(root, f["path"]), _backup_in(root, f))
    tx.remove(in_root(root, MANIFEST), None)
    try:
        tx.run()
    except OSError as e:
        raise InputError(f"uninstall from {root} failed and was undone: {e}") from None
    for d in dirs:
        p = in_root(root, d)
        try:
            p.rmdir()
            res.dirs_removed.append(d)
        except OSError:
            res.notes.append(f"kept {d}: not empty")
    for argv in after:
        runner.run(argv, timeout=60, check=False)
    return res
