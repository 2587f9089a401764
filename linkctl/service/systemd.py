"""systemd (Linux): units in /etc/systemd/system, systemctl through the runner."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from linkctl.service.base import Action, FileAction, UnitStatus
from linkctl.service.render import (
    RUNTIME_UNIT_DIR,
    SERVE_STATE_DIR,
    SYSTEMD_UNITS,
    UNIT_DIR,
    render_systemd,
)

if TYPE_CHECKING:
    from linkctl.core.profile import HostSpec, Profile
    from linkctl.core.runner import Runner
    from linkctl.service.render import ServicePaths


class Systemd:
    name = "systemd"
    tool = "systemctl"  # the command it is driven with
    dynamic_user = True
    extra_dirs: tuple[str, ...] = ()
    start_hint = "systemctl enable --now"
    serve_state_dir: str | None = SERVE_STATE_DIR
    # The groups DynamicUser= units are given (systemd docs/UIDS-GIDS.md).
    serve_gids: tuple[int, int] | None = (61184, 65519)

    def render(self, profile: Profile, host: HostSpec, paths: ServicePaths) -> dict[str, str]:
        return render_systemd(profile, host, paths)

    def service_names(self) -> list[str]:
        return list(SYSTEMD_UNITS)

    def install_commands(
        self, names: list[str], files: list[FileAction], boot: bool = True
    ) -> list[list[str]]:
        changed = [f for f in files if f.action != Action.UNCHANGED]
        cmds: list[list[str]] = []
        if changed:
            cmds.append(["systemctl", "daemon-reload"])
        # --no-block: the link unit's gate may wait minutes for the peer. Runtime units
        # (no boot) are started, never enabled: nothing of them survives a reboot.
        start = ["enable", "--now"] if boot else ["start"]
        cmds.append(["systemctl", *start, "--no-block", *names])
        units_changed = [
            Path(f.path).name for f in changed if f.path.startswith((UNIT_DIR, RUNTIME_UNIT_DIR))
        ]
        if units_changed:
            cmds.append(["systemctl", "try-restart", "--no-block", *units_changed])
        return cmds

    def uninstall_commands(self, names: list[str]) -> tuple[list[list[str]], list[list[str]]]:
        return (
            [["systemctl", "disable", "--now", *names]],
            [["systemctl", "daemon-reload"], ["systemctl", "reset-failed", *names]],
        )

    def purge_commands(self, names: list[str]) -> list[list[str]]:
        # What the stopped units wrote themselves (StateDirectory=, CacheDirectory=; with
        # DynamicUser= under /var/lib/private): systemctl clean removes exactly those.
        # The link unit's StateDirectory=linkctl is the one state: `down` restores it.
        return [["systemctl", "clean", "--what=state", "--what=cache", "linkctl-serve.service"]]

    def purge_paths(self) -> list[str]:
        return []

    def unit_status(self, runner: Runner, name: str) -> UnitStatus:
        r = runner.run(
            ["systemctl", "show", name, "-p", "ActiveState,SubState,UnitFileState,Result,MainPID"],
            check=False,
            timeout=15,
        )
        props = dict(line.split("=", 1) for line in r.stdout.splitlines() if "=" in line)
        active = props.get("ActiveState", "unknown")
        return UnitStatus(
            name=name,
            active=active,
            ok=active in ("active", "activating", "reloading"),
            sub=props.get("SubState"),
            enabled=props.get("UnitFileState"),
            result=props.get("Result"),
            pid=int(props.get("MainPID", "0") or 0) or None,
        )
