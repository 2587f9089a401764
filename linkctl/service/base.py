"""The records every service manager speaks in and the one interface each implements
(systemd.py, launchd.py); manager.py picks one for a host. Nothing here imports an
implementation, so the implementations can import this."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from enum import StrEnum
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from linkctl.core.profile import HostSpec, Profile
    from linkctl.core.runner import Runner
    from linkctl.service.render import ServicePaths


class Action(StrEnum):
    """What install or uninstall does to one file (the JSON value is the string)."""

    CREATE = "create"
    UPDATE = "update"
    UNCHANGED = "unchanged"
    REPLACE = "replace"  # a foreign file backed up, ours written in its place
    REMOVE = "remove"
    RESTORE = "restore"  # ours removed, the foreign file it replaced put back


@dataclass
class FileAction:
    path: str
    action: Action
    backup: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class UnitStatus:
    """One service as its manager reports it, the same fields for systemd and launchd
    (a field the manager has no notion of is None)."""

    name: str
    active: str  # systemd ActiveState / launchd state, or "not loaded"
    ok: bool  # running, or a one-shot that finished cleanly
    sub: str | None = None  # systemd SubState
    enabled: str | None = None  # systemd UnitFileState
    result: str | None = None  # systemd Result / launchd last exit code
    pid: int | None = None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class ServiceManager(Protocol):
    name: str  # "systemd" / "launchd", as recorded in the manifest
    tool: str  # the command that drives it (systemctl / launchctl)
    # Whether the manager can allocate a throwaway user at start (systemd DynamicUser=).
    dynamic_user: bool
    # Directories the manager needs besides the files' own (launchd opens log files).
    extra_dirs: tuple[str, ...]
    # What enables and starts the services on the target, for the --root note.
    start_hint: str
    # Where the installed serve keeps its records (its status and watch), when that is
    # not the one state dir: systemd's StateDirectory= of the unprivileged serve unit.
    serve_state_dir: str | None
    # The group ids the serve unit may run under (a lowest, highest pair), where the
    # manager picks them at start: systemd's DynamicUser= range; None where the unit's
    # user is fixed (launchd runs it as root).
    serve_gids: tuple[int, int] | None

    def render(self, profile: Profile, host: HostSpec, paths: ServicePaths) -> dict[str, str]:
        """The manager's own files (units / plists) by absolute target path."""
        ...

    def service_names(self) -> list[str]:
        """Unit names or labels, in start order."""
        ...

    def install_commands(
        self, names: list[str], files: list[FileAction], boot: bool = True
    ) -> list[list[str]]:
        """Commands that load what an install changed and start everything (and, with
        ``boot``, have it start at every boot)."""
        ...

    def uninstall_commands(self, names: list[str]) -> tuple[list[list[str]], list[list[str]]]:
        """(stop before the files go, clean up after they are gone)."""
        ...

    def purge_commands(self, names: list[str]) -> list[list[str]]:
        """`linkctl down`: remove what the stopped services wrote through the manager
        (run after the stop, before their files go)."""
        ...

    def purge_paths(self) -> list[str]:
        """`linkctl down`: files the manager wrote for the services (logs), to remove."""
        ...

    def unit_status(self, runner: Runner, name: str) -> UnitStatus: ...
