"""`linkctl down`: everything `linkctl up` did on this host, undone, in reverse.

1. services  stopped, and every file install wrote removed (what it replaced put back),
             with what the services wrote through their manager (systemd's state and
             cache directories, launchd's logs)
2. link      `linkctl teardown`: exactly what setup recorded (the NetworkManager
             connection and the port's previous one, or the address, link state and MTU;
             on macOS the service's settings)
3. state     the state directory as it was before the first up (up's record); paths
             the manager created that did not exist before, removed

Each stage finds its own record, so a second `down` (or one after a half-done up)
has nothing left to do and says so.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from linkctl.core.log import Say
from linkctl.core.profile import HostSpec, Profile
from linkctl.core.runner import Runner
from linkctl.lifecycle import record as up_record
from linkctl.lifecycle.stage import Stage, run_stage

if TYPE_CHECKING:
    from linkctl.net.backend import Backend


@dataclass
class DownResult:
    profile: str
    profile_path: str
    host: str
    dry_run: bool
    stages: list[Stage] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def changed(self) -> bool:
        return any(s.changed for s in self.stages)

    def summary(self) -> str:
        if self.dry_run:
            return "down --dry-run: nothing changed"
        if not self.changed:
            return f"nothing to do: nothing of linkctl is up on {self.host}"
        return f"{self.host} is as it was before `linkctl up`"

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["changed"] = self.changed
        d["summary"] = self.summary()
        return d


def down(
    prof: Profile,
    profile_path: Path,
    h: HostSpec,
    backend: Backend,
    *,
    say: Say,
    runner: Runner | None = None,
    dry_run: bool = False,
    root: Path = Path("/"),
) -> DownResult:
    from linkctl.core.privilege import require_root

    require_root("down removes the services and the link configuration")
    res = DownResult(prof.name, str(profile_path), h.name, dry_run)
    rec = up_record.load_record(prof.name, h.name)
    run_stage(res.stages, say, "services", lambda: _services(prof, h, res, runner, dry_run, root))
    run_stage(res.stages, say, "link", lambda: _link(prof, h, backend, dry_run))
    run_stage(res.stages, say, "state", lambda: _state(rec, dry_run, root))
    return res


def _services(
    prof: Profile, h: HostSpec, res: DownResult, runner: Runner | None, dry_run: bool, root: Path
) -> tuple[bool, str]:
    from linkctl import service as svc

    installed = svc.load_manifest(root)
    if installed is None:
        return False, "none installed"
    if (installed["profile"], installed["host"]) != (prof.name, h.name):
        res.notes.append(
            f"services of {installed['profile']}/{installed['host']} are installed, not of "
            f"{prof.name}/{h.name}: left as they are"
        )
        return False, f"none of {prof.name}/{h.name} installed"
    r = svc.uninstall(root=root, dry_run=dry_run, runner=runner, purge=True, live=True)
    gone = ", ".join(f"{f.action} {f.path}" for f in r.files)
    head = "would stop and remove" if dry_run else "stopped and removed"
    return True, f"{head} ({r.manager}): {gone}"


def _link(prof: Profile, h: HostSpec, backend: Backend, dry_run: bool) -> tuple[bool, str]:
    from linkctl.net import link

    r = link.teardown(prof, h, backend, dry_run=dry_run)
    if r.nothing_to_do:
        return False, f"{h.interface}: nothing of the profile configured"
    head = "would undo" if dry_run else "undid"
    return True, f"{h.interface}: {head} " + "; ".join(c.summary for c in r.plan.changes)


def _state(rec: up_record.UpRecord | None, dry_run: bool, root: Path) -> tuple[bool, str]:
    from linkctl.service import in_root

    if rec is None:
        return False, "no up record: the state directory is left as it is"
    if dry_run:
        remove, put_back, kept = up_record.restore_plan(rec)
        absent = [p for p in rec.absent_before if in_root(root, p).exists()]
        return True, (
            f"would remove {len(remove)} file(s) and {len(absent)} path(s) the services made, "
            f"put back {len(put_back)}" + (f"; would keep {'; '.join(kept)}" if kept else "")
        )
    remove, put_back, kept = up_record.restore(rec)
    gone = up_record.remove_absent([str(in_root(root, p)) for p in rec.absent_before])
    detail = (
        f"as before up: removed {len(remove)} file(s) up and the services wrote, "
        f"put back {len(put_back)}"
    )
    if gone:
        detail += f", removed {', '.join(gone)}"
    if kept:
        detail += f"; kept {'; '.join(kept)}"
    return True, detail
