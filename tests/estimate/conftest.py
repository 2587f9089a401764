"""Fixtures of the estimate's tests."""

from __future__ import annotations

import os

import pytest


@pytest.fixture
def env(tmp_path):
    """The CLI's environment with a state directory of the test's own (no probe report,
    no calibration of this machine's)."""
    return dict(os.environ, LINKCTL_STATE_DIR=str(tmp_path / "state"))
