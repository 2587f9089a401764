"""paths: the one way linkctl writes a file (text, bytes or a writer's file name) and
publishes a built directory, each all-or-nothing."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from linkctl.core.paths import atomic_path, is_published, publish_dir, write_atomic


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
