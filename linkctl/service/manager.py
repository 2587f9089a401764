"""The one place a host's service manager is chosen (callers never branch on it)."""

from __future__ import annotations

from linkctl.core.errors import InputError
from linkctl.core.profile import HostSpec
from linkctl.service.base import ServiceManager
from linkctl.service.launchd import Launchd
from linkctl.service.systemd import Systemd

MANAGERS: dict[str, type[ServiceManager]] = {"systemd": Systemd, "launchd": Launchd}


def manager_named(name: str) -> ServiceManager:
    """The manager a manifest names."""
    cls = MANAGERS.get(name)
    if cls is None:
        raise InputError(
            f"unknown service manager {name!r} in the manifest", "remove it and re-run"
        )
    return cls()


def manager_for(host: HostSpec) -> ServiceManager:
    """systemd on Linux, launchd on macOS."""
    return manager_named("systemd" if host.os == "linux" else "launchd")


def serve_unit_gids(host: HostSpec, serve_user: str | None) -> tuple[int, int] | None:
    """The group ids the serve unit runs under, as installed with ``serve_user`` (the
    manifest's; None: the manager's own pick, systemd's DynamicUser= range), or None
    where they are not known here (a named user with no account on this host)."""
    if serve_user is None:
        return manager_for(host).serve_gids
    if serve_user == "root":
        return (0, 0)
    import pwd

    try:
        gid = pwd.getpwnam(serve_user).pw_gid
    except KeyError:
        return None
    return (gid, gid)
