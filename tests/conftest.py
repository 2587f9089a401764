"""Fixtures every test may use: a private state directory for the session, and labs
(real network namespaces) made for one test and torn down after it. Test-only helpers
live in tests/support (imported as `support`).

Tests that need root and namespaces fail (not skip) when CI=true.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import uuid
from pathlib import Path

import pytest

from support.cli import need_root_netns
from support.lab import LabHandle


@pytest.fixture(autouse=True, scope="session")
def _state_dir(tmp_path_factory):
    """Every test run keeps its state (setup records, labs) in a temporary directory."""
    d = tmp_path_factory.mktemp("state")
    os.environ["LINKCTL_STATE_DIR"] = str(d)
    yield d


@pytest.fixture
def system_state():
    """A state directory made as /var/lib/linkctl is (root's, 0755), never the real one:
    outside pytest's 0700 temporary tree, so that user nobody can read it."""
    d = Path(tempfile.mkdtemp(prefix="linkctl-state-"))
    os.chmod(d, 0o755)
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def make_lab():
    """make_lab(profile) -> LabHandle, already up; all labs are torn down after the test."""
    need_root_netns()
    labs: list[LabHandle] = []

    def _make(profile: str = "dgx-mac") -> LabHandle:
        lab = LabHandle(profile, "t" + uuid.uuid4().hex[:8])
        labs.append(lab)
        lab.up()
        return lab

    yield _make
    for lab in labs:
        lab.down()


@pytest.fixture
def lab(make_lab) -> LabHandle:
    return make_lab("dgx-mac")
