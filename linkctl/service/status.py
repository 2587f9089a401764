"""status: what the manifest says is installed, whether each file is still what was
written, and (on ``/`` only) whether each service is running."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any

from linkctl.core.runner import Runner, default_runner
from linkctl.service.base import UnitStatus
from linkctl.service.install import load_manifest, sha256
from linkctl.service.manager import manager_named
from linkctl.service.preflight import in_root


class State(StrEnum):
    """An installed file against the manifest (the JSON value is the string)."""

    OK = "ok"
    MISSING = "missing"
    MODIFIED = "modified"


@dataclass(frozen=True)
class FileState:
    path: str
    state: State
    backup: str | None = None

    @property
    def ok(self) -> bool:
        return self.state == State.OK


@dataclass
class ServiceStatus:
    root: str
    installed: bool
    manager: str | None = None
    profile: str | None = None
    host: str | None = None
    files: list[FileState] = field(default_factory=list)
    services: list[UnitStatus] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.installed and all(f.ok for f in self.files) and all(s.ok for s in self.services)

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["ok"] = self.ok
        return d


def _state(p: Path, sha: str) -> State:
    if not p.is_file():
        return State.MISSING
    return State.OK if sha256(p.read_bytes()) == sha else State.MODIFIED


def status(*, root: Path = Path("/"), runner: Runner | None = None) -> ServiceStatus:
    root = Path(root)
    manifest = load_manifest(root)
    if manifest is None:
        return ServiceStatus(str(root), False, notes=[f"not installed in {root}"])
    st = ServiceStatus(str(root), True, manifest["manager"], manifest["profile"], manifest["host"])
    for f in manifest["files"]:
        st.files.append(
            FileState(f["path"], _state(in_root(root, f["path"]), f["sha256"]), f.get("backup"))
        )
    if str(root) != "/":
        st.notes.append(f"--root {root}: files only; services are not queried")
        return st
    runner = runner or default_runner()
    mgr = manager_named(manifest["manager"])
    st.services = [mgr.unit_status(runner, name) for name in manifest.get("services", [])]
    return st
