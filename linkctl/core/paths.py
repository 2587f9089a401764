"""Where linkctl keeps its state and finds its profiles and shipped data."""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

# importlib.resources and tempfile are imported where used: `linkctl --help` reads this
# module (DEFAULT_PROFILE) and need not pay for them.

# Profiles installed by `linkctl service install` live here; also searched by name.
SYSTEM_PROFILE_DIR = Path("/etc/linkctl/profiles")
# The profile a command uses when given none and $LINKCTL_PROFILE is unset.
DEFAULT_PROFILE = "dgx-mac"


def shipped(*parts: str) -> Path:
    """A file or directory shipped inside the package (linkctl/data/...).

    Found through importlib.resources, so it is the same for a checkout, an
    editable install and a wheel installed anywhere; pip always unpacks wheels,
    so the resource is a real path.
    """
    from importlib import resources

    return Path(str(resources.files("linkctl").joinpath("data", *parts)))


def state_dir() -> Path:
    """/var/lib/linkctl as root, else ~/.local/state/linkctl; LINKCTL_STATE_DIR overrides.

    The lab sets LINKCTL_STATE_DIR per namespace host so that hosts sharing one
    filesystem keep separate records.
    """
    env = os.environ.get("LINKCTL_STATE_DIR")
    if env:
        return Path(env)
    if os.geteuid() == 0:
        return Path("/var/lib/linkctl")
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "linkctl"


@contextmanager
def atomic_path(path: Path, mode: int = 0o644) -> Iterator[Path]:
    """A temporary file beside ``path`` for a writer that wants a file name (a GGUF
    writer, ``write_bytes``): given ``mode`` and renamed over ``path`` when the block
    ends, removed if it raises, so a reader sees the old file or the new one, never a
    part. Unique (two writers never share it) and in the same directory (the rename
    stays on one filesystem). Creates the parent directory."""
    import tempfile

    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    os.close(fd)
    try:
        yield Path(tmp)
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_atomic(path: Path, data: str | bytes, mode: int = 0o644) -> None:
    """Write ``data`` (text or bytes) to ``path`` atomically (see atomic_path)."""
    with atomic_path(path, mode) as tmp:
        if isinstance(data, bytes):
            tmp.write_bytes(data)
        else:
            tmp.write_text(data)


def is_published(d: Path) -> bool:
    """Whether ``d`` is a whole cache entry made by publish_dir."""
    return (d / ".complete").is_file()


@contextmanager
def publish_dir(final: Path) -> Iterator[Path]:
    """A fresh directory beside ``final`` to build a cache entry in. When the block ends
    it is marked complete (``.complete``) and renamed to ``final`` in one step, so a
    reader sees a whole entry or none; if another run published the same entry
    meanwhile, that one stays and ours is dropped. Removed if the block raises."""
    import tempfile

    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=final.parent, prefix=f"{final.name}.tmp"))
    os.chmod(tmp, 0o755)  # as a plain mkdir makes it (mkdtemp's is 0700)
    try:
        yield tmp
        (tmp / ".complete").write_text(time.strftime("%Y-%m-%dT%H:%M:%S\n"))
        try:
            tmp.rename(final)
        except OSError:
            if not is_published(final):
                raise
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def user_profile_dir() -> Path:
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "linkctl" / "profiles"


def profile_dirs() -> list[Path]:
    """Where `--profile NAME` looks, first match wins: $LINKCTL_PROFILES, the user's
    ~/.config/linkctl/profiles, the system's /etc/linkctl/profiles, then the shipped ones."""
    dirs = []
    env = os.environ.get("LINKCTL_PROFILES")
    if env:
        dirs.append(Path(env))
    dirs += [user_profile_dir(), SYSTEM_PROFILE_DIR, shipped("profiles")]
    return dirs
