"""paths: the one state directory whoever runs the command, and the one way linkctl
writes a file (text, bytes or a writer's file name) and publishes a built directory,
each all-or-nothing and readable by users whatever the umask."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from linkctl.core import paths
from linkctl.core.paths import (
    atomic_path,
    is_published,
    make_dirs,
    private_dir,
    publish_dir,
    state_dir,
    writable,
    write_atomic,
)


def mode(p: Path) -> int:
    return stat.S_IMODE(p.stat().st_mode)


@pytest.fixture
def root_umask() -> Iterator[None]:
    """The umask a hardened root shell has: files 0600, directories 0700 unless chmod'ed."""
    old = os.umask(0o077)
    yield
    os.umask(old)


# ---- one state, whoever runs the command ----------------------------------------------


@pytest.fixture
def system(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A stand-in for /var/lib/linkctl (never the real one), not made yet."""
    d = tmp_path / "var-lib-linkctl"
    monkeypatch.setattr(paths, "SYSTEM_STATE_DIR", d)
    monkeypatch.delenv("LINKCTL_STATE_DIR")
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "user-state"))
    return d


def test_state_dir_root_uses_the_system_state(system: Path, monkeypatch) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    assert state_dir() == system  # root makes it on its first write


def test_state_dir_a_user_reads_the_system_state_once_it_exists(
    system: Path, tmp_path: Path, monkeypatch
) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert state_dir() == tmp_path / "user-state" / "linkctl"  # no root ever ran linkctl
    system.mkdir()
    assert state_dir() == system


def test_state_dir_env_wins_for_root_and_users(system: Path, tmp_path: Path, monkeypatch) -> None:
    system.mkdir()
    monkeypatch.setenv("LINKCTL_STATE_DIR", str(tmp_path / "mine"))
    for euid in (0, 1000):
        monkeypatch.setattr(os, "geteuid", lambda e=euid: e)
        assert state_dir() == tmp_path / "mine"


def test_writable_looks_at_the_nearest_existing_parent(tmp_path: Path) -> None:
    assert writable(tmp_path / "not" / "yet")
    locked = tmp_path / "locked"
    locked.mkdir(0o555)
    os.chmod(locked, 0o555)
    try:
        # As root, access(2) allows writing anyway; as a user it would not.
        assert writable(locked / "sub") == (os.geteuid() == 0)
    finally:
        os.chmod(locked, 0o755)


def test_make_dirs_and_write_atomic_stay_readable_under_umask_077(
    tmp_path: Path, root_umask: None
) -> None:
    own = tmp_path / "own"
    own.mkdir()  # 0700 under this umask: an existing directory keeps its mode
    write_atomic(own / "probe" / "sub" / "r.json", "{}\n")
    assert mode(own) == 0o700
    assert mode(own / "probe") == mode(own / "probe" / "sub") == 0o755
    assert mode(own / "probe" / "sub" / "r.json") == 0o644
    assert make_dirs(own / "a" / "b") == own / "a" / "b" and mode(own / "a" / "b") == 0o755


def test_private_dir_is_0700_even_when_it_existed(tmp_path: Path, root_umask: None) -> None:
    slots = tmp_path / "state" / "serve" / "slots"
    slots.mkdir(parents=True)
    os.chmod(slots, 0o755)  # made by an older linkctl
    assert private_dir(slots) == slots and mode(slots) == 0o700
    assert mode(tmp_path / "state" / "serve") == 0o700  # made by mkdir above, kept
    fresh = private_dir(tmp_path / "fresh" / "serve" / "slots")
    assert mode(fresh) == 0o700 and mode(fresh.parent) == mode(fresh.parent.parent) == 0o755


# ---- writing -----------------------------------------------------------------------------


def test_write_atomic_text_and_bytes_with_mode(tmp_path: Path) -> None:
    p = tmp_path / "sub" / "f.json"
    write_atomic(p, '{"a": 1}\n')
    assert p.read_text() == '{"a": 1}\n' and (p.stat().st_mode & 0o777) == 0o644
    write_atomic(p, b"\x00\xffbin", 0o600)
    assert p.read_bytes() == b"\x00\xffbin" and (p.stat().st_mode & 0o777) == 0o600
    assert sorted(x.name for x in p.parent.iterdir()) == ["f.json"]  # no temp left


def test_atomic_path_failure_keeps_the_old_file_and_leaves_no_temp(tmp_path: Path) -> None:
    p = tmp_path / "model.gguf"
    p.write_bytes(b"old")
    with pytest.raises(RuntimeError), atomic_path(p) as tmp:
        tmp.write_bytes(b"half a new fi")
        assert p.read_bytes() == b"old"  # a reader meanwhile sees the old file
        raise RuntimeError("writer died")
    assert p.read_bytes() == b"old"
    assert sorted(x.name for x in tmp_path.iterdir()) == ["model.gguf"]


def test_atomic_path_gives_each_writer_its_own_temp(tmp_path: Path) -> None:
    p = tmp_path / "f"
    with atomic_path(p) as a, atomic_path(p) as b:
        assert a != b and a.parent == b.parent == tmp_path
        a.write_text("a")
        b.write_text("b")
    assert p.read_text() == "a"  # the outer block ended last
    assert sorted(x.name for x in tmp_path.iterdir()) == ["f"]


def test_publish_dir_publishes_whole_or_nothing(tmp_path: Path) -> None:
    final = tmp_path / "cache" / "key1"
    with publish_dir(final) as tmp:
        assert not final.exists() and tmp.parent == final.parent
        (tmp / "root").mkdir()
        (tmp / "root" / "f").write_text("x")
    assert is_published(final) and (final / "root" / "f").read_text() == "x"
    assert sorted(x.name for x in final.parent.iterdir()) == ["key1"]

    broken = tmp_path / "cache" / "key2"
    with pytest.raises(RuntimeError), publish_dir(broken) as tmp:
        (tmp / "part").write_text("y")
        raise RuntimeError("build failed")
    assert not broken.exists() and not is_published(broken)
    assert sorted(x.name for x in final.parent.iterdir()) == ["key1"]


def test_publish_dir_keeps_the_entry_another_run_published_first(tmp_path: Path) -> None:
    final = tmp_path / "key"
    with publish_dir(final) as tmp, publish_dir(final) as other:
        # two runs build the same entry; the inner one (the other run) finishes first
        assert tmp != other
        (tmp / "mine").write_text("mine")
        (other / "theirs").write_text("theirs")
    assert is_published(final) and sorted(p.name for p in final.iterdir()) == [
        ".complete",
        "theirs",
    ]
    assert sorted(x.name for x in tmp_path.iterdir()) == ["key"]


def test_publish_dir_over_an_unfinished_entry_raises_and_cleans_up(tmp_path: Path) -> None:
    final = tmp_path / "key"
    (final / "junk").mkdir(parents=True)  # not published: no .complete
    with pytest.raises(OSError), publish_dir(final) as tmp:
        (tmp / "f").write_text("x")
    assert not is_published(final)
    assert sorted(x.name for x in tmp_path.iterdir()) == ["key"]
    assert os.listdir(final) == ["junk"]
