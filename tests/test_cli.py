"""The root command line: --version and --help answer without a command."""

from __future__ import annotations

from linkctl import __version__
from support.cli import linkctl


def test_version_answers_without_a_command():
    r = linkctl("--version")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == f"linkctl {__version__}"


def test_help_lists_every_command_group():
    r = linkctl("--help")
    assert r.returncode == 0, r.stderr
    for name in ("setup", "probe", "estimate", "verify", "serve", "route", "service", "doctor"):
        assert name in r.stdout
