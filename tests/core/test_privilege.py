"""privilege: a command that needs root says so in one line before it does anything
(`needs root: sudo linkctl ...`, exit 2, nothing changed), and one that writes a state
directory that is not the user's refuses the same way. Each runs as the real CLI by user
nobody; the dry runs and doctor, which needs root only for its ARP check, run."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from support.cli import linkctl_as_nobody, need_root_netns
from support.lab import ns_snapshot
from support.service_kit import tree


def ip_netns() -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True)
    return sorted(out.stdout.splitlines())


def refused(r: subprocess.CompletedProcess, command: str, why: str) -> None:
    """Exit 2, nothing on stdout, and the one line naming what to type and why."""
    assert r.returncode == 2, r.stdout + r.stderr
    assert r.stdout == ""
    line = f"linkctl: error: needs root: sudo linkctl {command} (fix: {why}"
    assert r.stderr.count("\n") == 1 and r.stderr.startswith(line), r.stderr


@pytest.fixture
def nobody_env(system_state: Path) -> dict[str, str]:
    return {**os.environ, "LINKCTL_STATE_DIR": str(system_state)}


def test_link_and_probe_refuse_in_one_line_and_change_nothing(lab, system_state, nobody_env):
    env = {**nobody_env, "LINKCTL_PROFILE": lab.profile_path, "LINKCTL_HOST": "dgx"}
    before = {h: ns_snapshot(lab.netns(h)) for h in ("dgx", "mac")}
    state = tree(system_state)
    for args, why in (
        (["setup"], "setup changes the link's address"),
        (["teardown", "--json"], "teardown changes the link's address"),
        (["probe", "--peer", "mac"], "probe sends ARP through a raw socket"),
    ):
        r = linkctl_as_nobody(*args, env=env, netns=lab.netns("dgx"))
        refused(r, " ".join(args), why)
    assert {h: ns_snapshot(lab.netns(h)) for h in ("dgx", "mac")} == before
    assert tree(system_state) == state

    # Their dry runs need no root: the profile line first, then the plan.
    shutil.copy(lab.profile_path, system_state / "lab.toml")
    env["LINKCTL_PROFILE"] = str(system_state / "lab.toml")
    for verb in ("setup", "teardown"):
        r = linkctl_as_nobody(verb, "--dry-run", env=env, netns=lab.netns("dgx"))
        assert r.returncode == 0, r.stderr
        assert r.stderr.splitlines()[0] == (
            f"linkctl: profile dgx-mac-lab from {system_state / 'lab.toml'}, host dgx"
        )
    assert {h: ns_snapshot(lab.netns(h)) for h in ("dgx", "mac")} == before


def test_doctor_as_a_user_warns_that_its_arp_check_needs_root(lab, system_state, nobody_env):
    for h in ("dgx", "mac"):
        assert lab.run(h, "setup").returncode == 0
    shutil.copy(lab.profile_path, system_state / "lab.toml")
    env = {**nobody_env, "LINKCTL_PROFILE": str(system_state / "lab.toml"), "LINKCTL_HOST": "mac"}
    r = linkctl_as_nobody(
        "doctor", "--json", "--peer-timeout", "1", env=env, netns=lab.netns("mac")
    )
    assert r.returncode in (0, 1), r.stderr
    by = {c["check"]: c for c in json.loads(r.stdout)["checks"]}
    peer = by["peer dgx"]
    assert (peer["verdict"], peer["fix"]) == (
        "WARN",
        "needs root: sudo linkctl doctor --json --peer-timeout 1",
    ), peer
    # As root the same check runs and passes.
    r = lab.run("mac", "doctor", "--json", "--peer-timeout", "1")
    by = {c["check"]: c for c in json.loads(r.stdout)["checks"]}
    assert by["peer dgx"]["verdict"] == "PASS", by["peer dgx"]


def test_lab_and_service_refuse_in_one_line_and_change_nothing(system_state, nobody_env):
    need_root_netns()
    namespaces = ip_netns()
    etc = {
        d: tree(Path(d)) if Path(d).exists() else None
        for d in ("/etc/systemd/system", "/etc/linkctl")
    }
    netns = "the lab makes, enters and removes network namespaces"
    for args, why in (
        (["lab", "up", "--name", "tnobody"], netns),
        (["lab", "down", "--name", "tnobody"], netns),
        (["lab", "exec", "dgx", "--name", "tnobody", "--", "true"], netns),
        (["lab", "demo", "--name", "tnobody"], netns),
        (["lab", "boot", "--name", "tnobody"], netns),
        (["service", "install", "--host", "dgx"], "it writes and starts boot services in /"),
        (["service", "uninstall"], "it writes and starts boot services in /"),
    ):
        refused(linkctl_as_nobody(*args, env=nobody_env), " ".join(args), why)
    assert ip_netns() == namespaces
    assert {d: tree(Path(d)) if Path(d).exists() else None for d in etc} == etc
    r = linkctl_as_nobody("service", "uninstall", "--dry-run", env=nobody_env)
    assert r.returncode == 0, r.stderr


def test_writers_of_a_state_dir_that_is_not_theirs_refuse(system_state, nobody_env):
    """calibrate, serve, verify, route and kv-agent write the state; the system's is
    root's, so a user is told to use sudo before anything runs (no second state of
    their own that root's commands and services would never read)."""
    need_root_netns()
    state = tree(system_state)
    why = f"it writes {{}} to {system_state}, which is not yours"
    for args, what in (
        (["calibrate", "--host", "dgx"], "the calibration (calibration.json, calibrate/)"),
        (["serve", "--host", "dgx"], "its status (serve/)"),
        (["verify", "--host", "mac"], "its test model and logs (verify/)"),
        (["route", "--host", "mac"], "its status and slot files (serve/)"),
        (["kv-agent", "--host", "dgx"], "slot files and models (serve/slots, models/)"),
    ):
        refused(linkctl_as_nobody(*args, env=nobody_env), " ".join(args), why.format(what))
    assert tree(system_state) == state
    # A dry run only reads: it runs, saying the profile and its path first.
    r = linkctl_as_nobody("calibrate", "--host", "dgx", "--dry-run", env=nobody_env)
    assert r.returncode == 0, r.stderr
    assert r.stderr.splitlines()[0].startswith("linkctl: profile dgx-mac from /"), r.stderr
    assert tree(system_state) == state
