"""Profiles: the shipped ones validate; malformed or hostile ones are refused with one
line naming the field, exit 2, and nothing on the machine changes."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import tomli_w

from linkctl.core.errors import InputError
from linkctl.core.profile import load_profile, parse_profile
from support.cli import error_lines, linkctl, need_root_netns, need_tool
from support.lab import ns_snapshot
from support.paths import PROFILES

BASE = tomllib.loads((PROFILES / "dgx-mac.toml").read_text())


def test_shipped_profiles_validate():
    two, _ = load_profile("dgx-mac")
    assert [h.name for h in two.hosts] == ["dgx", "mac"]
    assert two.head.name == "mac" and two.head.interface == "en0"
    dgx = two.host("dgx")
    assert (dgx.os, dgx.interface, str(dgx.address), dgx.role, dgx.rpc.port) == (
        "linux",
        "enP7s7",
        "192.168.100.2/24",
        "rpc",
        50052,
    )
    assert two.link.mtu == 9000 and two.serve.port == 9999 and two.serve.ctx == 4096
    assert two.serve.ngl == 99
    three, _ = load_profile(str(PROFILES / "dgx2-mac-switch.toml"))
    assert len(three.rpc_hosts) == 2 and three.head.name == "mac"
    assert dgx.rpc_bind == "192.168.100.2"


def test_profile_names_search_user_then_system_then_shipped(tmp_path, monkeypatch):
    """--profile NAME: ~/.config/linkctl/profiles, then /etc/linkctl/profiles, then the
    profiles shipped in the package; the first match wins, and a miss names every place."""
    from linkctl.core import paths

    monkeypatch.delenv("LINKCTL_PROFILES", raising=False)
    monkeypatch.delenv("SUDO_USER", raising=False)  # the suite itself may run under sudo
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    monkeypatch.setattr(paths, "SYSTEM_PROFILE_DIR", tmp_path / "etc")
    user, system = tmp_path / "config/linkctl/profiles", tmp_path / "etc"

    def write(d: Path, description: str) -> None:
        d.mkdir(parents=True, exist_ok=True)
        (d / "dgx-mac.toml").write_text(tomli_w.dumps({**BASE, "description": description}))

    prof, path = load_profile("dgx-mac")
    assert path == PROFILES / "dgx-mac.toml" and prof.description == BASE["description"]
    write(system, "system copy")
    prof, path = load_profile("dgx-mac")
    assert (path, prof.description) == (system / "dgx-mac.toml", "system copy")
    write(user, "user copy")
    prof, path = load_profile("dgx-mac")
    assert (path, prof.description) == (user / "dgx-mac.toml", "user copy")
    with pytest.raises(InputError) as e:
        load_profile("no-such-link")
    assert all(str(d) in e.value.message for d in (user, system, PROFILES))
    assert "dgx2-mac-switch" in e.value.fix


def test_under_sudo_the_invoking_users_profiles_come_first(tmp_path):
    """sudo gives root's HOME, yet the profile the user copied to their
    ~/.config/linkctl/profiles is the one used: found through SUDO_USER's home in the
    password database. The real CLI runs in a private mount namespace whose /etc/passwd
    has that user (nothing of this machine's changes)."""
    need_root_netns()
    need_tool("unshare")
    home = tmp_path / "home" / "owner"
    mine = home / ".config" / "linkctl" / "profiles" / "dgx-mac.toml"
    mine.parent.mkdir(parents=True)
    mine.write_text(tomli_w.dumps({**BASE, "description": "the owner's copy"}))
    passwd = tmp_path / "passwd"
    passwd.write_text(Path("/etc/passwd").read_text() + f"owner:x:4242:4242::{home}:/bin/sh\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LINKCTL_PROF", "XDG_"))}
    env["HOME"] = str(tmp_path / "root-home")  # what sudo sets: root's, without profiles

    def first_line(**extra: str) -> str:
        bind = ["sh", "-c", 'mount --bind "$0" /etc/passwd && exec "$@"', str(passwd)]
        cli = [sys.executable, "-m", "linkctl", "calibrate", "--dry-run", "--host", "dgx"]
        r = subprocess.run(
            ["unshare", "--mount", "--propagation", "private", *bind, *cli],
            capture_output=True,
            text=True,
            timeout=60,
            env={**env, **extra},
        )
        assert r.returncode == 0, r.stderr
        return r.stderr.splitlines()[0]

    assert first_line(SUDO_USER="owner") == f"linkctl: profile dgx-mac from {mine}"
    # Without sudo, or sudo from root itself, the shipped profile as before.
    for extra in ({}, {"SUDO_USER": "root"}):
        assert first_line(**extra) == f"linkctl: profile dgx-mac from {PROFILES / 'dgx-mac.toml'}"


def test_profile_check_cli_prints_resolved_profile():
    r = linkctl("profile", "check", "dgx-mac", "--json")
    assert r.returncode == 0, r.stderr
    data = json.loads(r.stdout)["profile"]
    # Defaults are filled in: the resolved profile, not the file.
    assert data["probe"]["latency_samples"] >= 1000
    assert data["hosts"][0]["rpc"]["port"] == 50052


def mutate(fn):
    d = copy.deepcopy(BASE)
    fn(d)
    return d


def _set(path, value):
    def f(d):
        cur = d
        for k in path[:-1]:
            cur = cur[k]
        cur[path[-1]] = value

    return f


def _delete(path):
    def f(d):
        cur = d
        for k in path[:-1]:
            cur = cur[k]
        del cur[path[-1]]

    return f


def _both(*fns):
    def f(d):
        for fn in fns:
            fn(d)

    return f


# (case id, mutation, field the one-line error must name)
BAD = [
    ("mtu-string", _set(["link", "mtu"], "jumbo"), "link.mtu"),
    ("mtu-too-big", _set(["link", "mtu"], 65000), "link.mtu"),
    ("mtu-too-small", _set(["link", "mtu"], 100), "link.mtu"),
    ("subnet-bad-cidr", _set(["link", "subnet"], "192.168.100.0/33"), "link.subnet"),
    ("subnet-host-bits", _set(["link", "subnet"], "192.168.100.7/24"), "link.subnet"),
    ("subnet-not-ip", _set(["link", "subnet"], "banana"), "link.subnet"),
    ("subnet-too-wide", _set(["link", "subnet"], "10.0.0.0/8"), "link.subnet"),
    (
        "address-outside-subnet",
        _set(["hosts", 0, "address"], "192.168.101.2/24"),
        "hosts[0].address",
    ),
    ("address-no-prefix", _set(["hosts", 0, "address"], "192.168.100.2"), "hosts[0].address"),
    ("address-is-network", _set(["hosts", 0, "address"], "192.168.100.0/24"), "hosts[0].address"),
    (
        "address-is-broadcast",
        _set(["hosts", 0, "address"], "192.168.100.255/24"),
        "hosts[0].address",
    ),
    ("duplicate-address", _set(["hosts", 1, "address"], "192.168.100.2/24"), "hosts[1].address"),
    ("two-heads", _set(["hosts", 0, "role"], "head"), "hosts"),
    ("no-head", _set(["hosts", 1, "role"], "rpc"), "hosts"),
    ("unknown-role", _set(["hosts", 0, "role"], "worker"), "hosts[0].role"),
    ("unknown-os", _set(["hosts", 0, "os"], "windows"), "hosts[0].os"),
    ("missing-interface", _delete(["hosts", 0, "interface"]), "hosts[0].interface"),
    ("bad-interface-name", _set(["hosts", 0, "interface"], "eth0; rm -rf /"), "hosts[0].interface"),
    # A trailing newline: `$` in Python's re matches before it; full matches refuse it.
    ("interface-newline", _set(["hosts", 0, "interface"], "enP7s7\n"), "hosts[0].interface"),
    ("host-name-newline", _set(["hosts", 0, "name"], "dgx\n"), "hosts[0].name"),
    ("name-newline", _set(["name"], "dgx-mac\n"), "name"),
    ("mac-newline", _set(["hosts", 0, "mac"], "aa:bb:cc:dd:ee:ff\n"), "hosts[0].mac"),
    (
        "interface-too-long",
        _set(["hosts", 0, "interface"], "averyverylongifname0"),
        "hosts[0].interface",
    ),
    ("wildcard-rpc-bind", _set(["hosts", 0, "rpc", "bind"], "0.0.0.0"), "hosts[0].rpc.bind"),
    (
        "rpc-bind-other-address",
        _set(["hosts", 0, "rpc", "bind"], "192.168.1.50"),
        "hosts[0].rpc.bind",
    ),
    ("rpc-port-zero", _set(["hosts", 0, "rpc", "port"], 0), "hosts[0].rpc.port"),
    ("rpc-port-too-big", _set(["hosts", 0, "rpc", "port"], 70000), "hosts[0].rpc.port"),
    ("serve-port-string", _set(["serve", "port"], "9999x"), "serve.port"),
    ("unknown-top-key", _set(["linkk"], {}), "linkk"),
    ("unknown-host-key", _set(["hosts", 0, "iface"], "enP7s7"), "hosts[0].iface"),
    ("missing-link", _delete(["link"]), "link"),
    ("one-host", lambda d: d["hosts"].pop(), "hosts"),
    ("duplicate-name", _set(["hosts", 1, "name"], "dgx"), "hosts[1].name"),
    ("bad-host-name", _set(["hosts", 0, "name"], "DGX Spark!"), "hosts[0].name"),
    ("bad-mac", _set(["hosts", 0, "mac"], "zz:zz"), "hosts[0].mac"),
    (
        "negative-throughput",
        _set(["probe", "min_throughput_gbps"], -1),
        "probe.min_throughput_gbps",
    ),
    ("hosts-not-list", _set(["hosts"], "dgx,mac"), "hosts"),
    ("tensor-split-wrong-length", _set(["serve", "tensor_split"], [1, 2, 3]), "serve.tensor_split"),
    ("ctx-negative", _set(["serve", "ctx"], -4096), "serve.ctx"),
    ("split-not-a-mode", _set(["serve", "split"], "fastest"), "serve.split"),
    ("split-all-zero", _set(["serve", "split"], "0,0"), "serve.split"),
    (
        "split-and-tensor-split",
        _both(_set(["serve", "split"], "3,1"), _set(["serve", "tensor_split"], [3, 1])),
        "serve.tensor_split",
    ),
    ("name-with-slash", _set(["name"], "../etc/passwd"), "name"),
    ("address-wrong-type", _both(_set(["hosts", 0, "address"], 1234)), "hosts[0].address"),
]


@pytest.mark.parametrize(("case", "mutation", "field"), BAD, ids=[b[0] for b in BAD])
def test_bad_profile_rejected_naming_field(case, mutation, field):
    data = mutate(mutation)
    with pytest.raises(InputError) as ei:
        parse_profile(data, "p.toml")
    line = ei.value.line()
    assert "\n" not in line
    assert f"p.toml: {field}" in line, line


def test_not_toml_and_missing_file(tmp_path):
    bad = tmp_path / "broken.toml"
    bad.write_text("name = 'x'\n[link\n")
    r = linkctl("profile", "check", str(bad))
    assert r.returncode == 2 and "not valid TOML" in r.stderr and "Traceback" not in r.stderr
    r = linkctl("profile", "check", str(tmp_path / "nope.toml"))
    assert r.returncode == 2 and "no such file" in r.stderr
    r = linkctl("profile", "check", "no-such-profile")
    assert r.returncode == 2 and "dgx-mac" in r.stderr  # names the ones that exist


def test_bad_profiles_change_nothing_in_the_lab(lab, tmp_path):
    """Every bad profile given to `setup` inside a lab host: exit 2, one line naming
    the field, and the namespace's network state byte-for-byte as before."""
    lab_data = tomllib.loads(Path(lab.profile_path).read_text())
    before = ns_snapshot(lab.netns("dgx"))
    for case, mutation, field in BAD:
        d = copy.deepcopy(lab_data)
        try:
            mutation(d)
        except (KeyError, IndexError):
            mutation(d := copy.deepcopy(BASE))
        path = tmp_path / f"{case}.toml"
        path.write_text(tomli_w.dumps(d))
        r = lab.exec("dgx", "linkctl", "setup", "--profile", str(path))
        assert r.returncode == 2, (case, r.stdout, r.stderr)
        lines = error_lines(r.stderr)
        assert len(lines) == 1 and field in lines[0], (case, r.stderr)
    assert ns_snapshot(lab.netns("dgx")) == before
