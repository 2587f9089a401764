"""The rendered units under a real systemd as PID 1: both hosts of dgx-mac booted as
containers (systemd-nspawn, a Debian rootfs built with mmdebstrap) inside the lab's
namespaces, through install + reboot, kill -9, a pulled cable, a power cut and
uninstall + reboot. Nobody runs linkctl inside after `service install`: whatever
comes up, systemd started. The Mac is played by a Linux container in the head role.

Each test stands alone. The tests of TestInstalledPair share one pair, installed,
rebooted and answering (class fixture ``pair``); one that changes that state puts it
back. The others boot labs of their own and prove the host is as before. Figures
(seconds) print at the end (pytest -s).
"""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from linkctl.core.profile import load_profile
from linkctl.core.runner import Result
from linkctl.lab import boot, netns, rootfs
from linkctl.lab.container import Container
from linkctl.service import device_unit
from support import boot_kit as kit
from support.cli import need_tool

pytestmark = [pytest.mark.netns, pytest.mark.llama]

FIGURES: dict[str, float] = {}
UNITS = ("linkctl-link.service", "linkctl-responder.service", "linkctl-serve.service")
SERVERS = {"rpc": "ggml-rpc-server", "head": "llama-server"}
DEADLINE = 240.0  # generous: other jobs share the 2 cores

PIDS = r"""
import os, sys
for p in os.listdir("/proc"):
    if p.isdigit():
        try:
            if open(f"/proc/{p}/comm").read().strip() == sys.argv[1]:
                print(p)
        except OSError:
            pass
"""


def say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def linkctl_files(c: Container) -> str:
    """Every file named *linkctl* under /etc (units, wants links, drop-ins, profiles);
    the harness's own udev-trigger drop-in is one of them from the start."""
    r = c.exec(["find", "/etc", "-name", "*linkctl*"], check=False)
    return "\n".join(sorted(r.stdout.split()))


def pids(c: Container, comm: str) -> list[int]:
    r = c.exec(["python3", "-c", PIDS, comm[:15]], timeout=30)
    return [int(x) for x in r.stdout.split()]


def kill9(c: Container, pid: int) -> None:
    c.exec(["python3", "-c", f"import os, signal; os.kill({pid}, signal.SIGKILL)"], timeout=30)


def port(c: Container, ifname: str) -> dict:
    link = json.loads(c.exec(["ip", "-j", "addr", "show", "dev", ifname]).stdout)[0]
    return {
        "mtu": link["mtu"],
        "up": "UP" in link["flags"],
        "inet": sorted(
            f"{a['local']}/{a['prefixlen']}" for a in link["addr_info"] if a["family"] == "inet"
        ),
    }


def default_route(c: Container) -> list[str]:
    return [r["dev"] for r in json.loads(c.exec(["ip", "-j", "route", "show", "default"]).stdout)]


def record(what: str, seconds: float) -> None:
    FIGURES.setdefault(what, round(seconds, 1))  # the first of its kind (labs repeat some)
    say(f"boot figure: {what}: {seconds:.1f} s")


@pytest.fixture(scope="module", autouse=True)
def _figures():
    yield
    if FIGURES:
        say("boot figures: " + json.dumps(FIGURES, indent=1))


def wait_answers(bl: boot.BootLab, what: str, timeout: float = DEADLINE) -> float:
    return kit.wait_for(
        lambda: kit.answers(bl), timeout, f"{what}: a completion through the head", step=0.5
    )


@dataclass
class Installed:
    """A booted pair after `service install` + reboot, and what it was before install."""

    bl: boot.BootLab
    ports_before: dict[str, dict]  # per host: its link port before install
    files_before: dict[str, str]  # per host: linkctl_files() before install
    install: dict[str, Result]  # per host: what `service install` printed

    def install_and_reboot(self) -> None:
        self.install = self.bl.install_services()
        t0 = time.monotonic()
        record("reboot of both (systemctl reboot) to booted", self.bl.reboot_all())
        wait_answers(self.bl, "after install + reboot")
        record("reboot command to first completion through the pair", time.monotonic() - t0)


@contextlib.contextmanager
def installed_pair(image: rootfs.Image, model: Path, prefix: str) -> Iterator[Installed]:
    """dgx-mac booted (llama.cpp and the model bound), the services installed, rebooted
    and answering; everything removed at the end."""
    profile, _ = load_profile("dgx-mac")
    llama = boot.llama_dir()
    assert llama is not None, "llama.cpp build not found"
    bl = boot.BootLab(profile, prefix + uuid.uuid4().hex[:7], image, llama, model, log=say)
    t0 = time.monotonic()
    bl.__enter__()
    try:
        record("lab up + 2 containers created + first boot", time.monotonic() - t0)
        spec = {h.name: h for h in profile.hosts}
        pair = Installed(
            bl,
            {n: port(c, spec[n].interface) for n, c in bl.containers.items()},
            {n: linkctl_files(c) for n, c in bl.containers.items()},
            {},
        )
        pair.install_and_reboot()
        yield pair
    finally:
        bl.down()


@pytest.fixture(scope="class")
def pair(image, model):
    """One installed pair per class: removed when the class's last test is done."""
    with installed_pair(image, model, "b") as p:
        yield p


class TestInstalledPair:
    """Every test starts from the pair installed, rebooted and answering."""

    def test_install_then_reboot_brings_everything_up(self, pair):
        bl = pair.bl
        spec = {h.name: h for h in bl.profile.hosts}
        lab_hosts = {h.name: h for h in bl.lab.hosts}
        for n, p in pair.ports_before.items():
            assert p == {"mtu": 1500, "up": False, "inet": []}, (n, p)
        for n, c in bl.containers.items():
            for u in UNITS:
                assert (c.root / "etc/systemd/system" / u).is_file(), pair.install[n].stdout
        for n, c in bl.containers.items():
            h = spec[n]
            dev = device_unit(h.interface)
            d = kit.unit_props(c, dev, "ActiveState", "ActiveEnterTimestampMonotonic")
            assert d["ActiveState"] == "active", (n, d)
            link = kit.unit_props(
                c, UNITS[0], "ActiveState", "Result", "SubState", "ExecMainStartTimestampMonotonic"
            )
            assert (link["ActiveState"], link["SubState"], link["Result"]) == (
                "active",
                "exited",
                "success",
            ), (n, link, c.exec(["journalctl", "-b", "-u", UNITS[0], "--no-pager"]).stdout[-3000:])
            # The link unit ran once its device unit appeared, not before.
            assert int(link["ExecMainStartTimestampMonotonic"]) >= int(
                d["ActiveEnterTimestampMonotonic"]
            )
            # The probe gate passed: the journal has the probe's verdict, the unit succeeded.
            assert port(c, h.interface) == {
                "mtu": bl.profile.link.mtu,
                "up": True,
                "inet": [lab_hosts[n].address],
            }
            assert default_route(c) == [netns.WIFI_IF], n
            for u in UNITS[1:]:
                st = kit.unit_props(c, u, "ActiveState", "SubState")
                assert st == {"ActiveState": "active", "SubState": "running"}, (n, u, st)
            assert pids(c, SERVERS[h.role]), (n, SERVERS[h.role])
        out = kit.answers(bl)
        assert out and out.get("tokens_predicted", 0) > 0, out

    @pytest.mark.parametrize("role", ["rpc", "head"])
    def test_kill9_server_recovers(self, pair, role):
        """kill -9 of rpc-server / llama-server: its supervisor (`linkctl serve`, a systemd
        unit) starts it again and the pair answers again."""
        bl = pair.bl
        host = bl.profile.head if role == "head" else bl.profile.rpc_hosts[0]
        c = bl.containers[host.name]
        assert kit.answers(bl)
        old = pids(c, SERVERS[role])
        assert len(old) == 1, old
        t0 = time.monotonic()
        kill9(c, old[0])
        kit.wait_for(lambda: not kit.answers(bl), 30, f"{SERVERS[role]} killed", step=0.2)
        wait_answers(bl, f"after kill -9 of {SERVERS[role]}")
        record(f"kill -9 {SERVERS[role]} to a completion again", time.monotonic() - t0)
        new = pids(c, SERVERS[role])
        assert new and new != old

    def test_kill9_serve_unit_restarted_by_systemd(self, pair):
        """kill -9 of the rpc host's `linkctl serve` (the unit's main process): systemd
        (Restart=on-failure) starts the unit again; the head's serve brings llama-server
        back once rpc-server answers."""
        bl = pair.bl
        c = bl.containers[bl.profile.rpc_hosts[0].name]
        st = kit.unit_props(c, UNITS[2], "MainPID", "NRestarts")
        t0 = time.monotonic()
        kill9(c, int(st["MainPID"]))
        kit.wait_for(
            lambda: (
                int(kit.unit_props(c, UNITS[2], "NRestarts")["NRestarts"]) > int(st["NRestarts"])
            ),
            60,
            "systemd restarting linkctl-serve",
        )
        wait_answers(bl, "after kill -9 of the rpc host's linkctl serve")
        record(
            "kill -9 rpc host's linkctl serve (systemd restart) to a completion",
            time.monotonic() - t0,
        )

    def test_unplugged_cable_link_units_stop_and_come_back(self, pair):
        bl = pair.bl
        assert kit.answers(bl)
        kit.unplug(bl.lab)
        try:
            for n, c in bl.containers.items():
                kit.wait_for(
                    lambda c=c: (
                        kit.unit_props(c, UNITS[0], "ActiveState")["ActiveState"] == "inactive"
                    ),
                    60,
                    f"{n}: link unit stopping with its device",
                )
                assert kit.unit_props(c, UNITS[2], "ActiveState")["ActiveState"] == "inactive"
            assert not kit.answers(bl)
        finally:
            t0 = time.monotonic()
            kit.plug(bl.lab)
        wait_answers(bl, "after the cable came back")
        record("cable re-plugged to a completion again", time.monotonic() - t0)
        for n, c in bl.containers.items():
            st = kit.unit_props(c, UNITS[0], "ActiveState", "Result")
            assert st == {"ActiveState": "active", "Result": "success"}, (n, st)
            for u in UNITS[1:]:
                assert kit.unit_props(c, u, "ActiveState")["ActiveState"] == "active", (n, u)
            assert port(c, bl.profile.host(n).interface)["mtu"] == bl.profile.link.mtu

    def test_power_cut_then_boot(self, pair):
        bl = pair.bl
        kit.power_cut_all(bl)
        for c in bl.containers.values():
            assert not c.running
        t0 = time.monotonic()
        bl.boot_all()
        wait_answers(bl, "after a power cut and boot")
        record("power cut, boot to a completion again", time.monotonic() - t0)

    def test_uninstall_then_reboot_nothing_runs(self, pair):
        bl = pair.bl
        try:
            for n in bl.containers:
                r = bl.linkctl(n, "service", "uninstall")
                assert r.ok, r.stderr
            bl.reboot_all()
            for n, c in bl.containers.items():
                h = bl.profile.host(n)
                assert linkctl_files(c) == pair.files_before[n]
                units = c.exec(
                    ["systemctl", "list-units", "--all", "--no-legend", "linkctl*"]
                ).stdout
                assert units.strip() == "", units
                for comm in ("linkctl", "ggml-rpc-server", "llama-server", "iperf3"):
                    assert pids(c, comm) == [], (n, comm)
                assert port(c, h.interface) == {"mtu": 1500, "up": False, "inet": []}
                assert default_route(c) == [netns.WIFI_IF]
        finally:
            pair.install_and_reboot()  # the class's pair, as the next test expects it


def test_teardown_leaves_nothing_and_host_unchanged(image, model, host_before):
    """A pair serving through its installed units, removed: nothing of it is left and
    this machine's own state is as it was before the first image or lab."""
    with installed_pair(image, model, "t") as pair:
        names, lab_name = kit.container_names(pair.bl), pair.bl.name
    assert kit.leftovers(names, lab_name) == []
    assert kit.snapshot_diff(host_before, kit.host_snapshot()) == []


def test_ctrl_c_removes_everything(image, host_before):
    """`linkctl lab boot` interrupted while its containers run removes them all."""
    name = "c" + uuid.uuid4().hex[:7]
    proc = subprocess.Popen(
        [sys.executable, "-m", "linkctl", "lab", "boot", "--name", name],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + DEADLINE
        lines = []
        while time.monotonic() < deadline:
            line = proc.stderr.readline()
            lines.append(line)
            if "booted; Ctrl-C" in line or not line:
                break
        assert "booted; Ctrl-C" in lines[-1], "".join(lines)
        names = [f"{name}-dgx", f"{name}-mac"]
        assert all((rootfs.WORK / n).is_dir() for n in names)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(120) == 130
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert kit.leftovers(names, name) == []
    assert kit.snapshot_diff(host_before, kit.host_snapshot()) == []


@pytest.fixture
def nm_lab(host_before):
    """Both hosts booted from a rootfs with NetworkManager (the DGX OS case), no llama.cpp."""
    need_tool("mmdebstrap")
    need_tool("systemd-nspawn")
    img = rootfs.prepare(network_manager=True, log=say)
    profile, _ = load_profile("dgx-mac")
    bl = boot.BootLab(profile, "n" + uuid.uuid4().hex[:7], img, log=say)
    try:
        bl.__enter__()
        yield bl
    finally:
        names, lab_name = kit.container_names(bl), bl.name
        bl.down()
        img.discard()
        assert kit.leftovers(names, lab_name) == []


def nmcli(c: Container, *args: str) -> str:
    return c.exec(["nmcli", *args], check=False, timeout=60).stdout.strip()


def test_networkmanager_connection_survives_reboot(nm_lab, host_before):
    """setup on a host whose NetworkManager manages the port writes a persistent
    connection; after a reboot NM brings it up by itself (never-default, MTU, address,
    default route still WiFi's); teardown + reboot leaves no connection and no address."""
    bl = nm_lab
    c = bl.containers["dgx"]
    h = bl.lab.host("dgx")
    conn = f"linkctl-{bl.profile.name}-lab"
    assert nmcli(c, "-g", "GENERAL.STATE", "device", "show", h.interface), (
        "NM does not see the port"
    )
    r = bl.linkctl("dgx", "setup", "--profile", bl.profile_in_container)
    assert r.ok, r.stderr
    assert "NetworkManager" in r.stdout
    bl.reboot_all(["dgx"])
    kit.wait_for(
        lambda: conn in nmcli(c, "-g", "NAME", "connection", "show", "--active"),
        60,
        "NM activating the connection after reboot",
    )
    assert nmcli(c, "-g", "ipv4.never-default,802-3-ethernet.mtu", "connection", "show", conn) == (
        f"yes\n{bl.profile.link.mtu}"
    )
    kit.wait_for(lambda: port(c, h.interface)["inet"] == [h.address], 30, "address after reboot")
    assert port(c, h.interface)["mtu"] == bl.profile.link.mtu
    assert default_route(c) == [netns.WIFI_IF]
    r = bl.linkctl("dgx", "teardown", "--profile", bl.profile_in_container)
    assert r.ok, r.stderr
    bl.reboot_all(["dgx"])
    time.sleep(3)  # NM's autoconnect window after boot
    assert conn not in nmcli(c, "-g", "NAME", "connection", "show")
    assert h.address not in port(c, h.interface)["inet"]
    assert default_route(c) == [netns.WIFI_IF]
