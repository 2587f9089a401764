"""Where linkctl keeps its state and finds its profiles."""

from __future__ import annotations

import os
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent


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


def profile_dirs() -> list[Path]:
    dirs = []
    env = os.environ.get("LINKCTL_PROFILES")
    if env:
        dirs.append(Path(env))
    dirs += [REPO_ROOT / "profiles", Path("/etc/linkctl/profiles")]
    return dirs
