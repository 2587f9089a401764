"""linkctl doctor: the real CLI in lab namespaces (before/after setup, three hosts, real and
stand-in rpc-servers), the check logic against the macOS replay runner, and the
probe-report and service lines against real files."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest
import tomli_w

from linkctl import doctor
from linkctl.core.checks import Check
from linkctl.core.profile import load_profile
from linkctl.probe import report as probe_report
from support.cli import linkctl
from support.lab import ns_snapshot
from support.llama_util import need_llama, start_fake, stop
from support.paths import PROFILES

KEYS = {"check", "verdict", "value", "detail", "fix"}
NET = ("interface", "speed", "duplex", "address", "mtu", "default route")


def run_doctor(lab, host: str, *extra: str) -> tuple[subprocess.CompletedProcess, dict, list]:
    r = lab.run(host, "doctor", "--json", "--peer-timeout", "1", *extra, timeout=60)
    assert r.returncode in (0, 1), r.stderr
    assert "Traceback" not in r.stderr
    out = json.loads(r.stdout)
    given = extra[extra.index("--profile") + 1] if "--profile" in extra else lab.profile_path
    assert out["profile_path"] == given and out["exit_code"] == r.returncode
    lines = out["checks"]
    return r, {ln["check"]: ln for ln in lines}, lines


def check_shape(lines: list[dict], returncode: int) -> None:
    for ln in lines:
        assert set(ln) == KEYS, ln
        assert ln["verdict"] in ("PASS", "WARN", "FAIL", "SKIP"), ln
        if ln["verdict"] in ("FAIL", "WARN"):
            assert ln["fix"], f"{ln['check']} {ln['verdict']} without a fix"
        json.dumps(ln)
    assert returncode == (1 if any(ln["verdict"] == "FAIL" for ln in lines) else 0)


def verdicts(by: dict, *names: str) -> dict[str, str]:
    return {n: by[n]["verdict"] for n in names}


def snapshots(lab, hosts) -> dict:
    """Each namespace as `ip -j` reads it, and each host's state directory (setup records,
    probe reports); only linkctl.llama.bins's cache of the local RPC protocol may appear."""
    out = {}
    for h in hosts:
        state = Path(lab.info["root"]) / "hosts" / h
        files = {
            str(p.relative_to(state)): p.read_bytes()
            for p in sorted(state.rglob("*"))
            if p.is_file() and "llama" not in p.relative_to(state).parts
        }
        out[h] = {"net": ns_snapshot(lab.netns(h)), "state": files}
    return out


# ---- the lab: two hosts ---------------------------------------------------------------------


def test_before_and_after_setup_and_doctor_changes_nothing(lab, tmp_path):
    hosts = ("dgx", "mac")
    before = snapshots(lab, hosts)
    r, by, lines = run_doctor(lab, "dgx", "--root", str(tmp_path))
    check_shape(lines, r.returncode)
    assert r.returncode == 1
    order = [ln["check"] for ln in lines]
    assert order[:8] == ["profile", "host", *NET]
    assert order[8:] == [
        "peer mac", "llama binaries", "rpc protocol", "watch echo", "services", "probe report"
    ]  # fmt: skip
    assert by["host"]["value"] == "dgx" and "LINKCTL_HOST" in by["host"]["detail"]
    assert (by["address"]["verdict"], by["address"]["fix"]) == ("FAIL", "linkctl setup")
    assert (by["interface"]["verdict"], by["interface"]["fix"]) == ("FAIL", "linkctl setup")
    assert (by["mtu"]["verdict"], by["mtu"]["value"]) == ("FAIL", 1500)
    assert verdicts(by, "speed", "duplex", "peer mac") == dict.fromkeys(
        ("speed", "duplex", "peer mac"), "SKIP"
    )
    assert by["default route"]["verdict"] == "PASS" and by["default route"]["value"] == "wlan0"
    assert by["services"]["verdict"] == "WARN"
    assert "linkctl service install" in by["services"]["fix"]
    assert (by["probe report"]["verdict"], by["probe report"]["fix"]) == ("WARN", "linkctl probe")
    # The same in text: one line per check, the fix on the FAIL line.
    t = lab.run("dgx", "doctor", "--peer-timeout", "1", "--root", str(tmp_path))
    assert t.returncode == 1
    address = next(x for x in t.stdout.splitlines() if x.split()[:2] == ["FAIL", "address"])
    assert address.endswith("fix: linkctl setup")
    assert snapshots(lab, hosts) == before, "doctor changed the namespaces"
    # The profile names an interface this machine does not have: FAIL naming the ones it
    # has; everything that needs it skips (and no ARP goes anywhere).
    data = tomllib.loads(Path(lab.profile_path).read_text())
    next(h for h in data["hosts"] if h["name"] == "dgx")["interface"] = "nosuch0"
    (tmp_path / "noif.toml").write_text(tomli_w.dumps(data))
    r, by, lines = run_doctor(
        lab, "dgx", "--profile", str(tmp_path / "noif.toml"), "--root", str(tmp_path)
    )
    assert r.returncode == 1 and by["interface"]["verdict"] == "FAIL"
    assert "nosuch0" in by["interface"]["detail"] and "enP7s7" in by["interface"]["fix"]
    skipped = ("speed", "duplex", "address", "mtu", "peer mac")
    assert verdicts(by, *skipped) == dict.fromkeys(skipped, "SKIP")
    assert by["default route"]["verdict"] == "PASS"
    # Without LINKCTL_HOST: detected (the only linux host whose interface exists here).
    d = lab.exec("dgx", "env", "-u", "LINKCTL_HOST", sys.executable, "-m", "linkctl", "doctor")
    assert "PASS host" in d.stdout and "detected" in d.stdout, d.stdout + d.stderr

    for h in hosts:
        s = lab.run(h, "setup")
        assert s.returncode == 0, s.stderr
    configured = snapshots(lab, hosts)
    for me, peer in (("dgx", "mac"), ("mac", "dgx")):
        r, by, lines = run_doctor(lab, me, "--root", str(tmp_path))
        check_shape(lines, r.returncode)
        want = ("interface", "address", "mtu", "default route", f"peer {peer}", "speed", "duplex")
        assert verdicts(by, *want) == dict.fromkeys(want, "PASS"), lines
        assert by["mtu"]["value"] == 9000
        assert by["address"]["value"] == lab.host(me)["address"]
        assert by[f"peer {peer}"]["value"] == mac_of(lab, peer)
        assert by["default route"]["value"] == "wlan0"
    # From the head (the last run), the rpc host's rpc-server: nothing listens yet.
    assert by["rpc dgx"]["verdict"] == "SKIP"
    if by["rpc protocol"]["verdict"] == "PASS":
        assert "nothing listens on 198.18.100.2:50052" in by["rpc dgx"]["detail"]
    assert snapshots(lab, hosts) == configured, "doctor changed the namespaces"

    # A pinned MAC: the right one passes, a wrong one fails naming both.
    data = tomllib.loads(Path(lab.profile_path).read_text())
    for pinned, verdict in ((mac_of(lab, "dgx"), "PASS"), ("02:00:00:00:00:01", "FAIL")):
        next(h for h in data["hosts"] if h["name"] == "dgx")["mac"] = pinned
        path = tmp_path / f"pinned-{verdict}.toml"
        path.write_text(tomli_w.dumps(data))
        r, by, lines = run_doctor(lab, "mac", "--profile", str(path), "--root", str(tmp_path))
        assert by["peer dgx"]["verdict"] == verdict, by["peer dgx"]
        assert (
            pinned in by["peer dgx"]["detail"]
            or "matches the pinned MAC" in by["peer dgx"]["detail"]
        )
    assert "swapped cable" in by["peer dgx"]["detail"] or "cable" in by["peer dgx"]["fix"]

    # The default route moved onto the link port: FAIL with the fix.
    subprocess.run(
        ["ip", "-n", lab.netns("dgx"), "route", "replace", "default", "via", "198.18.100.1"],
        check=True,
    )
    r, by, lines = run_doctor(lab, "dgx", "--root", str(tmp_path))
    assert (by["default route"]["verdict"], by["default route"]["value"]) == ("FAIL", "enP7s7")
    assert "WiFi" in by["default route"]["fix"] and r.returncode == 1


def test_watch_echo_line(lab, tmp_path):
    # The lab's namespaces let every group open datagram ICMP sockets (linkctl.lab.netns).
    r, by, lines = run_doctor(lab, "dgx", "--root", str(tmp_path))
    check_shape(lines, r.returncode)
    assert (by["watch echo"]["verdict"], by["watch echo"]["value"]) == ("PASS", "0 2147483647")
    # As a Debian 12 host has it: no group may; WARN, the line to run as the fix.
    ns = ["ip", "netns", "exec", lab.netns("dgx"), "sh", "-c"]
    subprocess.run([*ns, "echo '1 0' > /proc/sys/net/ipv4/ping_group_range"], check=True)
    r, by, lines = run_doctor(lab, "dgx", "--root", str(tmp_path))
    check_shape(lines, r.returncode)
    line = by["watch echo"]
    assert (line["verdict"], line["value"]) == ("WARN", "1 0"), line
    assert "cannot echo the peer" in line["detail"], line
    assert line["fix"].startswith("sysctl -w net.ipv4.ping_group_range='0 2147483647'"), line


def mac_of(lab, host: str) -> str:
    iface = lab.host(host)["interface"]
    out = subprocess.run(
        ["ip", "-n", lab.netns(host), "-j", "link", "show", iface],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return json.loads(out)[0]["address"]


def test_bad_profile_is_one_line_and_exit_2(tmp_path):
    bad = tmp_path / "bad.toml"
    text = (PROFILES / "dgx-mac.toml").read_text()
    bad.write_text(text.replace("mtu = 9000", "mtu = 99999"))
    r = linkctl("doctor", "--profile", str(bad))
    assert r.returncode == 2, r.stdout + r.stderr
    assert len(r.stdout.splitlines()) == 1 and r.stderr == ""
    assert r.stdout.startswith("FAIL") and "link.mtu" in r.stdout and "99999" in r.stdout
    j = linkctl("doctor", "--profile", str(bad), "--json")
    assert j.returncode == 2
    out = json.loads(j.stdout)
    assert (out["profile_path"], out["exit_code"]) == (None, 2)
    [line] = out["checks"]
    assert (line["check"], line["verdict"], set(line)) == ("profile", "FAIL", KEYS)
    # A host that is not in the profile is bad input too; nothing after it runs.
    h = linkctl("doctor", "--profile", "dgx-mac", "--host", "nope", "--json")
    assert h.returncode == 2
    out = json.loads(h.stdout)
    assert out["profile_path"] == str(PROFILES / "dgx-mac.toml")
    assert [(x["check"], x["verdict"]) for x in out["checks"]] == [
        ("profile", "PASS"),
        ("host", "FAIL"),
    ]


# ---- the lab: three hosts on a switch, rpc-servers real and stand-in ---------------------------


def _listening(netns: str, port: int, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        out = subprocess.run(
            ["ip", "netns", "exec", netns, "ss", "-Hltn", f"sport = :{port}"],
            capture_output=True,
            text=True,
        ).stdout
        if out.strip():
            return
        time.sleep(0.05)
    raise TimeoutError(f"nothing listens on :{port} in {netns}")


HOLD = """
import socket, struct, sys, time
s = socket.create_connection(("198.18.100.2", 50052), timeout=5)
s.sendall(struct.pack("<BQ", 14, 24) + bytes(24))  # HELLO (linkctl.llama.rpc.RpcCmd), 7.x caps
n = struct.unpack("<Q", s.recv(8))[0]
s.recv(n)
print("held", flush=True)
time.sleep(60)
"""


def test_three_hosts_peers_and_rpc_versions_from_the_head(make_lab, tmp_path):
    bins = need_llama()
    lab = make_lab("dgx2-mac-switch")
    hosts = ("dgx1", "dgx2", "mac")
    for h in hosts:
        s = lab.run(h, "setup")
        assert s.returncode == 0, s.stderr
    configured = snapshots(lab, hosts)

    # Real ggml-rpc-server on dgx1, a protocol 3.0.0 stand-in on dgx2.
    rpc_argv = [bins.rpc_server.path, "-H", "198.18.100.2", "-p", "50052"]
    real = subprocess.Popen(
        ["ip", "netns", "exec", lab.netns("dgx1"), *rpc_argv],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    fake = start_fake(
        "v3", 50052, host="198.18.100.3", prefix=["ip", "netns", "exec", lab.netns("dgx2")]
    )
    holder = None
    try:
        _listening(lab.netns("dgx1"), 50052)
        r, by, lines = run_doctor(lab, "mac", "--root", str(tmp_path))
        check_shape(lines, r.returncode)
        want = ("address", "mtu", "default route", "peer dgx1", "peer dgx2", "rpc protocol")
        assert verdicts(by, *want) == dict.fromkeys(want, "PASS"), lines
        local = by["rpc protocol"]["value"]
        assert by["rpc dgx1"]["verdict"] == "PASS" and by["rpc dgx1"]["value"] == local
        assert by["rpc dgx2"]["verdict"] == "FAIL" and r.returncode == 1
        assert "3.0.0" in by["rpc dgx2"]["detail"] and local in by["rpc dgx2"]["detail"]
        assert "build-llama.sh" in by["rpc dgx2"]["fix"]

        # A client holds dgx1's rpc-server: doctor says busy, within its timeout.
        holder = subprocess.Popen(
            ["ip", "netns", "exec", lab.netns("mac"), sys.executable, "-c", HOLD],
            stdout=subprocess.PIPE,
            text=True,
        )
        assert holder.stdout.readline().strip() == "held"
        t0 = time.monotonic()
        r, by, lines = run_doctor(lab, "mac", "--root", str(tmp_path))
        assert time.monotonic() - t0 < 20
        assert by["rpc dgx1"]["verdict"] == "WARN"
        assert "busy (llama-server connected)" in by["rpc dgx1"]["detail"]
        stop(holder)
        holder = None
        # doctor's unanswered HELLO left the real server able to serve the next client.
        r, by, lines = run_doctor(lab, "mac", "--root", str(tmp_path))
        assert by["rpc dgx1"]["verdict"] == "PASS", by["rpc dgx1"]
        assert real.poll() is None
    finally:
        if holder:
            stop(holder)
        stop(fake)
        stop(real)

    # dgx2 goes away from the segment: its peer line fails with the fix, its rpc line skips.
    assert lab.run("dgx2", "teardown").returncode == 0
    r, by, lines = run_doctor(lab, "mac", "--root", str(tmp_path))
    check_shape(lines, r.returncode)
    assert by["peer dgx1"]["verdict"] == "PASS"
    assert by["peer dgx2"]["verdict"] == "FAIL" and "dgx2" in by["peer dgx2"]["fix"]
    assert "no ARP reply" in by["peer dgx2"]["detail"]
    assert by["rpc dgx2"]["verdict"] == "SKIP"
    configured["dgx2"] = snapshots(lab, ["dgx2"])["dgx2"]
    assert snapshots(lab, hosts) == configured


# ---- the same logic against the macOS backend (replayed macOS command output) ---------------


@pytest.fixture
def isolated(tmp_path, monkeypatch):
    monkeypatch.setenv("LINKCTL_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.delenv("LINKCTL_HOST", raising=False)
    monkeypatch.delenv("LINKCTL_PROFILE", raising=False)
    arp_sent: list[tuple[str, str]] = []

    def who_has(ifname, target, **kw):
        arp_sent.append((ifname, target))
        return ["aa:bb:cc:00:00:02"]

    monkeypatch.setattr("linkctl.net.arp.who_has", who_has)
    return arp_sent


def _hello_refused(calls):
    from linkctl.core.errors import ConnectionRefused

    def hello(host, port, timeout):
        calls.append((host, port))
        raise ConnectionRefused(
            f"rpc endpoint {host}:{port}: connection refused (nothing listens there)",
            host=host,
            port=port,
        )

    return hello


def test_macos_backend_configured_mac(isolated, tmp_path):
    from support.macos_replay import backend, configured, mac_studio

    runner = configured(mac_studio())
    calls: list = []
    res = doctor.run(
        "dgx-mac",
        "mac",
        backend=backend(runner),
        service_root=tmp_path,
        hello=_hello_refused(calls),
    )
    by = {ln.name: ln for ln in res.lines}
    want = ("profile", "host", *NET, "peer dgx")
    assert {n: by[n].verdict for n in want} == dict.fromkeys(want, "PASS"), res.as_json()
    assert (by["speed"].value, by["duplex"].value, by["mtu"].value) == (10000, "full", 9000)
    assert by["default route"].value == "en1"
    assert (by["watch echo"].verdict, by["watch echo"].value) == ("PASS", None)
    assert isolated == [("en0", "192.168.100.2")]
    assert runner.unexpected == [] and runner.changes() == []
    # The rpc line either asked the (stand-in) endpoint or skipped for want of a local build.
    assert calls in ([], [("192.168.100.2", 50052)])
    assert by["rpc dgx"].verdict == "SKIP"


def test_macos_backend_before_setup_and_at_1g(isolated, tmp_path):
    from support.macos_replay import CONFIGURED, argv, backend, configured, mac_studio, out

    runner = mac_studio()
    calls: list = []
    hello = _hello_refused(calls)
    res = doctor.run("dgx-mac", "mac", backend=backend(runner), service_root=tmp_path, hello=hello)
    by = {ln.name: ln for ln in res.lines}
    assert (by["address"].verdict, by["address"].fix) == ("FAIL", "linkctl setup")
    assert (by["mtu"].verdict, by["mtu"].value) == ("FAIL", 1500)
    assert by["peer dgx"].verdict == "SKIP" and isolated == [] and calls == []
    assert res.exit_code == 1 and runner.changes() == []

    slow = configured(mac_studio())
    slow.answers.update(CONFIGURED)
    slow.answers[argv("ifconfig en0")] = out("ifconfig-en0-linkctl-1000baseT-constructed.txt")
    res = doctor.run("dgx-mac", "mac", backend=backend(slow), service_root=tmp_path, hello=hello)
    speed = next(ln for ln in res.lines if ln.name == "speed")
    assert (speed.verdict, speed.value) == ("WARN", 1000)
    assert "1 Gbit/s" in speed.detail and "10 Gbit/s" in speed.detail and "cable" in speed.fix
    assert slow.changes() == []


# ---- probe report and services lines against real files ----------------------------------------


def _report(prof, host, peer, ok: bool, at: float):
    from datetime import UTC, datetime

    r = probe_report.ProbeReport(
        prof.name,
        host.name,
        peer.name,
        peer.ip,
        time=datetime.fromtimestamp(at, UTC).isoformat(timespec="seconds"),
    )
    r.add("carrier", "PASS", True, True)
    if not ok:
        r.add("throughput", "FAIL", 1.0, 8.0)
    probe_report.save(r)


@pytest.mark.parametrize("me", ["mac", "dgx"])
def test_probe_report_line(isolated, me):
    prof = load_profile("dgx-mac")[0]
    host = prof.host(me)
    peer = prof.host("dgx" if me == "mac" else "mac")
    now = time.time()

    def line(at: float) -> Check:
        res = doctor.DoctorResult()
        doctor.check_probe_report(res, prof, host, now=at)
        [ln] = res.lines
        return ln

    assert (line(now).verdict, line(now).fix) == ("WARN", "linkctl probe")
    _report(prof, host, peer, ok=True, at=now - 60)
    assert line(now).verdict == "PASS"
    assert line(now + 25 * 3600).verdict == "WARN" and "old" in line(now + 25 * 3600).detail
    _report(prof, host, peer, ok=False, at=now - 30)
    failed = line(now)
    assert failed.verdict == "WARN" and "throughput" in failed.detail


def test_services_line(isolated, tmp_path):
    from linkctl import service as svc
    from support.service_kit import make_target, target_paths

    prof = load_profile("dgx-mac")[0]
    dgx, mac = prof.host("dgx"), prof.host("mac")

    def line(host) -> Check:
        res = doctor.DoctorResult()
        doctor.check_services(res, prof, host, "dgx-mac", root)
        [ln] = res.lines
        return ln

    root = make_target(tmp_path / "root")
    ln = line(dgx)
    assert ln.verdict == "WARN"
    assert ln.fix == "sudo linkctl service install --profile dgx-mac --host dgx"
    svc.install(prof, dgx, target_paths("dgx-mac"), root=root)
    assert line(dgx).verdict == "PASS"
    assert line(mac).verdict == "WARN" and "dgx-mac/dgx" in line(mac).detail
    unit = root / "etc/systemd/system/linkctl-serve.service"
    unit.write_text(unit.read_text() + "\n# edited\n")
    ln = line(dgx)
    assert ln.verdict == "WARN" and "modified" in ln.detail and "install" in ln.fix


def test_llama_lines_without_binaries(isolated, tmp_path, monkeypatch):
    """No llama.cpp build anywhere: the role's binary FAILs with the build fix, and what
    needs it skips (find_bins runs for real, over an empty search path)."""
    monkeypatch.setattr("linkctl.llama.bins.CACHE_ROOTS", ())
    monkeypatch.setenv("LINKCTL_LLAMA_BIN", str(tmp_path))
    monkeypatch.setenv("PATH", str(tmp_path))
    prof = load_profile("dgx-mac")[0]
    res = doctor.DoctorResult()
    doctor.check_llama(res, prof, prof.host("dgx"), {}, 1.0)
    doctor.check_llama(res, prof, prof.host("mac"), {"dgx": True}, 1.0)
    got = [(ln.name, ln.verdict) for ln in res.lines]
    assert got == [
        ("llama binaries", "FAIL"),
        ("rpc protocol", "SKIP"),
        ("llama binaries", "FAIL"),
        ("rpc protocol", "WARN"),
        ("rpc dgx", "SKIP"),
    ]
    assert "ggml-rpc-server" in res.lines[0].detail and "build-llama.sh" in res.lines[0].fix
    assert "llama-server" in res.lines[2].detail
