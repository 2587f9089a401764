"""linkctl.net.echo on real namespaces: echoes through a datagram ICMP socket as an
unprivileged user (what the hardened serve unit can open), and a one-line reason naming
the sysctl where the system does not permit that socket."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from linkctl.core.checks import Verdict
from linkctl.core.profile import load_profile
from linkctl.lab.netns import LAB_SYSCTLS
from linkctl.net.echo import unit_echo_check
from linkctl.service.manager import serve_unit_gids

RANGE = "/proc/sys/net/ipv4/ping_group_range"
ECHO = """
import json, sys
from linkctl.core.errors import InputError
from linkctl.net.echo import echo
try:
    p = echo(sys.argv[1], count=3, interval_s=0.1, timeout_s=1.0)
    print(json.dumps({"sent": p.sent, "received": p.received, "avg_us": p.avg_us}))
except InputError as e:
    print(json.dumps({"error": e.message}))
"""


def echo_as_nobody(lab, host: str, address: str) -> dict:
    """The echo from a process of user and group nobody inside ``host``'s namespace."""
    argv = ["ip", "netns", "exec", lab.netns(host), "setpriv", "--reuid=65534",
            "--regid=65534", "--clear-groups", sys.executable, "-c", ECHO, address]  # fmt: skip
    r = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def ns_read(lab, host: str, path: str) -> str:
    argv = ["ip", "netns", "exec", lab.netns(host), "cat", path]
    return " ".join(subprocess.run(argv, capture_output=True, text=True, check=True).stdout.split())


def test_lab_namespaces_allow_icmp_sockets_and_this_machine_keeps_its_own(make_lab):
    mine = Path(RANGE).read_text()
    lab = make_lab("dgx-mac")
    for host in ("dgx", "mac"):
        assert ns_read(lab, host, RANGE) == LAB_SYSCTLS["net/ipv4/ping_group_range"]
    assert Path(RANGE).read_text() == mine


def test_echo_as_an_unprivileged_user_over_the_link(lab):
    for host in ("dgx", "mac"):
        assert lab.run(host, "setup").returncode == 0
    peer = lab.host("dgx")["address"].split("/")[0]
    got = echo_as_nobody(lab, "mac", peer)
    assert got["sent"] == 3 and got["received"] == 3, got
    assert 0 < got["avg_us"] < 1_000_000, got
    # An address on the lab's subnet that nobody holds: every echo lost, none raised.
    ghost = peer.rsplit(".", 1)[0] + ".250"
    got = echo_as_nobody(lab, "mac", ghost)
    assert got == {"sent": 3, "received": 0, "avg_us": None}, got


def test_echo_not_permitted_names_the_sysctl_and_its_value(lab):
    # The lab's own namespace as a new one is (no group may open the socket).
    subprocess.run(
        ["ip", "netns", "exec", lab.netns("mac"), "sh", "-c", f"echo '1 0' > {RANGE}"], check=True
    )
    got = echo_as_nobody(lab, "mac", lab.host("dgx")["address"].split("/")[0])
    assert "error" in got, got
    assert "not permitted for group 65534" in got["error"], got
    assert "ping_group_range is '1 0'" in got["error"], got
    assert "sysctl -w net.ipv4.ping_group_range='0 2147483647'" in got["error"], got


def test_the_unit_check_judges_the_groups_the_serve_unit_runs_with():
    linux = load_profile("dgx-mac")[0].host("dgx")
    dynamic, root = serve_unit_gids(linux, None), serve_unit_gids(linux, "root")
    assert (dynamic, root) == ((61184, 65519), (0, 0))  # systemd's DynamicUser= range
    assert serve_unit_gids(linux, "nobody") == (65534, 65534)
    assert serve_unit_gids(linux, "no-such-user-here") is None

    def verdict(lo_hi, gids) -> str:
        return unit_echo_check(lambda: lo_hi, gids).verdict

    assert verdict((0, 2147483647), dynamic) == verdict((0, 2147483647), root) == Verdict.PASS
    assert verdict((1, 0), dynamic) == verdict((1, 0), root) == Verdict.WARN  # Debian 12
    # A range for users' groups: the DynamicUser range outside it, root too.
    assert verdict((100, 60000), dynamic) == verdict((100, 60000), root) == Verdict.WARN
    assert verdict((0, 0), root) == Verdict.PASS and verdict((0, 0), dynamic) == Verdict.WARN
    assert "group(s) 61184-65519" in unit_echo_check(lambda: (1, 0), dynamic).detail
    assert verdict((1, 0), None) == Verdict.SKIP
    assert verdict(None, dynamic) == Verdict.PASS  # macOS: any user may
