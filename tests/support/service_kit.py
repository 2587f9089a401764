"""Service tests' kit: a stand-in target machine, its paths, a tree snapshot, the
install CLI, and the step kinds of a transaction."""

from __future__ import annotations

import hashlib
import os
import stat
from pathlib import Path

import pytest

from linkctl import service as svc
from linkctl.core.profile import load_profile
from linkctl.service.transaction import Transaction
from support.cli import linkctl

LINKCTL = "/opt/linkctl/bin/linkctl"


PYTHON = "/usr/bin/python3"


LLAMA = "/opt/llama/bin"


def make_target(root: Path, *, bins: tuple[str, ...] = ("ggml-rpc-server", "llama-server")) -> Path:
    """A stand-in for the target machine: linkctl (a script whose interpreter exists),
    the llama.cpp binaries, where the units will run them, and env(1), which the head's
    serve unit runs its re-probe with (every Linux has it: coreutils)."""
    root.mkdir(parents=True, exist_ok=True)
    files = {
        PYTHON: b"\x7fELF stand-in interpreter\n",
        LINKCTL: f"#!{PYTHON}\n".encode(),
        svc.ENV: b"\x7fELF stand-in env\n",
    }
    files.update({f"{LLAMA}/{b}": b"\x7fELF stand-in\n" for b in bins})
    for path, data in files.items():
        p = root / path.lstrip("/")
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data)
        p.chmod(0o755)
    return root


def target_paths(profile_name: str, **kw) -> svc.ServicePaths:
    prof, path = load_profile(profile_name)
    return svc.ServicePaths(
        linkctl_bin=LINKCTL,
        llama_bin_dir=LLAMA,
        profile_path=f"{svc.PROFILE_DIR}/{prof.name}.toml",
        profile_text=path.read_text(),
        **kw,
    )


def as_os(host, os_name: str):
    """The same host on the other OS, so both managers are rendered for both roles."""
    return host.model_copy(update={"os": os_name})


def tree(root: Path) -> dict[str, tuple]:
    """Every entry under root: type, mode, owner, and for files their bytes and mtime."""
    out = {}
    for p in [root, *sorted(root.rglob("*"))]:
        st = p.lstat()
        entry: tuple = (stat.S_IFMT(st.st_mode), stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid)
        if p.is_symlink():
            entry += (os.readlink(p),)
        elif p.is_file():
            entry += (hashlib.sha256(p.read_bytes()).hexdigest(), st.st_mtime_ns)
        out["/" + str(p.relative_to(root)).removeprefix(".")] = entry
    return out


def cli_install(
    root: Path,
    *extra: str,
    profile: str = "dgx-mac",
    host: str = "dgx",
    env: dict[str, str] | None = None,
):
    return linkctl(
        "service",
        "install",
        "--profile",
        profile,
        "--host",
        host,
        "--root",
        str(root),
        "--linkctl-bin",
        LINKCTL,
        "--llama-bin-dir",
        LLAMA,
        *extra,
        env=env,
    )


def steps_of(monkeypatch, do) -> list[str]:
    """The kinds of the steps ``do()`` would run, in order, without running any."""
    kinds: list[str] = []

    class Planned(Exception):
        pass

    def record(self: Transaction) -> None:
        kinds.extend(k for k, _ in self.steps)
        raise Planned

    with monkeypatch.context() as m:
        m.setattr(Transaction, "run", record)
        with pytest.raises(Planned):
            do()
    return kinds
