"""Boot-time services: render, verify (systemd-analyze, plistlib), install/uninstall into a
temporary root, refusals, and the link unit's exact command lines run in the lab."""

from __future__ import annotations

import json
import os
import plistlib
import shlex
import shutil
import stat
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest
import tomli_w

from linkctl import service as svc
from linkctl.core.profile import load_profile, parse_profile
from linkctl.core.runner import stop_process
from support.cli import error_lines, linkctl, need_tool
from support.lab import ns_snapshot
from support.paths import PROFILES as SHIPPED_PROFILES
from support.service_kit import (
    LINKCTL,
    LLAMA,
    PYTHON,
    as_os,
    cli_install,
    make_target,
    target_paths,
    tree,
)

PROFILES = ("dgx-mac", "dgx2-mac-switch")


# ---- helpers ---------------------------------------------------------------------------


def unit_keys(text: str) -> dict[str, list[str]]:
    """section.Key -> values, in order (systemd allows repeated keys)."""
    out: dict[str, list[str]] = {}
    section = ""
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            section = line.strip("[]")
            continue
        k, _, v = line.partition("=")
        out.setdefault(f"{section}.{k}", []).append(v)
    return out


def systemd_verify(root: Path, units: list[str]) -> subprocess.CompletedProcess:
    """systemd-analyze verify with --root: ExecStart binaries must exist inside root."""
    exe = need_tool("systemd-analyze")
    sysdir = root / "usr/lib/systemd/system"
    sysdir.mkdir(parents=True, exist_ok=True)
    for t in Path("/lib/systemd/system").glob("*.target"):
        shutil.copy(t, sysdir / t.name)
    return subprocess.run(
        [exe, "verify", f"--root={root}", *units],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=root,
    )


# ---- rendering ------------------------------------------------------------------------


def all_hosts():
    for name in PROFILES:
        prof, _ = load_profile(name)
        for h in prof.hosts:
            for os_name in ("linux", "macos"):
                yield pytest.param(name, h.name, os_name, id=f"{name}-{h.name}-{os_name}")


@pytest.mark.parametrize(("profile_name", "host_name", "os_name"), list(all_hosts()))
def test_render_verifies(tmp_path, profile_name, host_name, os_name):
    """Every unit/plist, both profiles, both roles, both managers: rendered into a root
    and checked by systemd-analyze verify (strict: no warning) or plistlib."""
    prof, _ = load_profile(profile_name)
    host = as_os(prof.host(host_name), os_name)
    root = make_target(tmp_path / "root")
    res = svc.install(prof, host, target_paths(profile_name), root=root)
    assert res.started is False
    files = svc.render(
        prof, host, svc.check_paths(root, prof, host, target_paths(profile_name)).paths
    )
    for path, text in files.items():
        assert (root / path.lstrip("/")).read_text() == text
        st = (root / path.lstrip("/")).stat()
        assert stat.S_IMODE(st.st_mode) == 0o644 and (st.st_uid, st.st_gid) == (0, 0)
    if os_name == "linux":
        units = [Path(p).name for p in files if p.startswith(svc.UNIT_DIR)]
        assert units == list(svc.SYSTEMD_UNITS)
        r = systemd_verify(root, units)
        assert r.returncode == 0 and r.stderr.strip() == "" and r.stdout.strip() == "", (
            r.stdout + r.stderr
        )
    else:
        plists = sorted(p for p in files if p.startswith(svc.LAUNCHD_DIR))
        assert [Path(p).stem for p in plists] == sorted(svc.label(j) for j in svc.LAUNCHD_JOBS)
        for p in plists:
            check_plist(root, p, host)


def check_plist(root: Path, path: str, host) -> None:
    with open(root / path.lstrip("/"), "rb") as f:
        d = plistlib.load(f)
    types = {
        "Label": str,
        "ProgramArguments": list,
        "RunAtLoad": bool,
        "KeepAlive": (bool, dict),
        "ThrottleInterval": int,
        "StandardOutPath": str,
        "StandardErrorPath": str,
        "EnvironmentVariables": dict,
    }
    for key, t in types.items():
        assert isinstance(d.get(key), t), f"{path}: {key} = {d.get(key)!r}"
    assert d["Label"] == Path(path).stem
    assert d["RunAtLoad"] is True and d["ThrottleInterval"] > 0
    if isinstance(d["KeepAlive"], dict):
        assert d["KeepAlive"] == {"SuccessfulExit": False}
    args = d["ProgramArguments"]
    assert all(isinstance(a, str) for a in args)
    # Absolute paths that exist in the rendered root: the program, its profile, log dirs.
    assert args[0].startswith("/") and os.access(root / args[0].lstrip("/"), os.X_OK)
    profile = args[args.index("--profile") + 1]
    assert profile.startswith("/") and (root / profile.lstrip("/")).is_file()
    parse_profile(tomllib.loads((root / profile.lstrip("/")).read_text()))  # validates
    assert args[args.index("--host") + 1] == host.name
    for key in ("StandardOutPath", "StandardErrorPath"):
        assert d[key].startswith("/") and (root / d[key].lstrip("/")).parent.is_dir()
    assert all(isinstance(v, str) for v in d["EnvironmentVariables"].values())
    if d["Label"] == "com.linkctl.link":
        assert args[1] == "setup" and "--wait-carrier" in args
    if d["Label"] == "com.linkctl.serve":
        llama = d["EnvironmentVariables"]["LINKCTL_LLAMA_BIN"]
        assert (root / llama.lstrip("/")).is_dir()


def test_systemd_units_say_what_the_issue_asks(tmp_path):
    prof, _ = load_profile("dgx-mac")
    root = make_target(tmp_path / "root")
    for host in (prof.host("dgx"), as_os(prof.host("mac"), "linux")):
        paths = svc.check_paths(root, prof, host, target_paths("dgx-mac")).paths
        files = svc.render(prof, host, paths)
        link = unit_keys(files[f"{svc.UNIT_DIR}/linkctl-link.service"])
        dev = subprocess.run(
            [
                "systemd-escape",
                "--path",
                "--suffix=device",
                f"/sys/subsystem/net/devices/{host.interface}",
            ],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        assert link["Unit.After"] == [dev] and link["Unit.BindsTo"] == [dev]
        assert not any("network-online" in v for vals in link.values() for v in vals)
        assert link["Service.Type"] == ["oneshot"] and link["Service.RemainAfterExit"] == ["yes"]
        setup, probe = (
            shlex.split(link["Service.ExecStartPre"][0]),
            shlex.split(link["Service.ExecStart"][0]),
        )
        assert setup[:2] == [LINKCTL, "setup"] and probe[:2] == [LINKCTL, "probe"]
        assert link["Service.CapabilityBoundingSet"] == ["CAP_NET_ADMIN CAP_NET_RAW"]
        serve = unit_keys(files[f"{svc.UNIT_DIR}/linkctl-serve.service"])
        assert serve["Unit.Requires"] == ["linkctl-link.service"]
        assert "linkctl-link.service" in serve["Unit.After"][0]
        assert serve["Service.Restart"] == ["on-failure"] and serve["Service.RestartSec"]
        # No start limit: a pair that was down (a failing re-probe) comes back by itself.
        assert serve["Unit.StartLimitIntervalSec"] == ["0"]
        binds = [b.split(":")[1] for b in serve["Service.BindReadOnlyPaths"]]
        assert binds == [
            "/var/lib/linkctl-serve/probe",
            "/var/lib/linkctl-serve/calibration.json",
        ]
        if host.role == "head":
            # A restart after the report aged probes again, privileged ("+"), first.
            (pre,) = serve["Service.ExecStartPre"]
            assert pre.startswith("+")
            argv = shlex.split(pre[1:])
            assert argv[:2] == [svc.ENV, "LINKCTL_STATE_DIR=/var/lib/linkctl"]
            assert argv[2:4] == [LINKCTL, "probe"] and argv[-2:] == ["--max-age", "86400"]
        else:
            assert "Service.ExecStartPre" not in serve
        assert serve["Service.CapabilityBoundingSet"] == [""]
        assert serve["Service.DynamicUser"] == ["yes"]
        assert shlex.split(serve["Service.ExecStart"][0])[1] == "serve"
        env = dict(e.split("=", 1) for e in serve["Service.Environment"])
        assert env["LINKCTL_LLAMA_BIN"] == LLAMA
        # rpc-server has no authentication: the unit may talk to the profile's hosts only
        # (not the whole subnet: a shared segment holds other machines).
        if host.role == "rpc":
            peers = " ".join(f"{h.address.ip}/32" for h in prof.hosts)
            assert serve["Service.IPAddressAllow"] == [f"localhost {peers}"]
            assert serve["Service.IPAddressDeny"] == ["any"]
        resp = unit_keys(files[f"{svc.UNIT_DIR}/linkctl-responder.service"])
        assert "linkctl-link.service" not in " ".join(resp.get("Unit.After", []))


# systemd-analyze security's exposure (0 best, 10 worst) each unit may reach: 2.0 where
# the role allows it; the link unit is root with CAP_NET_ADMIN/CAP_NET_RAW on the host's
# network, AF_PACKET for ARP and umask 022 for the reports users read.
EXPOSURE_MAX = {"linkctl-serve.service": 2.0, "linkctl-responder.service": 2.0,
                "linkctl-link.service": 2.5}  # fmt: skip


@pytest.mark.parametrize("role", ["rpc", "head"])
def test_units_are_hardened(tmp_path, role):
    """Each rendered unit scored by systemd-analyze security (offline): printed, and
    held to EXPOSURE_MAX. The head is the Mac's place played by a Linux host."""
    need_tool("systemd-analyze")
    prof, _ = load_profile("dgx-mac")
    d = prof.to_toml_dict()
    d["hosts"][1].update(os="linux", interface="enp1s0")
    prof = parse_profile(d)
    host = prof.head if role == "head" else prof.rpc_hosts[0]
    paths = svc.ServicePaths(
        linkctl_bin="/opt/linkctl/bin/linkctl", llama_bin_dir=LLAMA,
        profile_path="/etc/linkctl/profiles/dgx-mac.toml",
    )  # fmt: skip
    for path, text in svc.render(prof, host, paths).items():
        name = Path(path).name
        if name not in EXPOSURE_MAX:
            continue
        f = tmp_path / name
        f.write_text(text)
        r = subprocess.run(
            ["systemd-analyze", "security", "--offline=yes", str(f)],
            capture_output=True, text=True, check=False,
        )  # fmt: skip
        line = r.stdout.strip().splitlines()[-1]
        score = float(line.split("level for")[1].split(":")[1].split()[0])
        print(f"{role} {name}: exposure {score} (at most {EXPOSURE_MAX[name]})")
        assert score <= EXPOSURE_MAX[name], (name, r.stdout[-3000:])


def test_device_unit_escaping_matches_systemd():
    for ifname in ("enP7s7", "en0", "en-p1.2:x_y", "eth0@x"):
        want = subprocess.run(
            ["systemd-escape", "--path", "--suffix=device", f"/sys/subsystem/net/devices/{ifname}"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        assert svc.device_unit(ifname) == want


def test_exec_lines_quote_odd_paths(tmp_path):
    prof, _ = load_profile("dgx-mac")
    paths = svc.ServicePaths(
        linkctl_bin="/opt/link ctl/bin/linkctl",
        llama_bin_dir=LLAMA,
        profile_path='/etc/linkctl/profiles/a "b" 100%.toml',
    )
    files = svc.render(prof, prof.host("dgx"), paths)
    line = unit_keys(files[f"{svc.UNIT_DIR}/linkctl-link.service"])["Service.ExecStart"][0]
    # systemd's own unquoting: shlex for the quotes, then %% -> %.
    argv = [a.replace("%%", "%") for a in shlex.split(line)]
    assert argv[0] == paths.linkctl_bin and argv[argv.index("--profile") + 1] == paths.profile_path
    # A control character stays inside its quotes as an escape: no directive ends early.
    from linkctl.service.render import systemd_quote

    assert systemd_quote("a\nb") == '"a\\x0ab"' and "\n" not in systemd_quote("a\nb")


# ---- install / uninstall ------------------------------------------------------------------


@pytest.mark.parametrize("host", ["dgx", "mac"])
def test_install_uninstall_leaves_root_exactly_as_before(tmp_path, host):
    root = make_target(tmp_path / "root")
    # Things already on the target: a foreign unit where ours goes (backed up, restored),
    # and an /etc that install must leave in place.
    foreign = (
        root / "etc/systemd/system/linkctl-serve.service"
        if host == "dgx"
        else root / "Library/LaunchDaemons/com.linkctl.serve.plist"
    )
    foreign.parent.mkdir(parents=True)
    foreign.write_text("# someone else's\n")
    os.utime(foreign, ns=(1_000_000_000, 1_000_000_000))
    before = tree(root)

    r = cli_install(root, "--json", host=host)
    assert r.returncode == 0, r.stderr
    first = json.loads(r.stdout)
    assert first["changed"] and not first["started"]
    assert any(f["action"] == "replace" for f in first["files"])
    bak = Path(str(foreign) + svc.BACKUP_SUFFIX)
    assert bak.read_text() == "# someone else's\n"
    after_first = tree(root)

    r = cli_install(root, "--json", host=host)
    assert r.returncode == 0, r.stderr
    second = json.loads(r.stdout)
    assert not second["changed"], second
    assert {f["action"] for f in second["files"]} == {"unchanged"}
    assert tree(root) == after_first  # a second install changes nothing, not even mtimes

    st = linkctl("service", "status", "--root", str(root), "--json")
    assert st.returncode == 0, st.stdout + st.stderr
    assert json.loads(st.stdout)["ok"]

    r = linkctl("service", "uninstall", "--root", str(root))
    assert r.returncode == 0, r.stderr
    assert tree(root) == before
    r = linkctl("service", "uninstall", "--root", str(root), "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["files"] == []


def test_status_reports_a_modified_file(tmp_path):
    root = make_target(tmp_path / "root")
    assert cli_install(root).returncode == 0
    unit = root / "etc/systemd/system/linkctl-link.service"
    unit.write_text(unit.read_text().replace("RestartSec=10s", "RestartSec=1s"))
    st = linkctl("service", "status", "--root", str(root), "--json")
    assert st.returncode == 1
    states = {f["path"]: f["state"] for f in json.loads(st.stdout)["files"]}
    assert states["/etc/systemd/system/linkctl-link.service"] == "modified"
    # A reinstall puts our content back; uninstall still restores the tree.
    assert cli_install(root).returncode == 0
    assert linkctl("service", "status", "--root", str(root)).returncode == 0


def test_install_for_another_profile_replaces_the_first(tmp_path):
    root = make_target(tmp_path / "root")
    before = tree(root)
    assert cli_install(root).returncode == 0
    r = cli_install(root, "--json", profile="dgx2-mac-switch", host="dgx2")
    assert r.returncode == 0, r.stderr
    actions = {f["path"]: f["action"] for f in json.loads(r.stdout)["files"]}
    assert actions["/etc/linkctl/profiles/dgx-mac.toml"] == "remove"
    assert actions["/etc/linkctl/profiles/dgx2-mac-switch.toml"] == "create"
    assert actions["/etc/systemd/system/linkctl-link.service"] == "update"
    assert not (root / "etc/linkctl/profiles/dgx-mac.toml").exists()
    assert linkctl("service", "uninstall", "--root", str(root)).returncode == 0
    assert tree(root) == before


def refused(r: subprocess.CompletedProcess, *words: str) -> None:
    assert r.returncode == 2, r.stdout + r.stderr
    err = r.stderr.strip()
    assert len(error_lines(err)) == 1 and "Traceback" not in err, err
    for w in words:
        assert w in err, err


def test_refuses_when_linkctl_is_not_where_the_unit_runs_it(tmp_path):
    root = make_target(tmp_path / "root")
    (root / LINKCTL.lstrip("/")).unlink()
    before = tree(root)
    refused(cli_install(root), "linkctl is not at", LINKCTL)
    assert tree(root) == before


def test_refuses_when_the_interpreter_is_missing(tmp_path):
    root = make_target(tmp_path / "root")
    (root / PYTHON.lstrip("/")).unlink()
    before = tree(root)
    refused(cli_install(root), PYTHON)
    assert tree(root) == before


@pytest.mark.parametrize(
    ("host", "keep", "missing"),
    [
        ("dgx", ("llama-server",), "ggml-rpc-server or rpc-server"),
        ("mac", ("ggml-rpc-server",), "llama-server"),
    ],
)
def test_refuses_without_the_role_s_llama_binary(tmp_path, host, keep, missing):
    root = make_target(tmp_path / "root", bins=keep)
    before = tree(root)
    refused(cli_install(root, host=host), missing, LLAMA)
    assert tree(root) == before


def test_accepts_the_old_rpc_server_name(tmp_path):
    root = make_target(tmp_path / "root", bins=("rpc-server",))
    assert cli_install(root).returncode == 0


def test_refuses_a_profile_that_does_not_validate(tmp_path):
    root = make_target(tmp_path / "root")
    bad = tmp_path / "bad.toml"
    data = tomllib.loads((SHIPPED_PROFILES / "dgx-mac.toml").read_text())
    data["hosts"][0]["rpc"]["bind"] = "0.0.0.0"  # a wildcard rpc-server: refused
    bad.write_text(tomli_w.dumps(data))
    before = tree(root)
    refused(cli_install(root, profile=str(bad)), "rpc.bind")
    assert tree(root) == before


def test_refuses_when_a_backup_would_be_overwritten(tmp_path):
    root = make_target(tmp_path / "root")
    unit = root / "etc/systemd/system/linkctl-link.service"
    unit.parent.mkdir(parents=True)
    unit.write_text("# foreign\n")
    Path(str(unit) + svc.BACKUP_SUFFIX).write_text("# an older backup\n")
    before = tree(root)
    refused(cli_install(root), "backup")
    assert tree(root) == before


def test_refuses_to_install_another_os_s_services_on_this_machine():
    # --root / (the real system) for the macOS host on this Linux box: refused before
    # anything is read or written (and --dry-run, so even a bug writes nothing).
    r = linkctl("service", "install", "--profile", "dgx-mac", "--host", "mac", "--dry-run")
    refused(r, "macos", "--root")


def test_dry_run_on_the_real_system_plans_systemctl_and_writes_nothing(tmp_path):
    """Root /: the plan names the systemctl calls; --dry-run runs none and writes nothing.
    On this machine the interpreter lives under /root (mode 0700), so the serve unit
    cannot use a dedicated user and install says so."""
    llama = make_target(tmp_path / "t")
    bin_dir = llama / LLAMA.lstrip("/")
    exe = shutil.which("linkctl") or str(Path(sys.executable).parent / "linkctl")
    r = linkctl(
        "service",
        "install",
        "--profile",
        "dgx-mac",
        "--host",
        "dgx",
        "--dry-run",
        "--json",
        "--linkctl-bin",
        exe,
        "--llama-bin-dir",
        str(bin_dir),
    )
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout)
    assert res["dry_run"] and not res["started"]
    names = list(svc.SYSTEMD_UNITS)
    assert ["systemctl", "enable", "--now", "--no-block", *names] in res["commands"]
    assert not Path(svc.MANIFEST).exists() or res["files"]
    for f in res["files"]:
        if f["action"] == "create":
            assert not Path(f["path"]).exists()
    interp = Path(os.path.realpath(sys.executable))
    hidden = any(not (p.stat().st_mode & stat.S_IXOTH) for p in interp.parents if p != Path("/"))
    assert (res["serve_user"] == "root") == hidden


def test_serve_identity_follows_file_permissions(tmp_path):
    prof, _ = load_profile("dgx-mac")
    root = make_target(tmp_path / "root")
    host = prof.host("dgx")
    pre = svc.check_paths(root, prof, host, target_paths("dgx-mac"))
    assert pre.paths.serve_user is None  # DynamicUser
    (root / "opt/linkctl").chmod(0o700)
    pre = svc.check_paths(root, prof, host, target_paths("dgx-mac"))
    assert pre.paths.serve_user == "root"
    assert any("/opt/linkctl/bin/linkctl" in n for n in pre.notes)
    text = svc.render(prof, host, pre.paths)[f"{svc.UNIT_DIR}/linkctl-serve.service"]
    keys = unit_keys(text)
    assert keys["Service.User"] == ["root"] and "Service.DynamicUser" not in keys
    assert keys["Service.CapabilityBoundingSet"] == [""]


# ---- the exact command lines, in the lab --------------------------------------------------


def _lab_argv(lab, host: str, argv: list[str]) -> tuple[list[str], dict[str, str]]:
    from linkctl.lab import netns

    return netns.exec_argv(netns.load_lab(lab.name), host, argv)


def _caps_prefix(keys: dict[str, list[str]]) -> list[str]:
    """setpriv with the unit's capability bounding set and NoNewPrivileges: the
    process gets exactly what systemd would leave it."""
    caps = keys["Service.CapabilityBoundingSet"][-1].split()
    spec = "-all" + "".join(f",+{c.removeprefix('CAP_').lower()}" for c in caps)
    return ["setpriv", "--no-new-privs", f"--bounding-set={spec}", f"--inh-caps={spec}"]


@pytest.mark.netns
def test_link_unit_command_lines_bring_the_link_up_in_the_lab(make_lab, tmp_path):
    """Cold boot of both hosts at once: the dgx link unit's ExecStartPre (setup) under the
    unit's capability set, beside the mac link daemon's ProgramArguments (setup
    --wait-carrier), concurrently; then the responders from their unit/plist; then the
    link unit's ExecStart (the probe gate) passes."""
    need_tool("setpriv")
    need_tool("iperf3")
    lab = make_lab("dgx-mac")
    # The lab profile with thresholds this shared 2-core machine meets reliably; what is
    # under test is the service wiring, not the link figures.
    data = tomllib.loads(Path(lab.profile_path).read_text())
    data.setdefault("probe", {}).update(min_throughput_gbps=0.5, max_rtt_p99_us=20000)
    prof_path = tmp_path / "lab-profile.toml"
    prof_path.write_text(tomli_w.dumps(data))
    prof = parse_profile(data)
    exe = shutil.which("linkctl") or str(Path(sys.executable).parent / "linkctl")
    paths = svc.ServicePaths(
        linkctl_bin=exe, llama_bin_dir=LLAMA, profile_path=str(prof_path), wait_carrier_s=30
    )
    units = svc.render(prof, prof.host("dgx"), paths)
    link = unit_keys(units[f"{svc.UNIT_DIR}/linkctl-link.service"])
    responder = unit_keys(units[f"{svc.UNIT_DIR}/linkctl-responder.service"])
    plists = svc.render(prof, prof.host("mac"), paths)

    def plist_args(job: str) -> list[str]:
        return plistlib.loads(plists[f"{svc.LAUNCHD_DIR}/{svc.label(job)}.plist"].encode())[
            "ProgramArguments"
        ]

    procs: list[subprocess.Popen] = []

    def start(host: str, argv: list[str], prefix: list[str] | None = None) -> subprocess.Popen:
        full, env = _lab_argv(lab, host, argv)
        if prefix:
            full = full[:4] + prefix + full[4:]  # ip netns exec NS <setpriv ...> argv
        p = subprocess.Popen(
            full, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        procs.append(p)
        return p

    try:
        t0 = time.monotonic()
        dgx_setup = start("dgx", shlex.split(link["Service.ExecStartPre"][0]), _caps_prefix(link))
        mac_setup = start("mac", plist_args("link"))
        for p in (dgx_setup, mac_setup):
            out, err = p.communicate(timeout=90)
            assert p.returncode == 0, out + err
        setup_s = time.monotonic() - t0
        assert setup_s < 30
        print(f"cold boot of both hosts: setup with --wait-carrier done in {setup_s:.1f} s")
        for host in ("dgx", "mac"):
            st = lab.run(host, "status", "--profile", str(prof_path))
            assert st.returncode == 0, st.stdout + st.stderr

        start("dgx", shlex.split(responder["Service.ExecStart"][0]), _caps_prefix(responder))
        start("mac", plist_args("responder"))
        # The gate, retried as systemd would (Restart=on-failure) while responders bind.
        gate = shlex.split(link["Service.ExecStart"][0])
        t_gate = time.monotonic()
        deadline = time.monotonic() + 60
        while True:
            full, env = _lab_argv(lab, "dgx", gate)
            full = full[:4] + _caps_prefix(link) + full[4:]
            r = subprocess.run(full, env=env, capture_output=True, text=True, timeout=120)
            if r.returncode == 0 or time.monotonic() > deadline:
                break
            time.sleep(1)
        dead = [(q.args, q.returncode, q.communicate()) for q in procs[2:] if q.poll() is not None]
        assert r.returncode == 0, f"{r.stdout}{r.stderr}\nexited responders: {dead}"
        print(f"probe gate passed {time.monotonic() - t_gate:.1f} s after the responders started")
        # The head's probe daemon passes too (the serve gate on macOS reads its report).
        full, env = _lab_argv(lab, "mac", plist_args("probe"))
        r = subprocess.run(full, env=env, capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stdout + r.stderr
    finally:
        for p in procs:
            stop_process(p, 10, kill_wait=10)


@pytest.mark.netns
def test_wait_carrier_waits_for_the_peer_and_times_out_clearly(make_lab):
    """launchd cannot order on an interface: setup --wait-carrier waits itself, bounded."""
    lab = make_lab("dgx-mac")
    mac_ns = lab.netns("mac")
    # The Mac keeps en0 up; the peer's port is still down (it is booting).
    subprocess.run(["ip", "-n", mac_ns, "link", "set", "en0", "up"], check=True)
    before = ns_snapshot(mac_ns)
    t0 = time.monotonic()
    r = lab.run("mac", "setup", "--wait-carrier", "1.5")
    took = time.monotonic() - t0
    assert r.returncode == 2, r.stdout + r.stderr
    assert "no carrier on en0 after 1.5 s" in r.stderr and "waiting up to 1.5 s" in r.stderr
    assert took < 15
    assert ns_snapshot(mac_ns) == before  # nothing changed

    # Now the peer comes up while setup waits: setup proceeds.
    full, env = _lab_argv(lab, "mac", ["linkctl", "setup", "--wait-carrier", "30"])
    p = subprocess.Popen(full, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        seen = ""
        while "waiting up to 30 s for carrier on en0" not in seen:
            line = p.stderr.readline()  # bounded: setup gives up after 30 s
            assert line, f"setup never said it was waiting: {seen}"
            seen += line
        time.sleep(1)
        subprocess.run(["ip", "-n", lab.netns("dgx"), "link", "set", "enP7s7", "up"], check=True)
        out, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 0, out + seen + err
    assert "carrier on en0 after" in err
    addrs = subprocess.run(
        ["ip", "-n", mac_ns, "-4", "-o", "addr", "show", "en0"], capture_output=True, text=True
    ).stdout
    assert lab.host("mac")["address"].split("/")[0] in addrs


@pytest.mark.netns
@pytest.mark.llama
def test_rpc_serve_unit_runs_without_any_capability(make_lab, tmp_path):
    """The rpc host's serve unit, as rendered: its ExecStart with its Environment, under
    its empty CapabilityBoundingSet= and NoNewPrivileges: rpc-server comes up on the link
    address and answers HELLO from the head."""
    from support.llama_util import need_llama

    need_tool("setpriv")
    bins = need_llama()
    lab = make_lab("dgx-mac")
    for host in ("dgx", "mac"):
        full, env = _lab_argv(lab, host, ["linkctl", "setup"])
        subprocess.Popen(full, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for host in ("dgx", "mac"):
        deadline = time.monotonic() + 60
        while lab.run(host, "status").returncode != 0:
            assert time.monotonic() < deadline, f"setup on {host} did not finish"
            time.sleep(0.5)
    prof = parse_profile(tomllib.loads(Path(lab.profile_path).read_text()))
    exe = shutil.which("linkctl") or str(Path(sys.executable).parent / "linkctl")
    bin_dir = str(Path(bins.rpc_server.path).parent)
    paths = svc.ServicePaths(linkctl_bin=exe, llama_bin_dir=bin_dir, profile_path=lab.profile_path)
    unit = unit_keys(
        svc.render(prof, prof.host("dgx"), paths)[f"{svc.UNIT_DIR}/linkctl-serve.service"]
    )
    assert unit["Service.CapabilityBoundingSet"] == [""]
    env_unit = dict(e.split("=", 1) for e in unit["Service.Environment"])
    assert env_unit["LINKCTL_LLAMA_BIN"] == bin_dir
    full, env = _lab_argv(lab, "dgx", shlex.split(unit["Service.ExecStart"][0]))
    # StateDirectory=/CacheDirectory= stand-ins; LINKCTL_LLAMA_BIN as the unit sets it.
    env.update(
        env_unit,
        LINKCTL_STATE_DIR=str(tmp_path / "state"),
        LLAMA_CACHE=str(tmp_path / "cache"),
        XDG_CACHE_HOME=str(tmp_path / "cache"),
    )
    full = [
        *full[:4],
        "setpriv",
        "--no-new-privs",
        "--bounding-set=-all",
        "--inh-caps=-all",
        *full[4:],
    ]
    p = subprocess.Popen(full, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        dgx = prof.host("dgx")
        ask = f"from linkctl.llama import rpc; print(rpc.hello({dgx.ip!r}, {dgx.rpc.port}, 2.0))"
        deadline = time.monotonic() + 60
        while True:
            assert p.poll() is None, p.communicate()[0]
            r = lab.exec("mac", sys.executable, "-c", ask, timeout=30)
            if r.returncode == 0 or time.monotonic() > deadline:
                break
            time.sleep(1)
        assert r.returncode == 0, r.stdout + r.stderr
        assert r.stdout.strip().startswith("(")
    finally:
        stop_process(p, 20, kill_wait=10)


def test_manager_commands_for_the_real_system():
    """What install runs on / (it cannot run here: no systemd as PID 1, no launchd):
    reload only when something changed, start without blocking on the gate, and
    launchd jobs reloaded only when their plist changed."""
    prof, _ = load_profile("dgx-mac")

    def commands(host, files: list[svc.FileAction]) -> list[list[str]]:
        mgr = svc.manager_for(host)
        return mgr.install_commands(mgr.service_names(), files)

    files = [svc.FileAction(f"{svc.UNIT_DIR}/{u}", svc.Action.UNCHANGED) for u in svc.SYSTEMD_UNITS]
    cmds = commands(prof.host("dgx"), files)
    assert cmds == [["systemctl", "enable", "--now", "--no-block", *svc.SYSTEMD_UNITS]]
    files[0].action = svc.Action.UPDATE
    cmds = commands(prof.host("dgx"), files)
    assert cmds[0] == ["systemctl", "daemon-reload"]
    assert cmds[-1] == ["systemctl", "try-restart", "--no-block", "linkctl-link.service"]

    mac = prof.host("mac")
    plist = f"{svc.LAUNCHD_DIR}/com.linkctl.serve.plist"
    assert commands(mac, [svc.FileAction(plist, svc.Action.UNCHANGED)]) == [
        ["launchctl", "enable", "system/com.linkctl.serve"],
        ["launchctl", "bootstrap", "system", plist],
    ]
    assert commands(mac, [svc.FileAction(plist, svc.Action.UPDATE)])[0] == [
        "launchctl",
        "bootout",
        "system/com.linkctl.serve",
    ]
