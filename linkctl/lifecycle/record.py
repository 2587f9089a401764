"""What `linkctl up` keeps so that `linkctl down` leaves the host as it was: the state
directory as it was before the first `up` (every file's hash and mode, a copy of each
small one: the records up and its services rewrite), and which of the paths the service
manager may create did not exist. Stored at state_dir()/up/<profile>--<host>.json, the
copies beside it; this module owns both.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import stat
from datetime import UTC, datetime
from pathlib import Path

from pydantic import BaseModel, Field

from linkctl.core.paths import state_dir, write_atomic
from linkctl.core.records import Record, dump, load

UP_DIR = "up"
# Files up or its services may rewrite are small JSON records; a larger file (a model,
# a tiny GGUF) is never rewritten in place, so its hash is kept, not a copy.
COPY_LIMIT = 1 << 20


class FileBefore(BaseModel):
    sha256: str
    mode: int
    copied: bool


class StateBefore(BaseModel):
    """The state directory before up: relative paths of its files and directories."""

    existed: bool
    files: dict[str, FileBefore] = Field(default_factory=dict)
    dirs: list[str] = Field(default_factory=list)


class UpRecord(Record):
    profile: str
    profile_path: str
    host: str
    started_at: str
    boot: bool
    state: StateBefore
    # Paths the service manager may create (linkctl.service purge paths) that did not
    # exist before up: down removes them (directories only when empty).
    absent_before: list[str] = Field(default_factory=list)


def up_dir() -> Path:
    return state_dir() / UP_DIR


def record_path(profile: str, host: str) -> Path:
    return up_dir() / f"{profile}--{host}.json"


def copies_dir(profile: str, host: str) -> Path:
    return up_dir() / f"{profile}--{host}.before"


def _sha256(p: Path) -> str:
    h = hashlib.sha256()
    with p.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _walk(root: Path) -> tuple[list[str], list[str]]:
    """(files, dirs) under ``root``, relative, sorted; up's own directory left out."""
    files, dirs = [], []
    for dirpath, dirnames, filenames in os.walk(root):
        rel = Path(dirpath).relative_to(root)
        if rel.parts[:1] == (UP_DIR,):
            dirnames[:] = []
            continue
        for d in dirnames:
            if (rel / d).parts[:1] != (UP_DIR,):
                dirs.append(str(rel / d))
        files += [str(rel / f) for f in filenames]
    return sorted(files), sorted(dirs)


def snapshot(profile: str, host: str) -> StateBefore:
    """The state directory as it is now; small files copied beside the record."""
    root = state_dir()
    if not root.is_dir():
        return StateBefore(existed=False)
    names, dirs = _walk(root)
    files: dict[str, FileBefore] = {}
    copies = copies_dir(profile, host)
    for rel in names:
        p = root / rel
        if p.is_symlink() or not p.is_file():
            continue
        st = p.stat()
        small = st.st_size <= COPY_LIMIT
        if small:
            (copies / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(p, copies / rel)
        files[rel] = FileBefore(sha256=_sha256(p), mode=stat.S_IMODE(st.st_mode), copied=small)
    # Given to the constructor, not filled in after: records are written with what was set.
    return StateBefore(existed=True, files=files, dirs=dirs)


def save(record: UpRecord) -> Path:
    path = record_path(record.profile, record.host)
    write_atomic(path, dump(record))
    return path


def load_record(profile: str, host: str) -> UpRecord | None:
    path = record_path(profile, host)
    if not path.is_file():
        return None
    return load(UpRecord, path, "up record", f"remove {path} and run `linkctl down` again")


def now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def restore_plan(record: UpRecord) -> tuple[list[str], list[str], list[str]]:
    """(files to remove, files to put back, kept with a reason) to make the state
    directory what it was; directories are removed when empty afterwards."""
    root = state_dir()
    before = record.state
    remove, put_back, kept = [], [], []
    files, _dirs = _walk(root) if root.is_dir() else ([], [])
    for rel in files:
        was = before.files.get(rel)
        if was is None:
            remove.append(rel)
        elif _sha256(root / rel) != was.sha256:
            if was.copied:
                put_back.append(rel)
            else:
                kept.append(f"{rel}: changed since up and too large to have been copied")
    for rel, was in before.files.items():
        if rel not in files:
            if was.copied:
                put_back.append(rel)
            else:
                kept.append(f"{rel}: gone since up and too large to have been copied")
    return remove, put_back, kept


def restore(record: UpRecord) -> tuple[list[str], list[str], list[str]]:
    """Put the state directory back as it was before up, and remove up's record and
    copies. Returns what restore_plan said (removed, put back, kept)."""
    root = state_dir()
    remove, put_back, kept = restore_plan(record)
    copies = copies_dir(record.profile, record.host)
    for rel in remove:
        (root / rel).unlink(missing_ok=True)
    for rel in put_back:
        target = root / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(copies / rel, target)
        os.chmod(target, record.state.files[rel].mode)
    shutil.rmtree(copies, ignore_errors=True)
    record_path(record.profile, record.host).unlink(missing_ok=True)
    keep_dirs = set(record.state.dirs)
    if root.is_dir():
        for dirpath, _dirnames, _files in sorted(os.walk(root), key=lambda w: -len(w[0])):
            rel = str(Path(dirpath).relative_to(root))
            if rel != "." and rel not in keep_dirs:
                _rmdir_if_empty(Path(dirpath))
        if not record.state.existed:
            _rmdir_if_empty(root)
    return remove, put_back, kept


def _rmdir_if_empty(d: Path) -> None:
    with contextlib.suppress(OSError):  # not empty: something of before or of a user
        d.rmdir()


def remove_absent(paths: list[str]) -> list[str]:
    """Remove what did not exist before up (files, and directories when empty); returns
    what it removed."""
    out = []
    for s in paths:
        p = Path(s)
        try:
            if p.is_dir() and not p.is_symlink():
                p.rmdir()
            elif p.exists() or p.is_symlink():
                p.unlink()
            else:
                continue
        except OSError:
            continue
        out.append(s)
    return out
