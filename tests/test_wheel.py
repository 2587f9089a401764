"""linkctl as a user installs it: a wheel built from the source, installed into a fresh
virtualenv in a temporary directory away from the checkout, run from there.

The profiles, the systemd/launchd templates and the device catalog must come from the
installed package (importlib.resources), and the macOS path must not import a
Linux-only module (pyroute2 is blocked in the replayed `setup --dry-run`).
"""

from __future__ import annotations

import json
import os
import plistlib
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import tomli_w

from support.ggufshapes import LLAMA_7B, write_header_only
from support.paths import REPO
from support.service_kit import LINKCTL, LLAMA, make_target

TESTS = Path(__file__).resolve().parent


def _run(argv: list[str], *, cwd: Path, env: dict[str, str] | None = None, timeout: float = 600):
    r = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, f"{' '.join(map(str, argv))} exited {r.returncode}:\n{r.stderr}"
    return r


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """(venv linkctl, environment, working dir): the wheel installed into a new venv."""
    top = tmp_path_factory.mktemp("wheel")
    assert REPO not in top.parents
    # Build from a copy of what a wheel is made of, so the build writes nothing into the
    # checkout (setuptools leaves build/ and *.egg-info beside the sources).
    src = top / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    shutil.copytree(REPO / "linkctl", src / "linkctl", ignore=shutil.ignore_patterns("__pycache__"))
    dist = top / "dist"
    _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", dist, src], cwd=top)
    (wheel,) = dist.glob("linkctl-*.whl")
    venv = top / "venv"
    _run([sys.executable, "-m", "venv", venv], cwd=top)
    # Dependencies from the package index as a user gets them (pip's cache makes it quick).
    _run([venv / "bin/python", "-m", "pip", "install", "-q", wheel], cwd=top)
    home = top / "home"
    home.mkdir()
    env = {
        "PATH": f"{venv / 'bin'}:/usr/bin:/bin:/usr/sbin:/sbin",
        "HOME": str(home),
        "XDG_CONFIG_HOME": str(home / ".config"),
        "LINKCTL_STATE_DIR": str(top / "state"),
        "LANG": "C.UTF-8",
    }
    work = top / "work"
    work.mkdir()
    return venv, env, work


def test_the_installed_package_is_the_wheel_not_the_checkout(installed):
    venv, env, work = installed
    r = _run(
        [venv / "bin/python", "-c", "import linkctl, sys; print(linkctl.__file__)"],
        cwd=work,
        env=env,
    )
    where = Path(r.stdout.strip())
    assert venv in where.parents and REPO not in where.parents


def test_profile_check_finds_the_shipped_profile(installed):
    venv, env, work = installed
    r = _run([venv / "bin/linkctl", "profile", "check", "dgx-mac", "--json"], cwd=work, env=env)
    d = json.loads(r.stdout)
    assert Path(d["path"]).parent.name == "profiles"
    assert venv in Path(d["path"]).parents
    assert d["profile"]["name"] == "dgx-mac"
    r = _run([venv / "bin/linkctl", "profile", "list", "--json"], cwd=work, env=env)
    assert {Path(p).stem for p in json.loads(r.stdout)} >= {"dgx-mac", "dgx2-mac-switch"}


def test_estimate_on_a_header_only_gguf(installed):
    venv, env, work = installed
    model = write_header_only(work / "llama-7b-header.gguf", LLAMA_7B)
    argv = [venv / "bin/linkctl", "estimate", "--model", model, "--profile", "dgx-mac"]
    r = _run([*argv, "--rtt-us", "120", "--throughput-gbps", "9.4", "--json"], cwd=work, env=env)
    d = json.loads(r.stdout)
    assert d["link"]["rtt_us"] == 120 and d["link"]["throughput_gbps"] == 9.4
    assert d["model"]["block_count"] == LLAMA_7B.n_layer
    assert d["model"]["file_size"] < 5_000_000  # header only: no tensor data (7B)


def _swapped_profile(env: dict[str, str]) -> str:
    """dgx-mac with the roles swapped (Linux head, macOS rpc), in the user's profile
    directory, so that install covers both roles on both OSes and --profile NAME finds
    a user profile from an installed linkctl."""
    data = tomllib.loads((REPO / "linkctl/data/profiles/dgx-mac.toml").read_text())
    data["name"] = "swapped"
    for h in data["hosts"]:
        h["role"] = "rpc" if h["role"] == "head" else "head"
    d = Path(env["XDG_CONFIG_HOME"]) / "linkctl" / "profiles"
    d.mkdir(parents=True, exist_ok=True)
    (d / "swapped.toml").write_text(tomli_w.dumps(data))
    return "swapped"


@pytest.mark.parametrize(
    "profile,host", [("dgx-mac", "dgx"), ("dgx-mac", "mac"), ("swapped", "dgx"), ("swapped", "mac")]
)
def test_service_install_into_a_root_both_roles_both_oses(installed, tmp_path, profile, host):
    venv, env, work = installed
    if profile == "swapped":
        _swapped_profile(env)
    root = make_target(tmp_path / "root")
    base = [venv / "bin/linkctl", "service", "install", "--profile", profile, "--host", host]
    base += ["--root", root, "--linkctl-bin", LINKCTL, "--llama-bin-dir", LLAMA, "--json"]
    before = sorted(p.relative_to(root) for p in root.rglob("*"))
    dry = json.loads(_run([*base, "--dry-run"], cwd=work, env=env).stdout)
    assert sorted(p.relative_to(root) for p in root.rglob("*")) == before
    res = json.loads(_run(base, cwd=work, env=env).stdout)
    assert [f["path"] for f in res["files"]] == [f["path"] for f in dry["files"]]
    written = {f["path"]: (root / f["path"].lstrip("/")) for f in res["files"]}
    assert all(p.is_file() for p in written.values())
    installed_profile = written[f"/etc/linkctl/profiles/{profile}.toml"]
    assert tomllib.loads(installed_profile.read_text())["name"] == profile
    services = [p for k, p in written.items() if not k.startswith("/etc/linkctl/")]
    is_mac = host == "mac"
    assert res["manager"] == ("launchd" if is_mac else "systemd")
    assert services and all(p.suffix == (".plist" if is_mac else ".service") for p in services)
    for p in services:
        if is_mac:
            args = plistlib.loads(p.read_bytes())["ProgramArguments"]
            assert (
                args[:2] == [LINKCTL, args[1]] and f"/etc/linkctl/profiles/{profile}.toml" in args
            )
        else:
            assert f"{LINKCTL} " in p.read_text()


def test_service_install_dry_run_on_this_system(installed, tmp_path):
    """Root / (this Linux machine): the default linkctl is the venv's console script."""
    venv, env, work = installed
    bins = make_target(tmp_path / "t") / LLAMA.lstrip("/")
    argv = [venv / "bin/linkctl", "service", "install", "--profile", "dgx-mac", "--host", "dgx"]
    r = _run([*argv, "--dry-run", "--json", "--llama-bin-dir", bins], cwd=work, env=env)
    res = json.loads(r.stdout)
    assert res["dry_run"] and not res["started"] and res["manager"] == "systemd"
    unit = next(f for f in res["files"] if f["path"].endswith("linkctl-link.service"))
    assert unit["action"] in ("create", "unchanged", "replace")


# As on macOS, where pyroute2 is not installed (its environment marker): importing it fails.
BLOCK_PYROUTE2 = """
import importlib.abc, json, sys

class LinuxOnly(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "pyroute2":
            raise ModuleNotFoundError(f"No module named {name!r} (blocked: Linux-only)")
        return None

sys.meta_path.insert(0, LinuxOnly())
"""

IMPORT_ALL = """
import importlib, pkgutil, linkctl
failed = []
for m in pkgutil.walk_packages(linkctl.__path__, "linkctl."):
    if m.name == "linkctl.__main__":  # runs the CLI
        continue
    try:
        importlib.import_module(m.name)
    except ImportError as e:
        failed.append([m.name, str(e)])
print(json.dumps(failed))
"""


def test_every_module_imports_without_pyroute2(installed, tmp_path):
    """With pyroute2 absent, as on macOS, every module imports (the CLI, both backends,
    service, serve, probe, estimate, the lab): pyroute2 is imported only inside the
    functions that change Linux links."""
    venv, env, work = installed
    script = tmp_path / "import_all.py"
    script.write_text(BLOCK_PYROUTE2 + IMPORT_ALL)
    r = _run([venv / "bin/python", script], cwd=work, env=env)
    assert json.loads(r.stdout) == []


REPLAY = """
sys.path.insert(0, {tests!r})
from support import macos_replay as mr
from linkctl import cli
from linkctl.net import backend
from linkctl.net import link

runner = mr.mac_studio(order={order!r})
backend.get_backend = lambda os_name=None, runner_=None: mr.backend(runner)
link.arp.who_has = lambda *a, **k: []
sys.argv = ["linkctl", "setup", "--profile", "dgx-mac", "--host", "mac", "--dry-run", "--json"]
try:
    cli.main()
    code = 0
except SystemExit as e:
    code = e.code or 0
import linkctl
with open({out!r}, "w") as f:
    json.dump({{
        "code": code,
        "package": linkctl.__file__,
        "commands": runner.commands(),
        "changes": runner.changes(),
        "unexpected": [list(a) for a in runner.unexpected],
        "linux_modules": sorted(m for m in sys.modules
                                if m in ("linkctl.net.linux", "linkctl.net.rtnl",
                                         "linkctl.lab.netns")
                                or m.split(".")[0] == "pyroute2"),
    }}, f)
"""


def test_setup_dry_run_on_the_mac_replay(installed, tmp_path):
    venv, env, work = installed
    out = tmp_path / "result.json"
    script = tmp_path / "replay.py"
    # Ethernet above Wi-Fi, the Mac Studio's usual order: the plan, exit 0.
    order = "networksetup-listnetworkserviceorder-ethernet-first-constructed.txt"
    script.write_text(BLOCK_PYROUTE2 + REPLAY.format(tests=str(TESTS), order=order, out=str(out)))
    r = subprocess.run(
        [venv / "bin/python", script],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    res = json.loads(out.read_text())
    assert res["code"] == 0, r.stderr
    assert venv in Path(res["package"]).parents
    assert res["unexpected"] == [] and res["changes"] == []  # dry run: nothing changed
    assert res["linux_modules"] == []
    plan = json.loads(r.stdout)
    assert plan["dry_run"] and [c["summary"] for c in plan["plan"]["changes"]]
    assert any("is ahead of 'Wi-Fi'" in n for n in plan["plan"]["notes"])
    assert os.path.basename(res["package"]) == "__init__.py"


def test_the_lab_refuses_off_linux(monkeypatch):
    """Network namespaces are Linux only: on macOS `linkctl lab` says so (exit 2) before
    it imports pyroute2 or touches anything."""
    from typer.testing import CliRunner

    from linkctl.cli import app
    from linkctl.core.errors import InputError

    monkeypatch.setattr(sys, "platform", "darwin")
    # `lab down` of a lab that does not exist: harmless even if the guard were gone.
    r = CliRunner().invoke(app, ["lab", "down", "--name", "t-no-such-lab-i11"])
    assert isinstance(r.exception, InputError) and r.exception.exit_code == 2
    assert "needs Linux network namespaces; this is darwin" in r.exception.message
