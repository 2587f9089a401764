"""Where linkctl keeps its state and finds its profiles and shipped data."""

from __future__ import annotations

import os
import tempfile
from importlib import resources
from pathlib import Path

# Profiles installed by `linkctl service install` live here; also searched by name.
SYSTEM_PROFILE_DIR = Path("/etc/linkctl/profiles")


def shipped(*parts: str) -> Path:
    """A file or directory shipped inside the package (linkctl/data/...).

    Found through importlib.resources, so it is the same for a checkout, an
    editable install and a wheel installed anywhere; pip always unpacks wheels,
    so the resource is a real path.
    """
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


def write_atomic(path: Path, text: str, mode: int = 0o644) -> None:
    """Write ``text`` to ``path`` so a reader sees the old file or the new one, never a
    part: a temporary file in the same directory (unique, so concurrent writers do not
    share it), then rename over. Creates the parent directory."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
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
