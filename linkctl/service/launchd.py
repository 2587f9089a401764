"""launchd (macOS): daemons in /Library/LaunchDaemons, launchctl through the runner.
launchd cannot order jobs, so each retries (KeepAlive + ThrottleInterval) until what it
needs is there (see render.LAUNCHD_JOB_SPEC)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from linkctl.service.base import Action, FileAction, UnitStatus
from linkctl.service.render import (
    LABEL_PREFIX,
    LAUNCHD_DIR,
    LAUNCHD_JOB_SPEC,
    LAUNCHD_JOBS,
    LAUNCHD_LOG_DIR,
    LAUNCHD_RUNTIME_DIR,
    label,
    render_launchd,
)

if TYPE_CHECKING:
    from linkctl.core.profile import HostSpec, Profile
    from linkctl.core.runner import Runner
    from linkctl.service.render import ServicePaths


class Launchd:
    name = "launchd"
    tool = "launchctl"  # the command it is driven with
    dynamic_user = False
    # launchd opens the log files, not their directory.
    extra_dirs: tuple[str, ...] = (LAUNCHD_LOG_DIR,)
    start_hint = "launchctl bootstrap system"
    serve_state_dir: str | None = None  # the serve daemon writes the one state dir
    serve_gids: tuple[int, int] | None = None  # the serve daemon runs as root

    def render(self, profile: Profile, host: HostSpec, paths: ServicePaths) -> dict[str, str]:
        return render_launchd(profile, host, paths)

    def service_names(self) -> list[str]:
        return [label(j) for j in LAUNCHD_JOBS]

    def install_commands(
        self, names: list[str], files: list[FileAction], boot: bool = True
    ) -> list[list[str]]:
        # boot=False needs nothing else: the plists are in LAUNCHD_RUNTIME_DIR, which
        # launchd does not read at boot.
        cmds: list[list[str]] = []
        for f in files:
            if not f.path.startswith((LAUNCHD_DIR, LAUNCHD_RUNTIME_DIR)):
                continue
            lab = Path(f.path).stem
            if f.action == Action.REMOVE:
                cmds.append(["launchctl", "bootout", f"system/{lab}"])
                continue
            if f.action != Action.UNCHANGED:
                # bootout is allowed to fail (not loaded yet); bootstrap loads the new plist.
                cmds.append(["launchctl", "bootout", f"system/{lab}"])
            cmds.append(["launchctl", "enable", f"system/{lab}"])
            cmds.append(["launchctl", "bootstrap", "system", f.path])
        return cmds

    def uninstall_commands(self, names: list[str]) -> tuple[list[list[str]], list[list[str]]]:
        return [["launchctl", "bootout", f"system/{n}"] for n in reversed(names)], []

    def purge_commands(self, names: list[str]) -> list[list[str]]:
        return []

    def purge_paths(self) -> list[str]:
        # launchd itself opens StandardOutPath (render.LAUNCHD_JOB_SPEC's log files).
        return [f"{LAUNCHD_LOG_DIR}/linkctl-{job}.log" for job in LAUNCHD_JOBS]

    def unit_status(self, runner: Runner, name: str) -> UnitStatus:
        r = runner.run(["launchctl", "print", f"system/{name}"], check=False, timeout=15)
        if not r.ok:
            return UnitStatus(name=name, active="not loaded", ok=False)
        props: dict[str, str] = {}
        for line in r.stdout.splitlines():
            line = line.strip()
            if " = " in line and not line.endswith("{"):
                k, v = line.split(" = ", 1)
                props.setdefault(k, v)
        state = props.get("state", "unknown")
        job = name.removeprefix(LABEL_PREFIX)
        one_shot = LAUNCHD_JOB_SPEC.get(job, ("", "always"))[1] == "on-failure"
        last = props.get("last exit code")
        return UnitStatus(
            name=name,
            active=state,
            ok=state == "running" or (one_shot and last in ("0", "(never exited)")),
            result=last,
            pid=int(props["pid"]) if props.get("pid", "").isdigit() else None,
        )
