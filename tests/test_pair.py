"""`linkctl pair`: the pure parts (the code, the agreement, hostile announcements), then
the real thing in lab namespaces: two hosts joined by a veth with no IPv4 address pair
into one profile that setup and probe pass on; three on a bridge are refused; each bad
input (a hostile fake peer on the link) refused with exit 2 and nothing written; the
default-route (WiFi) interface untouched throughout."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import pytest

from linkctl import __version__
from linkctl.core.errors import InputError
from linkctl.core.profile import load_profile
from linkctl.lab.netns import WIFI_IF
from linkctl.pair import agree
from linkctl.pair.announce import Announcement, Wants, parse
from linkctl.pair.run import catalog_key
from linkctl.pair.wire import decode
from support.cli import linkctl_as_nobody
from support.lab import LabHandle, ns_snapshot
from support.paths import REPO

LAB_SUBNET = "198.18.100.0/30"  # lab traffic stays in 198.18.0.0/15


def ann(**kw) -> Announcement:
    base = dict(
        protocol=1,
        linkctl=__version__,
        nonce="0" * 32,
        key_share="0" * 63 + "9",
        host="spark",
        os="linux",
        interface="enP7s7",
        mac="aa:bb:cc:00:00:01",
        accelerator="NVIDIA GB10",
        device="gb10",
        memory_gb=119.7,
        usable_gb=107.7,
        llama_build="version: 7000 (abc)",
        rpc_protocol=[3, 0, 0],
        max_mtu=9216,
        speed_mbps=10000,
        networks=["10.0.0.0/24"],
    )
    base.update(kw)
    return Announcement.model_validate(base)


SPARK = ann()
STUDIO = ann(
    nonce="1" * 32,
    host="studio",
    os="macos",
    interface="en0",
    mac="aa:bb:cc:00:00:02",
    accelerator="Apple M2 Ultra",
    device="m2-ultra",
    memory_gb=128.0,
    usable_gb=120.0,
    max_mtu=9000,
    networks=["192.168.1.0/24"],
)


# ---- pure parts ----------------------------------------------------------------------


def test_the_code_is_the_same_on_both_hosts_and_another_for_a_third():
    assert agree.code(SPARK, STUDIO) == agree.code(STUDIO, SPARK)
    third = ann(nonce="2" * 32, host="intruder", mac="aa:bb:cc:00:00:03")
    assert agree.code(SPARK, third) != agree.code(SPARK, STUDIO)
    assert len(agree.code(SPARK, STUDIO)) == 7  # "123-456"


def test_both_hosts_compute_the_same_profile():
    a, why = agree.profile(SPARK, STUDIO)
    b, _ = agree.profile(STUDIO, SPARK)
    assert agree.render(a) == agree.render(b)
    assert a.head.name == "studio" and a.rpc_hosts[0].name == "spark", why
    assert "more usable memory" in why
    assert str(a.link.subnet) == "192.168.100.0/24" and a.link.mtu == 9000
    assert a.head.ip == "192.168.100.1" and a.rpc_hosts[0].mac == "aa:bb:cc:00:00:01"
    assert a.host("spark").device == "gb10" and a.name == "studio-spark"
    assert agree.render(a).startswith("# written by `linkctl pair`")


def test_head_named_and_subnet_chosen_around_what_either_host_uses():
    used = ann(networks=["192.168.100.0/22"])
    p, why = agree.profile(used, ann(nonce="1" * 32, host="studio", wants=Wants(head="spark")))
    # 192.168.100.0/24 is inside the /22 in use: the first free /30 past it.
    assert str(p.link.subnet) == "192.168.104.0/30"
    assert p.head.name == "spark" and why == "--head"


@pytest.mark.parametrize(
    "b_kw, skew, words",
    [
        ({"host": "spark"}, 0, "both hosts are named 'spark'"),
        ({"linkctl": "0.0.9"}, 0, "runs linkctl 0.0.9"),
        ({"rpc_protocol": [2, 0, 0]}, 0, "speaks RPC protocol 2.0.0"),
        ({}, -3600, "clock is -3600 s"),
        ({"wants": Wants(dry_run=True)}, 0, "--dry-run is given on studio only"),
        ({"wants": Wants(setup=False)}, 0, "--no-setup is given on studio only"),
    ],
)
def test_a_peer_it_cannot_pair_with_is_refused(b_kw, skew, words):
    b = ann(**{"nonce": "1" * 32, "host": "studio", **b_kw})
    agree.check_peer(SPARK, STUDIO, 100)  # within the skew allowed
    with pytest.raises(InputError) as e:
        agree.check_peer(SPARK, b, skew)
    assert words in e.value.message and e.value.fix and e.value.exit_code == 2


@pytest.mark.parametrize(
    "a_wants, b_wants, words",
    [
        (Wants(subnet="198.18.100.0/30"), Wants(subnet="198.18.200.0/30"), "different --subnet"),
        (Wants(name="x"), Wants(name="y"), "different --name"),
        (
            Wants(subnet="10.0.0.0/30"),
            Wants(),
            "--subnet 10.0.0.0/30 overlaps 10.0.0.0/24 on spark",
        ),
        (Wants(head="nobody"), Wants(), "--head 'nobody' is neither host"),
        (Wants(subnet="198.18.100.1/30"), Wants(), "--subnet '198.18.100.1/30'"),
    ],
)
def test_options_the_hosts_disagree_on_or_that_clash_are_refused(a_wants, b_wants, words):
    with pytest.raises(InputError) as e:
        agree.profile(ann(wants=a_wants), ann(nonce="1" * 32, host="studio", wants=b_wants))
    assert words in e.value.message, e.value.message


@pytest.mark.parametrize(
    "data, words",
    [
        (b"not json", "not JSON"),
        (b"x" * 5000, "oversized announcement"),
        (
            json.dumps({"linkctl_pair": "hello", "sent": 1.7e9, "ann": {"protocol": 1}}).encode(),
            "linkctl:",
        ),
        (json.dumps({"linkctl_pair": "pwn", "ann": {}}).encode(), "linkctl_pair"),
        (b"[" * 2000 + b"]" * 2000, "not JSON"),  # nested past the recursion limit
        (json.dumps({"linkctl_pair": "hello", "sent": "now", "ann": {}}).encode(), "sent"),
    ],
)
def test_hostile_datagrams_are_refused_by_what_is_wrong(data, words):
    with pytest.raises(InputError) as e:
        decode(data, "fe80::1%en0")
    assert words in e.value.message and "fe80::1%en0" in e.value.message


def test_an_announcement_is_bounded_and_strict():
    good = SPARK.model_dump(mode="json")
    for bad in (
        {"extra": 1},
        {"host": "x" * 40},
        {"host": "Spark\n"},
        {"interface": "en0\nevil"},
        {"networks": ["10.0.0.0/8"] * 100},
        {"networks": ["not a network"]},
        {"memory_gb": -1},
        {"accelerator": "A" * 200},
        {"accelerator": "GB10\x1b[2J"},  # a terminal escape
    ):
        with pytest.raises(InputError):
            parse({**good, **bad}, "fe80::1%en0")
    assert parse(good, "fe80::1%en0") == SPARK


def test_a_peers_text_is_printed_as_text(capsys):
    """A peer's "[/]" in an error is not rich markup (no MarkupError, no traceback)."""
    from linkctl.core.output import error_line

    b = ann(nonce="1" * 32, host="studio", linkctl="[/][red]x")
    with pytest.raises(InputError) as e:
        agree.check_peer(SPARK, b, 0)
    error_line(e.value.message)
    assert "runs linkctl [/][red]x" in capsys.readouterr().err


def test_accelerator_names_map_to_the_catalog():
    assert catalog_key("NVIDIA GB10") == "gb10"
    assert catalog_key("Apple M2 Ultra") == "m2-ultra"
    assert catalog_key("NVIDIA GeForce RTX 4090") == "rtx4090"
    assert catalog_key("Intel(R) Xeon(R)") is None and catalog_key("") is None


# ---- in the lab ----------------------------------------------------------------------


def plug(lab: LabHandle) -> None:
    """The cable plugged in: both ports up (as NetworkManager or macOS bring a wired
    port with a carrier up), no IPv4 address, MTU 1500."""
    for h in lab.info["hosts"]:
        subprocess.run(
            ["ip", "-n", lab.netns(h["name"]), "link", "set", h["interface"], "up"], check=True
        )
    time.sleep(2.5)  # IPv6 DAD of the link-local addresses


def wifi_state(lab: LabHandle) -> dict:
    """The default route's (WiFi) interface of every host: link, addresses, routes."""
    out = {}
    for h in lab.info["hosts"]:
        s = ns_snapshot(lab.netns(h["name"]))
        out[h["name"]] = {
            "link": [x for x in s["links"] if x["ifname"] == WIFI_IF],
            "addrs": [a for a in s["addrs"] if a[0] == WIFI_IF],
            "routes": [r for r in s["routes"] if r.get("dev") == WIFI_IF],
        }
    return out


def pair_args(lab: LabHandle, host: str, tmp: Path, *extra: str) -> list[str]:
    return ["pair", "--host", host, "--write", str(tmp / f"{host}.toml"), *extra]


def on_all(lab: LabHandle, tmp: Path, *extra: str, timeout: float = 180) -> dict:
    """`linkctl pair` on every host of the lab at once."""
    hosts = [h["name"] for h in lab.info["hosts"]]
    with ThreadPoolExecutor(len(hosts)) as ex:
        futs = {
            h: ex.submit(lab.run, h, *pair_args(lab, h, tmp, *extra), timeout=timeout)
            for h in hosts
        }
        return {h: f.result() for h, f in futs.items()}


def test_two_hosts_pair_set_up_and_probe(make_lab, tmp_path):
    lab = make_lab("dgx-mac")
    plug(lab)
    before = wifi_state(lab)
    out = on_all(lab, tmp_path, "--yes", "--subnet", LAB_SUBNET, "--name", "paired")
    for h, r in out.items():
        assert r.returncode == 0, (h, r.stderr[-3000:])
    texts = {h: (tmp_path / f"{h}.toml").read_text() for h in out}
    assert texts["dgx"] == texts["mac"]
    prof, _ = load_profile(str(tmp_path / "dgx.toml"))
    assert str(prof.link.subnet) == LAB_SUBNET and prof.name == "paired"
    assert {h.name: h.interface for h in prof.hosts} == {"dgx": "enP7s7", "mac": "en0"}
    codes = {
        h: [ln for ln in r.stderr.splitlines() if "pairing code:" in ln] for h, r in out.items()
    }
    assert codes["dgx"][0].split("code: ")[1] == codes["mac"][0].split("code: ")[1]
    # One pair secret, agreed over the cable (X25519), 0600 on both; never printed.
    keys = {h: Path(lab.info["root"]) / "hosts" / h / "keys" / "paired.key" for h in out}
    assert keys["dgx"].read_bytes() == keys["mac"].read_bytes()
    assert {k.stat().st_mode & 0o777 for k in keys.values()} == {0o600}
    for r in out.values():
        assert keys["dgx"].read_text().strip() not in r.stdout + r.stderr
    fps = {
        h: [ln for ln in r.stderr.splitlines() if "pair secret: wrote" in ln]
        for h, r in out.items()
    }
    first = {h: ln[0].split("fingerprint ")[1].split(",")[0] for h, ln in fps.items()}
    assert first["dgx"] == first["mac"]
    for h, r in out.items():
        assert "probe -> " in r.stderr and ": PASS (" in r.stderr, r.stderr[-2000:]
        assert f"sudo linkctl up --profile paired --host {h}" in r.stdout
    # The link carries the paired addresses; WiFi (the default route) as it was.
    for h in prof.hosts:
        addrs = ns_snapshot(lab.netns(h.name))["addrs"]
        assert (h.interface, h.ip, 30) in addrs, addrs
    assert wifi_state(lab) == before
    # --json: the same facts as data.
    out = on_all(lab, tmp_path, "--yes", "--subnet", LAB_SUBNET, "--name", "paired",
                 "--no-setup", "--dry-run", "--json")  # fmt: skip
    for h, r in out.items():
        assert r.returncode == 0, (h, r.stderr[-2000:])
        d = json.loads(r.stdout)
        assert d["dry_run"] and d["profile_path"] is None and d["profile_name"] == "paired"
        assert d["interface"] == prof.host(h).interface and d["peer"]["host"] != h
    # A new pairing agrees a new secret (fresh key shares), the same on both.
    fresh = {json.loads(r.stdout)["key_fingerprint"] for r in out.values()}
    assert len(fresh) == 1 and fresh != {first["dgx"]}


def test_a_third_host_on_a_bridge_stops_the_pairing_and_nothing_is_written(make_lab, tmp_path):
    """Three hosts on one switch segment: the third already announcing when the two
    start. No host pairs (each hears two), whatever --yes says; nothing is written."""
    lab = make_lab("dgx2-mac-switch")
    plug(lab)
    hosts = [h["name"] for h in lab.info["hosts"]]
    before = {h: ns_snapshot(lab.netns(h)) for h in hosts}
    args = ["--yes", "--subnet", LAB_SUBNET, "--window", "30"]
    with ThreadPoolExecutor(3) as ex:
        third = ex.submit(lab.run, hosts[-1], *pair_args(lab, hosts[-1], tmp_path, *args))
        time.sleep(3)
        two = {h: ex.submit(lab.run, h, *pair_args(lab, h, tmp_path, *args)) for h in hosts[:-1]}
        out = {hosts[-1]: third.result(), **{h: f.result() for h, f in two.items()}}
    for h, r in out.items():
        assert r.returncode == 2, (h, r.stderr[-2000:])
        assert "hosts are pairing on" in r.stderr, (h, r.stderr[-2000:])
    assert list(tmp_path.iterdir()) == []
    for h in hosts:
        assert ns_snapshot(lab.netns(h)) == before[h]


FAKE = "support.fake_pair_peer"


@contextmanager
def fake_peer(lab: LabHandle, where: str, mode: str, extra: dict) -> Iterator[None]:
    """A hostile or odd peer on ``where``'s end of the cable, announcing for 20 s."""
    h = lab.host(where)
    proc = subprocess.Popen(
        ["ip", "netns", "exec", lab.netns(where), sys.executable, "-m", FAKE,
         h["interface"], mode, json.dumps(extra), "20"],
        env={"PYTHONPATH": f"{REPO / 'tests'}:{REPO}", "PATH": "/usr/sbin:/usr/bin:/sbin:/bin"},
        stderr=subprocess.PIPE,
    )  # fmt: skip
    try:
        yield
    finally:
        proc.kill()
        proc.wait()


BAD_PEERS = [
    ("garbage", {}, "malformed announcement from fe80::"),
    ("oversized", {}, "oversized announcement from fe80::"),
    ("hello", {"clock_s": -7200}, "clock is -7"),
    ("hello", {"linkctl": "0.0.1"}, "runs linkctl 0.0.1"),
    ("hello", {"networks": ["198.18.100.0/24"]}, "overlaps 198.18.100.0/24 on fake"),
    ("hello", {"host": "Fake Host"}, "malformed announcement from fe80::"),
]


@pytest.mark.parametrize("mode, extra, words", BAD_PEERS, ids=[b[2][:24] for b in BAD_PEERS])
def test_a_bad_peer_is_refused_in_one_line_and_nothing_changes(
    make_lab, tmp_path, mode, extra, words
):
    lab = make_lab("dgx-mac")
    plug(lab)
    before = ns_snapshot(lab.netns("dgx"))
    with fake_peer(lab, "mac", mode, extra):
        r = lab.run("dgx", *pair_args(lab, "dgx", tmp_path, "--yes", "--subnet", LAB_SUBNET,
                                       "--window", "15"))  # fmt: skip
    assert r.returncode == 2, r.stderr[-2000:]
    err = [ln for ln in r.stderr.splitlines() if ln.startswith("linkctl: error:")]
    assert len(err) == 1 and words in err[0], r.stderr[-2000:]
    assert "fix:" in r.stderr
    assert list(tmp_path.iterdir()) == []
    assert ns_snapshot(lab.netns("dgx")) == before


def test_no_peer_a_flapping_port_and_no_terminal_are_refused(make_lab, tmp_path):
    lab = make_lab("dgx-mac")
    plug(lab)
    before = ns_snapshot(lab.netns("dgx"))
    # Nobody at the other end: which side was missing.
    r = lab.run("dgx", *pair_args(lab, "dgx", tmp_path, "--yes", "--window", "4"))
    assert r.returncode == 2 and "the other side is missing" in r.stderr, r.stderr
    # The port loses its carrier while waiting (the peer's end goes down).
    p = subprocess.Popen(["sh", "-c", f"sleep 3; ip -n {lab.netns('mac')} link set en0 down"])
    r = lab.run("dgx", *pair_args(lab, "dgx", tmp_path, "--yes", "--window", "20"))
    p.wait()
    assert r.returncode == 2 and "enP7s7 lost its carrier during pairing" in r.stderr, r.stderr
    subprocess.run(["ip", "-n", lab.netns("mac"), "link", "set", "en0", "up"], check=True)
    # No terminal for the code and no --yes: refused before anything.
    r = lab.run("dgx", *pair_args(lab, "dgx", tmp_path))
    assert r.returncode == 2 and "pass --yes" in r.stderr, r.stderr
    # Not root.
    r = linkctl_as_nobody("pair", "--yes", netns=lab.netns("dgx"))
    assert r.returncode == 2 and "needs root" in r.stderr, r.stderr
    assert list(tmp_path.iterdir()) == []
    assert ns_snapshot(lab.netns("dgx")) == before
