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
# The one state every linkctl reads once it exists (state_dir): root's commands make it.
SYSTEM_STATE_DIR = Path("/var/lib/linkctl")
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
    """Where linkctl keeps its records, the same whoever runs the command.

    $LINKCTL_STATE_DIR when set; else the system's /var/lib/linkctl when running as
    root or when it exists, so that `linkctl estimate` as a user reads the report
    `sudo linkctl probe` wrote; else the user's ~/.local/state/linkctl
    ($XDG_STATE_HOME), on a machine where no linkctl ever ran as root. Users read the
    system state (directories 0755, records 0644: make_dirs, write_atomic); a command
    that writes it checks first (linkctl.core.privilege.require_writable_state).

    The lab sets LINKCTL_STATE_DIR per namespace host so that hosts sharing one
    filesystem keep separate records.
    """
    env = os.environ.get("LINKCTL_STATE_DIR")
    if env:
        return Path(env)
    if os.geteuid() == 0 or SYSTEM_STATE_DIR.is_dir():
        return SYSTEM_STATE_DIR
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "linkctl"


def writable(d: Path) -> bool:
    """Whether this process (its effective ids) can create files in ``d``, or create
    ``d`` in its nearest existing parent."""
    p = d
    try:
        while not p.exists() and p != p.parent:
            p = p.parent
    except OSError:  # a parent this user may not search: nothing below it is theirs
        return False
    effective = os.access in os.supports_effective_ids
    return os.access(p, os.W_OK | os.X_OK, effective_ids=effective)


def make_dirs(d: Path) -> Path:
    """``d`` and its missing parents, created 0755 whatever the umask (root's may be
    077, and users must still read the state). Directories that exist keep their
    mode: ``d`` may be any directory a file is written to (/tmp)."""
    missing = []
    p = d
    while not p.exists():
        missing.append(p)
        p = p.parent
    for p in reversed(missing):
        try:
            p.mkdir(0o755)
        except FileExistsError:  # another writer made it meanwhile
            continue
        os.chmod(p, 0o755)
    return d


def private_dir(d: Path) -> Path:
    """``d`` as make_dirs makes it, but 0700 even when it exists: KV-cache slot files
    hold users' prompts, and the files in it are written by llama-server with its own
    umask."""
    make_dirs(d.parent)
    d.mkdir(0o700, exist_ok=True)
    os.chmod(d, 0o700)
    return d


@contextmanager
def atomic_path(path: Path, mode: int = 0o644) -> Iterator[Path]:
    """A temporary file beside ``path`` for a writer that wants a file name (a GGUF
    writer, ``write_bytes``): given ``mode`` and renamed over ``path`` when the block
    ends, removed if it raises, so a reader sees the old file or the new one, never a
    part. Unique (two writers never share it) and in the same directory (the rename
    stays on one filesystem). Creates the parent directory."""
    import tempfile

    make_dirs(path.parent)
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

    make_dirs(final.parent)
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


def sudo_user_profile_dir() -> Path | None:
    """Under sudo, the invoking user's ~/.config/linkctl/profiles: sudo sets HOME to
    root's, so the user's home comes from the password database (SUDO_USER)."""
    import pwd

    user = os.environ.get("SUDO_USER")
    if os.geteuid() != 0 or not user or user == "root":
        return None
    try:
        return Path(pwd.getpwnam(user).pw_dir) / ".config" / "linkctl" / "profiles"
    except KeyError:
        return None


def profile_files(dirs: list[Path]) -> list[Path]:
    """The *.toml files in ``dirs``, in order. A directory this user may not read holds
    none for it (root's ~/.config when HOME stayed root's: sudo -E, setpriv)."""
    out = []
    for d in dirs:
        try:
            out += sorted(d.glob("*.toml")) if d.is_dir() else []
        except OSError:
            continue
    return out


def profile_dirs() -> list[Path]:
    """Where `--profile NAME` looks, first match wins: $LINKCTL_PROFILES, under sudo the
    invoking user's ~/.config/linkctl/profiles, this user's, the system's
    /etc/linkctl/profiles, then the shipped ones."""
    env = os.environ.get("LINKCTL_PROFILES")
    dirs = [
        Path(env) if env else None,
        sudo_user_profile_dir(),
        user_profile_dir(),
        SYSTEM_PROFILE_DIR,
        shipped("profiles"),
    ]
    return list(dict.fromkeys(d for d in dirs if d is not None))
