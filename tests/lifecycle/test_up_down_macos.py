"""`linkctl up` and `linkctl down` on the Mac, through its own commands: networksetup and
ifconfig answered from recorded outputs (tests/support/macos_replay.py), launchctl's
bootstrap/bootout answered as a Mac answers them (nothing on stdout, exit 0), the
launchd plists written into a directory standing in for the Mac's /. The stages are
the real ones (lifecycle.up / lifecycle.down); only the peer (the DGX's responder and
the Mac's own llama-server) is not here, so the two waits report what a Mac would.
The Linux side runs under a real systemd: tests/lab/test_up_down.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from linkctl.core.profile import load_profile, parse_profile
from linkctl.core.records import CalibrationFile, CalibrationRecord, dump
from linkctl.lifecycle.down import down
from linkctl.lifecycle.up import UpOptions, Waits, up
from linkctl.net import link
from linkctl.trust import secret
from support.macos_replay import (
    MTU_BACK,
    SETDHCP,
    SETMANUAL,
    SETMTU,
    Reply,
    argv,
    backend,
    mac_studio,
)
from support.service_kit import LINKCTL, make_target, tree

BUILD = "version: 7948 (b828e18c7)"
JOBS = ("link", "probe", "responder", "serve")


@pytest.fixture
def mac_machine(tmp_path, monkeypatch):
    """The Mac: its root (linkctl and llama.cpp where the daemons run them), its state
    directory with a calibration already measured for this build, its model, and its
    commands (the replay runner)."""
    monkeypatch.setattr(link.arp, "who_has", lambda ifname, ip, **_: [])
    state = tmp_path / "state"
    monkeypatch.setenv("LINKCTL_STATE_DIR", str(state))
    monkeypatch.delenv("LINKCTL_LLAMA_BIN", raising=False)
    rec = CalibrationRecord(host="mac", measured_at="2026-12-01T10:00:00Z", build=BUILD)
    state.mkdir()
    (state / "calibration.json").write_text(dump(CalibrationFile(hosts={"mac": rec})))
    secret.store("dgx-mac", secret.generate())  # as `linkctl pair` leaves it
    root = make_target(tmp_path / "root")
    llama = tmp_path / "llama"  # real, for up's own check; the same path inside root
    for d in (llama, root / str(llama).lstrip("/")):
        d.mkdir(parents=True, exist_ok=True)
        for b in ("llama-server", "ggml-rpc-server"):
            (d / b).write_bytes(b"\x7fELF stand-in\n")
            (d / b).chmod(0o755)
    model = tmp_path / "model.gguf"
    model.write_bytes(b"GGUF stand-in")
    data = load_profile("dgx-mac")[0].to_toml_dict()
    data["serve"]["model"] = str(model)
    profile_path = tmp_path / "dgx-mac.toml"
    import tomli_w

    profile_path.write_text(tomli_w.dumps(data))
    runner = mac_studio()
    runner.tools |= {"launchctl", "iperf3"}
    for b in ("llama-server", "ggml-rpc-server"):
        runner.tools.add(str(llama / b))
        runner.answers[(str(llama / b), "--version")] = Reply(stderr=BUILD + "\n")
    for job in JOBS:
        label = f"system/com.linkctl.{job}"
        for cmd in (f"launchctl bootout {label}", f"launchctl enable {label}"):
            runner.answers[argv(cmd)] = Reply()
        for d in ("/Library/LaunchDaemons", "/var/run/linkctl/launchd"):
            runner.answers[argv(f"launchctl bootstrap system {d}/com.linkctl.{job}.plist")] = (
                Reply()
            )
    prof = parse_profile(data, str(profile_path))
    return prof, profile_path, root, state, runner, llama


def waits(calls: list[str]) -> Waits:
    """The peer is not here: the gate and the server report what a Mac would."""

    def gate(prof, h, since, wait_s, say):
        calls.append("gate")
        return since is not None, "dgx probed ok (replayed: no peer here)"

    def serving(prof, h, wait_s, say):
        calls.append("serving")
        return False, "127.0.0.1:9999 answers (replayed)"

    return Waits(gate, serving)


def launchctl(runner) -> list[str]:
    return [c for c in runner.commands() if c.startswith("launchctl")]


@pytest.mark.parametrize("boot", [True, False], ids=["boot", "no-boot"])
def test_up_then_down_on_the_mac_leaves_it_as_it_was(mac_machine, boot):
    prof, profile_path, root, state, runner, llama = mac_machine
    mac = prof.host("mac")
    be = backend(runner)
    root_before, state_before = tree(root), tree(state)
    said: list[str] = []
    calls: list[str] = []
    opts = UpOptions(boot=boot, llama_bin_dir=str(llama), linkctl_bin=LINKCTL)
    res = up(prof, profile_path, mac, be, opts, say=said.append, root=root, waits=waits(calls))

    assert runner.unexpected == []
    assert runner.changes() == [f"networksetup {c.split(' ', 1)[1]}" for c in (SETMTU, SETMANUAL)]
    plist_dir = "/Library/LaunchDaemons" if boot else "/var/run/linkctl/launchd"
    plists = sorted(str(p.relative_to(root)) for p in (root / plist_dir.lstrip("/")).glob("*"))
    assert plists == [f"{plist_dir.lstrip('/')}/com.linkctl.{j}.plist" for j in sorted(JOBS)]
    assert (root / "etc/linkctl/profiles/dgx-mac.toml").read_text() == profile_path.read_text()
    for job in JOBS:
        label = f"system/com.linkctl.{job}"
        assert launchctl(runner)[-12:].count(f"launchctl enable {label}") == 1
        assert f"launchctl bootstrap system {plist_dir}/com.linkctl.{job}.plist" in launchctl(
            runner
        )
    assert [s.name for s in res.stages] == ["link", "calibration", "services", "peer", "serve"]
    changed = {s.name: s.changed for s in res.stages}
    assert changed == {
        "link": True,
        "calibration": False,  # measured for this build already
        "services": True,
        "peer": True,
        "serve": False,
    }
    assert calls == ["gate", "serving"]
    assert res.summary().endswith(
        "serving: llama-server (split over 192.168.100.2:50052) at http://127.0.0.1:9999, "
        "no API key needed; try: curl -s http://127.0.0.1:9999/v1/chat/completions "
        '-H \'Content-Type: application/json\' -d \'{"messages":[{"role":"user",'
        '"content":"Say hello."}],"max_tokens":32}\''
    )

    # Again: every stage finds its work done.
    again = up(prof, profile_path, mac, be, opts, say=said.append, root=root, waits=waits(calls))
    assert not again.changed and again.summary().startswith("nothing changed; serving:")
    assert runner.changes() == [f"networksetup {c.split(' ', 1)[1]}" for c in (SETMTU, SETMANUAL)]

    n = len(runner.history)
    gone = down(prof, profile_path, mac, be, say=said.append, runner=runner, root=root)
    assert runner.unexpected == []
    after = [" ".join(a) for a in runner.history[n:]]
    assert [c for c in after if c.startswith("networksetup -set")] == [SETDHCP, MTU_BACK]
    assert [c for c in after if c.startswith("launchctl")] == [
        f"launchctl bootout system/com.linkctl.{j}" for j in reversed(JOBS)
    ]
    assert gone.summary() == "mac is as it was before `linkctl up`"
    assert tree(root) == root_before
    assert tree(state) == state_before

    twice = down(prof, profile_path, mac, be, say=said.append, runner=runner, root=root)
    assert not twice.changed and twice.summary().startswith("nothing to do")
    assert tree(root) == root_before and tree(state) == state_before


def test_up_on_the_mac_refuses_the_dgx_host_before_changing_anything(mac_machine):
    prof, profile_path, root, state, runner, llama = mac_machine
    root_before, state_before = tree(root), tree(state)
    from linkctl.core.errors import InputError

    with pytest.raises(InputError) as e:
        up(
            prof,
            profile_path,
            prof.host("dgx"),
            backend(runner),
            UpOptions(llama_bin_dir=str(llama), linkctl_bin=LINKCTL),
            say=lambda _m: None,
            root=root,
        )
    assert e.value.line() == (
        "profile 'dgx-mac': host dgx runs linux, this machine runs macos "
        "(fix: run up on that host, or pass --host NAME of this machine)"
    )
    assert runner.changes() == [] and launchctl(runner) == []
    assert tree(root) == root_before and tree(state) == state_before
    assert Path(state / "up").exists() is False
