"""`linkctl up` and `linkctl down` on both hosts of dgx-mac, each a booted container with
systemd as PID 1 (the boot harness; the Mac's role played by a Linux container), as
the owner walks it: up on each host (at once, each waiting for the other), the line
it ends with and the request it suggests, a second up that changes nothing, a serve
restarted a day after its probe, and down, after which each host is as it was.
The Mac's own commands (networksetup, launchctl) are in tests/lifecycle/.

The tests share one lab (module fixture ``pair``); ``upped`` / ``downed`` bring it to
the state a test starts from, so each test also passes alone.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import pytest

from linkctl.core.profile import load_profile
from linkctl.core.runner import Result
from linkctl.lab import boot
from linkctl.lab.container import Container
from linkctl.lab.rootfs import VENV
from support import boot_kit as kit

pytestmark = [pytest.mark.netns, pytest.mark.llama]

DEADLINE = 240.0  # generous: other jobs share the 2 cores
# Calibration on both hosts at once, the gate, the model load: about a minute here.
# Under pytest's 900 s, so that a stuck up is stopped (SIGTERM: it undoes itself) and
# its stage lines reach the failure message.
UP_TIMEOUT = 600.0


def say(msg: str) -> None:
    print(msg, flush=True)


@dataclass
class Pair:
    bl: boot.BootLab
    before: dict[str, dict]  # host_state() per host before any up
    ups: dict[str, Result] = field(default_factory=dict)  # the last up on each host
    is_up: bool = False

    def linkctl(self, host: str, *args: str, timeout: float = 180) -> Result:
        """`linkctl ARGS --profile P` on ``host``, sent SIGTERM (as systemd or a ^C would)
        30 s before ``timeout``, so that what it said before reaches the Result."""
        argv = [f"{VENV}/bin/linkctl", *args, "--profile", self.bl.profile_in_container]
        return self.c(host).exec(
            ["timeout", "--kill-after=20", f"{timeout - 30:g}", *argv],
            check=False,
            timeout=timeout,
        )

    def on_both(self, *args: str, timeout: float = UP_TIMEOUT) -> dict[str, Result]:
        """`linkctl ARGS` on both hosts at once (up waits for the peer's gate)."""
        with ThreadPoolExecutor(len(self.bl.containers)) as ex:
            futs = {
                n: ex.submit(self.linkctl, n, *args, timeout=timeout) for n in self.bl.containers
            }
            return {n: f.result() for n, f in futs.items()}

    def up(self) -> None:
        t0 = time.monotonic()
        self.ups = self.on_both("up")
        for n, r in self.ups.items():
            assert r.returncode == 0, (n, r.stdout, r.stderr[-4000:])
            for line in r.stderr.splitlines():  # the stage lines, timed, for the record
                if "linkctl[up]" in line:
                    say(f"{n}: {line}")
        say(f"up on both hosts: {time.monotonic() - t0:.0f} s")
        self.is_up = True

    def down(self) -> dict[str, Result]:
        out = self.on_both("down", timeout=300)
        for n, r in out.items():
            assert r.returncode == 0, (n, r.stdout, r.stderr[-4000:])
        self.is_up = False
        return out

    def c(self, host: str) -> Container:
        return self.bl.containers[host]

    @property
    def head(self) -> str:
        return self.bl.profile.head.name

    @property
    def rpc(self) -> str:
        return self.bl.profile.rpc_hosts[0].name


@pytest.fixture(scope="module")
def pair(image, model, host_before) -> Iterator[Pair]:
    profile, _ = load_profile("dgx-mac")
    llama = boot.llama_dir()
    assert llama is not None, "llama.cpp build not found"
    bl = boot.BootLab(profile, "u" + uuid.uuid4().hex[:7], image, llama, model, log=say)
    bl.__enter__()
    try:
        for c in bl.containers.values():
            kit.settled(c)
        before = {n: kit.host_state(c) for n, c in bl.containers.items()}
        yield Pair(bl, before)
    finally:
        names, lab_name = kit.container_names(bl), bl.name
        bl.down()
        assert kit.leftovers(names, lab_name) == []
        assert kit.snapshot_diff(host_before, kit.host_snapshot()) == []


@pytest.fixture
def upped(pair: Pair) -> Pair:
    if not pair.is_up:
        pair.up()
    return pair


@pytest.fixture
def downed(pair: Pair) -> Pair:
    if pair.is_up:
        pair.down()
    return pair


def flat(x: object, at: str = "") -> dict[str, object]:
    """Nested JSON as {path: leaf}; lists of links/addresses keyed by their ifname."""
    if isinstance(x, dict):
        return {k: v for key, val in x.items() for k, v in flat(val, f"{at}/{key}").items()}
    if isinstance(x, list):
        out: dict[str, object] = {}
        for i, val in enumerate(x):
            key = val.get("ifname") or val.get("local") or i if isinstance(val, dict) else i
            out.update(flat(val, f"{at}[{key}]"))
        return out
    return {at: x}


def state_diff(before: dict, after: dict) -> list[str]:
    a, b = flat(before), flat(after)
    return [
        f"{k}: {a.get(k)!r} -> {b.get(k)!r}"
        for k in sorted(a.keys() | b.keys())
        if a.get(k) != b.get(k)
    ]


def assert_same(before: dict, after: dict, host: str) -> None:
    d = state_diff(before, after)
    assert not d, f"{host}: " + "\n".join(d)


def last_line(r: Result) -> str:
    return r.stdout.strip().splitlines()[-1]


def answers(p: Pair) -> dict | None:
    return kit.answers(p.bl)


def wait_answers(p: Pair, what: str, timeout: float = DEADLINE) -> float:
    return kit.wait_for(lambda: answers(p), timeout, f"{what}: a completion", step=0.5)


# ---- refusals: before anything changes -------------------------------------------------


def test_up_refuses_before_changing_anything(downed: Pair):
    p = downed
    head = p.c(p.head)
    # Not root: one line naming the command to type.
    r = head.exec(
        ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
         "/opt/linkctl/bin/linkctl", "up", "--profile", p.bl.profile_in_container],
        check=False,
    )  # fmt: skip
    assert r.returncode == 2, r.stderr
    assert "needs root: sudo linkctl up --profile" in r.stderr
    # The profile's other host is not this machine (its interface is not here).
    r = p.linkctl(p.head, "up", "--host", p.rpc)
    assert r.returncode == 2, r.stderr
    assert "is not on this machine" in r.stderr and "--host" in r.stderr
    # No pair secret on this host: the responder and the kv-agent could answer no one.
    key = p.c(p.head).root / "var/lib/linkctl/keys" / f"{p.bl.profile.name}-lab.key"
    key.rename(key.with_suffix(".aside"))
    try:
        r = p.linkctl(p.head, "up")
    finally:
        key.with_suffix(".aside").rename(key)
    assert r.returncode == 2, r.stderr
    assert "no pair secret for profile" in r.stderr and "linkctl pair" in r.stderr
    for n in p.bl.containers:
        assert_same(p.before[n], kit.host_state(p.c(n)), n)


def test_up_alone_refuses_after_its_wait_and_undoes_everything(downed: Pair):
    """up on the head only: the gate cannot pass (the peer's port is down, as a powered
    off DGX's is); after --wait it refuses with the reason, exit 1, and the head is as
    it was."""
    p = downed
    r = p.linkctl(p.head, "up", "--wait", "20", timeout=UP_TIMEOUT)
    assert r.returncode == 1, (r.stdout, r.stderr[-3000:])
    line = r.stderr.strip().splitlines()[-1]
    assert f"peer {p.rpc} not reachable through the link after 20 s" in line, line
    iface = p.bl.profile.head.interface
    assert f"no carrier on {iface}: the peer's port is down" in line and "fix:" in line, line
    assert "undoing what up did" in r.stderr
    assert_same(p.before[p.head], kit.host_state(p.c(p.head)), p.head)


# ---- up ------------------------------------------------------------------------------


def test_up_on_both_serves_and_says_how_to_reach_it(upped: Pair):
    p = upped
    for n, r in p.ups.items():
        for stage in ("link", "calibration", "services", "peer", "serve"):
            assert f"linkctl[up] {stage}: " in r.stderr, (n, stage, r.stderr[-3000:])
        assert "from /root/dgx-mac-lab.toml" in r.stderr
    rpc_line = last_line(p.ups[p.rpc])
    assert "serving: ggml-rpc-server for mac" in rpc_line, rpc_line
    head_line = last_line(p.ups[p.head])
    port = p.bl.profile.serve.port
    assert "serving: llama-server (split over" in head_line, head_line
    assert f"at http://127.0.0.1:{port}, no API key needed; try: curl " in head_line
    # The request the line suggests, as the owner would paste it.
    curl = head_line.split("try: ", 1)[1]
    r = p.c(p.head).exec(["sh", "-c", curl], check=False, timeout=60)
    assert r.returncode == 0, r.stderr
    reply = json.loads(r.stdout)
    assert reply["choices"][0]["message"]["content"] is not None, reply
    assert reply["usage"]["completion_tokens"] > 0, reply
    assert answers(p)
    # Each host's calibration reached the other through the responder and its probe.
    for n in p.bl.containers:
        cal = json.loads(p.c(n).exec(["cat", "/var/lib/linkctl/calibration.json"]).stdout)
        assert set(cal["hosts"]) == {p.head, p.rpc}, (n, cal)
        assert all(h["build"].startswith("version:") for h in cal["hosts"].values()), cal


def test_up_again_changes_nothing_and_says_so(upped: Pair):
    p = upped
    before = {n: kit.host_state(c) for n, c in p.bl.containers.items()}
    again = p.on_both("up", timeout=300)
    for n, r in again.items():
        assert r.returncode == 0, (n, r.stderr[-3000:])
        assert last_line(r).startswith("nothing changed; serving:"), last_line(r)
    for n, c in p.bl.containers.items():
        assert_same(before[n]["files"], kit.host_state(c)["files"], n)
    assert answers(p)


def test_status_shows_the_units_watch_reading_the_link(upped: Pair):
    """What `linkctl status --json` says of the served pair under the hardened units:
    the watch's verdict with its idle echo to the peer (no ping it could not run)."""
    p = upped

    def watch(host: str) -> dict | None:
        r = p.linkctl(host, "status", "--json", timeout=60)
        served = json.loads(r.stdout).get("serve") if r.stdout.strip() else None
        w = (served or {}).get("watch")
        return w if w and w["ticks"] >= 2 else None

    for host in (p.head, p.rpc):
        kit.wait_for(lambda h=host: watch(h), 60, f"{host}: two watch readings in status")
        w = watch(host)
        assert w is not None
        assert w["verdict"] == "PASS", (host, w["reasons"])
        assert w["figures"]["ping_ms"] is not None, (host, w["figures"])


def _age_reports(c: Container, hours: float) -> None:
    """Every probe report on ``c`` as if written ``hours`` ago."""
    script = (
        "import glob, json, datetime as d\n"
        f"t = (d.datetime.now(d.UTC) - d.timedelta(hours={hours})).isoformat(timespec='seconds')\n"
        "for f in glob.glob('/var/lib/linkctl/probe/*.json'):\n"
        "    r = json.load(open(f)); r['time'] = t; json.dump(r, open(f, 'w'))\n"
    )
    c.exec(["python3", "-c", script])


def _restart_serve(c: Container) -> int:
    """kill -9 the serve unit's main process; systemd starts it again (Restart=)."""
    st = kit.unit_props(c, "linkctl-serve.service", "MainPID", "NRestarts")
    c.exec(["python3", "-c", f"import os; os.kill({st['MainPID']}, 9)"])
    return int(st["NRestarts"])


def test_serve_restarted_a_day_after_its_probe_probes_again(upped: Pair):
    p = upped
    head = p.c(p.head)
    # The report aged 25 h (past serve's 24 h): a restart probes again and serves.
    _age_reports(head, 25)
    t0 = time.time()
    n = _restart_serve(head)
    kit.wait_for(lambda: not answers(p), 30, "llama-server gone with its supervisor")
    wait_answers(p, "after a restart with an aged probe report")
    assert int(kit.unit_props(head, "linkctl-serve.service", "NRestarts")["NRestarts"]) > n
    rep = json.loads(head.exec(["cat", "/var/lib/linkctl/probe/latest.json"]).stdout)
    assert rep["ok"] and time.mktime(time.strptime(rep["time"][:19], "%Y-%m-%dT%H:%M:%S")) > (
        t0 - 3600 * 13  # a fresh report (the aged ones say 25 h ago), whatever the timezone
    ), rep["time"]
    # A failing fresh probe still refuses, with its reason: the link's minimum raised
    # past what the lab carries, in the profile the units read.
    # The units read the copy up installed, named after the lab profile's own name.
    name = re.search(
        r'^name = "([^"]+)"', head.exec(["cat", p.bl.profile_in_container]).stdout, re.M
    )
    assert name, p.bl.profile_in_container
    prof = f"/etc/linkctl/profiles/{name[1]}.toml"
    original = head.exec(["cat", prof]).stdout
    strict = re.sub(r"min_throughput_gbps = [0-9.]+", "min_throughput_gbps = 100000.0", original)
    assert strict != original
    head.exec(["sh", "-c", f"cat > {prof}"], input=strict)
    try:
        _age_reports(head, 25)
        _restart_serve(head)
        journal = ["journalctl", "-u", "linkctl-serve.service", "--since", "-5min", "--no-pager"]
        try:
            kit.wait_for(
                lambda: "below the minimum" in head.exec(journal).stdout,
                DEADLINE,
                "the serve unit's re-probe failing with the probe's reason",
                step=2,
            )
        except AssertionError as e:
            raise AssertionError(f"{e}\n{head.exec(journal).stdout[-4000:]}") from None
        assert not answers(p)
        assert kit.unit_props(head, "linkctl-serve.service", "ActiveState")["ActiveState"] != (
            "active"
        )
    finally:
        head.exec(["sh", "-c", f"cat > {prof}"], input=original)
    # The cause gone, the unit's own retries bring it back (no start limit).
    wait_answers(p, "after the link passes again")


# ---- down ----------------------------------------------------------------------------


def test_down_leaves_each_host_as_it_was_and_twice_is_harmless(upped: Pair):
    p = upped
    first = p.down()
    for n, r in first.items():
        assert "as it was before `linkctl up`" in last_line(r), (n, r.stdout)
    for n, c in p.bl.containers.items():
        assert_same(p.before[n], kit.host_state(c), n)
    again = p.on_both("down", timeout=300)
    for n, r in again.items():
        assert r.returncode == 0, (n, r.stderr[-2000:])
        assert last_line(r).startswith("nothing to do"), (n, r.stdout)
    for n, c in p.bl.containers.items():
        assert_same(p.before[n], kit.host_state(c), n)
    assert not answers(p)
