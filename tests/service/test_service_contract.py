"""Both service managers held to one contract, as test_contracts.py does for the network
backends: the same interface, the same status record, and the same file transaction
(install then uninstall leaves the root exactly as it was; a fault at any step of an
install puts back every file it touched, removed ones included).

systemd's systemctl runs for real (on this machine it answers that systemd is not PID 1;
tests/test_boot.py drives the units under a real systemd); launchctl cannot run on Linux,
so its answers are replayed (tests/fixtures/macos/launchctl-print-*, see SOURCES.md).
"""

from __future__ import annotations

import inspect
import json
from dataclasses import fields

import pytest

from linkctl import service as svc
from linkctl.core.errors import InputError
from linkctl.core.profile import load_profile
from linkctl.core.runner import Runner
from linkctl.net.plan import FAULT_ENV
from linkctl.service.base import ServiceManager, UnitStatus
from linkctl.service.launchd import Launchd
from linkctl.service.manager import manager_for
from linkctl.service.systemd import Systemd
from support.macos_replay import ReplayRunner, Reply, argv, out
from support.service_kit import as_os, make_target, steps_of, target_paths, tree

PROF = load_profile("dgx-mac")[0]
CLASSES = {"linux": Systemd, "macos": Launchd}


@pytest.fixture(params=["linux-dgx", "linux-mac", "macos-dgx", "macos-mac"])
def host(request):
    """Each role under each manager (the roles render different serve units)."""
    os_name, name = request.param.split("-")
    return as_os(PROF.host(name), os_name)


def test_both_managers_implement_the_whole_interface_with_the_same_signatures():
    methods = [n for n, v in vars(ServiceManager).items() if callable(v) and n[0] != "_"]
    assert {"render", "service_names", "install_commands", "uninstall_commands",
            "unit_status"} <= set(methods)  # fmt: skip
    for cls in CLASSES.values():
        for name in methods:
            want = list(inspect.signature(getattr(ServiceManager, name)).parameters)
            assert list(inspect.signature(getattr(cls, name)).parameters) == want, (cls, name)
        m = cls()
        assert type(m.dynamic_user) is bool and type(m.start_hint) is str
        assert type(m.extra_dirs) is tuple and all(d.startswith("/") for d in m.extra_dirs)
        g = m.serve_gids
        assert g is None or (type(g) is tuple and len(g) == 2 and 0 < g[0] <= g[1]), g
    assert (Systemd.name, Launchd.name) == ("systemd", "launchd")
    for os_name, cls in CLASSES.items():
        assert type(manager_for(as_os(PROF.host("dgx"), os_name))) is cls


def check_unit(u: UnitStatus, name: str) -> None:
    assert type(u) is UnitStatus and u.name == name
    assert type(u.active) is str and u.active and type(u.ok) is bool
    for f in ("sub", "enabled", "result"):
        assert getattr(u, f) is None or type(getattr(u, f)) is str
    assert u.pid is None or (type(u.pid) is int and u.pid > 0)
    assert list(u.as_dict()) == [f.name for f in fields(UnitStatus)]
    json.dumps(u.as_dict())


def test_unit_status_is_one_record_for_both_managers():
    # systemd for real: whatever systemctl answers here, the record has the same shape.
    for name in Systemd().service_names():
        check_unit(Systemd().unit_status(Runner(), name), name)
    runner = ReplayRunner(
        answers={
            argv("launchctl print system/com.linkctl.responder"): out(
                "launchctl-print-running-constructed.txt"
            ),
            argv("launchctl print system/com.linkctl.link"): out(
                "launchctl-print-exited-constructed.txt"
            ),
            # launchctl print of a label that is not loaded fails; only its status counts.
            argv("launchctl print system/com.linkctl.serve"): Reply(returncode=113),
            argv("launchctl print system/com.linkctl.probe"): Reply(returncode=113),
        },
        tools={"launchctl"},
    )
    got = {n: Launchd().unit_status(runner, n) for n in Launchd().service_names()}
    for n, u in got.items():
        check_unit(u, n)
    assert (got["com.linkctl.responder"].ok, got["com.linkctl.responder"].pid) == (True, 913)
    assert got["com.linkctl.link"].ok and got["com.linkctl.link"].result == "0"  # one-shot done
    assert not got["com.linkctl.serve"].ok and got["com.linkctl.serve"].active == "not loaded"


def test_install_then_uninstall_leaves_the_root_exactly_as_before(host, tmp_path):
    root = make_target(tmp_path / "root")
    mgr = manager_for(host)
    unit = next(iter(mgr.render(PROF, host, target_paths("dgx-mac"))))
    foreign = root / unit.lstrip("/")
    foreign.parent.mkdir(parents=True)
    foreign.write_text("# someone else's file\n")  # replaced, backed up, then restored
    before = tree(root)
    res = svc.install(PROF, host, target_paths("dgx-mac"), root=root)
    assert res.manager == mgr.name
    assert {f.action for f in res.files} == {"create", "replace"}
    st = svc.status(root=root)
    assert st.ok and st.manager == mgr.name and st.services == []
    assert [type(f) for f in st.files] == [svc.FileState] * len(st.files)
    assert {f.state for f in st.files} == {"ok"}
    assert set(st.as_dict()) == {"root", "installed", "manager", "profile", "host", "files",
                                 "services", "notes", "ok"}  # fmt: skip
    assert foreign.read_text() != "# someone else's file\n"
    svc.uninstall(root=root)
    assert tree(root) == before


def fault_at_every_step_restores(monkeypatch, root, do) -> list[str]:
    kinds = steps_of(monkeypatch, do)
    before = tree(root)
    for n, kind in enumerate(kinds, start=1):
        monkeypatch.setenv(FAULT_ENV, f"{kind}#{n}")
        with pytest.raises(InputError, match="failed and was undone"):
            do()
        assert tree(root) == before, f"fault at step {n} ({kind}) left the root changed"
    monkeypatch.delenv(FAULT_ENV)
    return kinds


def test_a_fault_at_any_install_step_restores_every_file_it_touched(host, tmp_path, monkeypatch):
    root = make_target(tmp_path / "root")
    mgr = manager_for(host)
    unit = next(iter(mgr.render(PROF, host, target_paths("dgx-mac"))))
    (root / unit.lstrip("/")).parent.mkdir(parents=True)
    (root / unit.lstrip("/")).write_text("# someone else's file\n")
    first = fault_at_every_step_restores(
        monkeypatch, root, lambda: svc.install(PROF, host, target_paths("dgx-mac"), root=root)
    )
    assert {"mkdir", "backup", "write"} <= set(first)
    svc.install(PROF, host, target_paths("dgx-mac"), root=root)
    # A second install for the profile at another path: the old copy is removed (and the
    # units rewritten), a foreign file at the new path backed up; a fault after the
    # removal must bring the removed file back.
    moved = svc.ServicePaths(
        **{**target_paths("dgx-mac").__dict__, "profile_path": f"{svc.PROFILE_DIR}/moved.toml"}
    )
    (root / moved.profile_path.lstrip("/")).write_text("# a foreign profile\n")
    second = fault_at_every_step_restores(
        monkeypatch, root, lambda: svc.install(PROF, host, moved, root=root)
    )
    assert {"backup", "write", "remove"} <= set(second)
    assert second.index("remove") < len(second) - 1  # some step fails after the removal
    res = svc.install(PROF, host, moved, root=root)
    assert "remove" in {f.action for f in res.files}
    assert not (root / svc.PROFILE_DIR.lstrip("/") / "dgx-mac.toml").exists()
