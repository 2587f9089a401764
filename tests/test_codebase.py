"""The code as a whole: ruff (lint and format) and the type checker (mypy, with the
project's configuration in pyproject.toml) report nothing. They run here so that the
one test command (`bash scripts/bootstrap.sh test`, what CI runs) checks them too."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest

from support.paths import REPO


def _tool(name: str) -> list[str]:
    """The tool installed beside this interpreter (the venv's), else on PATH."""
    beside = REPO / ".venv" / "bin" / name
    for candidate in (str(beside), shutil.which(name)):
        if candidate and shutil.which(candidate):
            return [candidate]
    return [sys.executable, "-m", name]


def _run(argv: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=600)


@pytest.mark.parametrize(
    "args", [["check", "."], ["format", "--check", "."]], ids=["lint", "format"]
)
def test_ruff_is_clean(args: list[str]):
    r = _run([*_tool("ruff"), *args])
    assert r.returncode == 0, r.stdout + r.stderr


def test_mypy_is_clean():
    r = _run(_tool("mypy"))  # files and settings: [tool.mypy] in pyproject.toml
    assert r.returncode == 0, r.stdout + r.stderr
    assert "Success" in r.stdout, r.stdout
