"""The NetworkManager path of the Linux backend, against a real NetworkManager daemon.

NetworkManager runs inside the lab's dgx namespace (so it sees only that host's
interfaces), on a private D-Bus bus (DBUS_SYSTEM_BUS_ADDRESS, which nmcli and NM
both honour), with its config, keyfiles, state and /run/NetworkManager all private
to the test: this machine's own network and any NetworkManager it runs are never
touched. It manages enP7s7 only; wlan0 (the lab's WiFi with the default route) is
left unmanaged, as the profile's link would be beside a WiFi NM does manage.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from support.cli import need_tool
from support.lab import ns_snapshot
from support.llama_util import stop

pytestmark = pytest.mark.netns

CON = "linkctl-dgx-mac-lab"

BUS_CONF = """<!DOCTYPE busconfig PUBLIC "-//freedesktop//DTD D-Bus Bus Configuration 1.0//EN"
 "http://www.freedesktop.org/standards/dbus/1.0/busconfig.dtd">
<busconfig>
  <type>system</type>
  <listen>unix:path={socket}</listen>
  <auth>EXTERNAL</auth>
  <policy context="default">
    <allow user="*"/>
    <allow own="*"/>
    <allow send_destination="*"/>
    <allow receive_sender="*"/>
  </policy>
</busconfig>
"""

NM_CONF = """[main]
plugins=keyfile
dns=none
rc-manager=unmanaged
no-auto-default=*
auth-polkit=false
[keyfile]
path={keyfiles}
unmanaged-devices=except:interface-name:enP7s7
"""


class PrivateNM:
    """dbus-daemon + NetworkManager for one lab host; nmcli() talks to that NM only."""

    def __init__(self, lab, host: str, root: Path):
        for tool in ("NetworkManager", "dbus-daemon", "nmcli"):
            need_tool(tool)
        self.root = root
        self.keyfiles = root / "conns"
        self.keyfiles.mkdir(parents=True)
        (root / "empty").mkdir()
        socket = root / "bus"
        (root / "bus.conf").write_text(BUS_CONF.format(socket=socket))
        (root / "nm.conf").write_text(NM_CONF.format(keyfiles=self.keyfiles))
        self.address = f"unix:path={socket}"
        self.env = dict(os.environ, DBUS_SYSTEM_BUS_ADDRESS=self.address)
        self.procs: list[subprocess.Popen] = []
        try:
            self._start_daemons(lab.netns(host), socket)
        except BaseException:
            self.stop()
            raise

    def _start_daemons(self, netns: str, socket: Path) -> None:
        self._start(["dbus-daemon", f"--config-file={self.root / 'bus.conf'}", "--nofork"], "bus")
        self._wait(socket.exists, "the private D-Bus socket")
        # Inside `ip netns exec` (a private mount namespace): NM's run and lib dirs on
        # tmpfs, and /sys read-only so NM runs without udev, as it does in containers.
        d = self.root
        script = (
            "set -e; mkdir -p /run/NetworkManager /var/lib/NetworkManager; "
            "mount -t tmpfs tmpfs /run/NetworkManager; "
            "mount -t tmpfs tmpfs /var/lib/NetworkManager; "
            "mount -o remount,ro /sys; "
            f"exec NetworkManager --debug --config={d / 'nm.conf'} --config-dir={d / 'empty'} "
            f"--system-config-dir={d / 'empty'} --intern-config={d / 'intern.conf'} "
            f"--state-file={d / 'nm.state'} --pid-file={d / 'nm.pid'}"
        )
        self._start(["ip", "netns", "exec", netns, "sh", "-c", script], "nm")
        self._wait(lambda: "unmanaged" not in self.device_state("enP7s7"), "NM to manage enP7s7")

    def _start(self, argv: list[str], log: str) -> None:
        out = open(self.root / f"{log}.log", "w")  # noqa: SIM115 (kept open for the daemon)
        self.procs.append(
            subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=self.env)
        )

    def _wait(self, ready, what: str, timeout: float = 20) -> None:
        deadline = time.monotonic() + timeout
        while not ready():
            for p in self.procs:
                assert p.poll() is None, (
                    f"{p.args[0]} exited while waiting for {what}: "
                    + (self.root / "nm.log").read_text()[-2000:]
                )
            assert time.monotonic() < deadline, f"timed out waiting for {what}"
            time.sleep(0.1)

    def nmcli(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        r = subprocess.run(
            ["nmcli", *args], capture_output=True, text=True, env=self.env, timeout=30
        )
        if check:
            assert r.returncode == 0, r.stderr
        return r

    def device_state(self, ifname: str) -> str:
        r = self.nmcli("-t", "-g", "GENERAL.STATE", "device", "show", ifname, check=False)
        return r.stdout.strip() if r.returncode == 0 else "unmanaged (not yet)"

    def connections(self) -> list[str]:
        return self.nmcli("-t", "-g", "NAME", "connection", "show").stdout.split()

    def setting(self, con: str, key: str) -> str:
        return self.nmcli("-t", "-g", key, "connection", "show", con).stdout.strip()

    def stop(self) -> None:
        for p in reversed(self.procs):
            stop(p)


@pytest.fixture
def nm_lab(lab, tmp_path, monkeypatch):
    """The dgx-mac lab with the mac end set up (carrier for dgx) and a private NM
    managing dgx's enP7s7. linkctl run in the lab reaches that NM through the bus
    address in its environment."""
    r = lab.run("mac", "setup")
    assert r.returncode == 0, r.stderr
    nm = PrivateNM(lab, "dgx", tmp_path / "nm")
    monkeypatch.setenv("DBUS_SYSTEM_BUS_ADDRESS", nm.address)
    yield lab, nm
    nm.stop()


def link_state(lab) -> dict:
    """What the tests compare: the namespace as `ip` sees it, minus operstate (NM
    toggles carrier-independent flags only while it activates)."""
    snap = ns_snapshot(lab.netns("dgx"))
    for link in snap["links"]:
        link.pop("operstate")
    return snap


def json_run(lab, host: str, *args: str, code: int = 0) -> dict:
    r = lab.run(host, *args, "--json")
    assert r.returncode == code, r.stdout + r.stderr
    return json.loads(r.stdout)


def test_setup_persists_as_nm_connection_and_teardown_removes_it(nm_lab):
    lab, nm = nm_lab
    before, default = link_state(lab), ns_snapshot(lab.netns("dgx"))["routes"]
    assert CON not in nm.connections()
    facts = json_run(lab, "dgx", "status", code=1)["facts"]  # 1: drift, not set up yet
    assert facts["owner"] == "networkmanager"

    # --dry-run: the NM plan, and nothing changes.
    plan = json_run(lab, "dgx", "setup", "--dry-run")
    argvs = [c["args"]["argv"][:3] for c in plan["plan"]["changes"]]
    assert argvs == [["nmcli", "connection", "add"], ["nmcli", "connection", "up"]]
    assert link_state(lab) == before and CON not in nm.connections()

    res = json_run(lab, "dgx", "setup")
    assert [c["action"] for c in res["applied"]] == ["run", "run"]
    # The connection NM now holds, read back from NM itself.
    assert nm.setting(CON, "ipv4.method") == "manual"
    assert nm.setting(CON, "ipv4.addresses") == lab.host("dgx")["address"]
    assert nm.setting(CON, "ipv4.never-default") == "yes"
    assert nm.setting(CON, "ipv4.gateway") == ""
    assert nm.setting(CON, "802-3-ethernet.mtu") == "9000"
    assert (nm.keyfiles / f"{CON}.nmconnection").is_file()
    assert nm.device_state("enP7s7").startswith("100")  # activated
    # What the kernel has, read with `ip`: address, MTU, and the default route untouched.
    dgx_ip = lab.host("dgx")["address"].split("/")[0]
    now = ns_snapshot(lab.netns("dgx"))
    assert ("enP7s7", dgx_ip, 24) in now["addrs"]
    assert next(x for x in now["links"] if x["ifname"] == "enP7s7")["mtu"] == 9000
    assert [r for r in now["routes"] if r["dst"] == "default"] == [
        r for r in default if r["dst"] == "default"
    ]
    # Jumbo frames pass end to end (don't-fragment ping at MTU - 28, lab addresses only).
    ping = subprocess.run(
        ["ip", "netns", "exec", lab.netns("mac"), "ping", "-c1", "-W2", "-Mdo", "-s8972", dgx_ip],
        capture_output=True,
        text=True,
    )
    assert ping.returncode == 0, ping.stdout + ping.stderr

    # A second setup reads the connection back and changes nothing.
    again = json_run(lab, "dgx", "setup")
    assert again["nothing_to_do"], again
    st = json_run(lab, "dgx", "status")
    assert st["facts"]["owner_detail"] == CON and st["drift"] == []

    res = json_run(lab, "dgx", "teardown")
    assert not res["nothing_to_do"]
    assert CON not in nm.connections()
    assert not (nm.keyfiles / f"{CON}.nmconnection").exists()
    assert link_state(lab) == before


def test_teardown_reactivates_the_connection_that_was_there_before(nm_lab):
    lab, nm = nm_lab
    # A connection the user had on the port (a lab address, 198.18.101.0/24).
    nm.nmcli(
        "connection", "add", "type", "ethernet", "ifname", "enP7s7", "con-name", "office",
        "ipv4.method", "manual", "ipv4.addresses", "198.18.101.2/24", "ipv6.method", "disabled",
    )  # fmt: skip
    nm.nmcli("connection", "up", "office")
    before = link_state(lab)

    res = json_run(lab, "dgx", "setup")
    undo = [c["undo"]["args"]["argv"] for c in res["applied"] if c["undo"]]
    assert ["nmcli", "connection", "up", "office", "ifname", "enP7s7"] in undo
    assert (
        nm.nmcli("-t", "-g", "GENERAL.CONNECTION", "device", "show", "enP7s7").stdout.strip() == CON
    )

    json_run(lab, "dgx", "teardown")
    assert nm.nmcli(
        "-t", "-g", "GENERAL.CONNECTION", "device", "show", "enP7s7"
    ).stdout.strip() == ("office")
    assert nm.connections() == ["office"]
    assert link_state(lab) == before


def test_failure_before_activation_rolls_the_new_connection_back(nm_lab):
    lab, nm = nm_lab
    before = link_state(lab)
    # Fail at the second change (activation), after NM accepted the new connection.
    r = lab.exec(
        "dgx", "env", "LINKCTL_INJECT_FAULT=run#2", sys.executable, "-m", "linkctl", "setup"
    )
    assert r.returncode == 1 and "rolled back" in r.stderr, r.stdout + r.stderr
    assert CON not in nm.connections()
    assert link_state(lab) == before
