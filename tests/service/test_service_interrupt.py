"""A signal at any step of `linkctl service install` leaves the root as it was.

The real CLI in its own process sends itself a real SIGTERM or SIGINT just before step N
(LINKCTL_INJECT_FAULT=signal:TERM#N, see service/transaction.py), for every N until the
install completes; each time it must exit 128 + the signal's number and leave the root
byte-identical (every path, its bytes, mode, owner, symlink target, and the mtime of
every file), the foreign file it backs up included. The step count is checked against
the transaction's own list, so no step goes untested.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable
from itertools import count
from pathlib import Path

import pytest

from linkctl import service as svc
from linkctl.core.profile import load_profile
from linkctl.net.plan import FAULT_ENV
from linkctl.service.transaction import Interrupted, Transaction
from support.service_kit import cli_install, make_target, steps_of, target_paths, tree

EXIT = {"TERM": 128 + signal.SIGTERM, "INT": 128 + signal.SIGINT}  # 143, 130
EXIT_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def foreign_target(root: Path) -> Path:
    """A target machine with things install must not lose: a foreign unit where ours
    goes (backed up, replaced), an old mtime on it, and a symlink."""
    make_target(root)
    unit = root / "etc/systemd/system/linkctl-serve.service"
    unit.parent.mkdir(parents=True)
    unit.write_text("# someone else's unit\n")
    os.utime(unit, ns=(1_000_000_000, 1_000_000_000))
    (root / "opt/llama/bin/rpc-server").symlink_to("ggml-rpc-server")
    return root


def interrupt_every_step(root: Path, profile: str, host: str) -> int:
    """Signal install before step 1, 2, ... until it completes; returns the step count."""
    before = tree(root)
    for n in count(1):
        for sig, code in EXIT.items():
            env = {**os.environ, FAULT_ENV: f"signal:{sig}#{n}"}
            r = cli_install(root, profile=profile, host=host, env=env)
            if r.returncode == 0:  # no step n: the install ran to the end
                assert sig == "TERM", f"SIGTERM before step {n} stopped it, SIGINT did not"
                return n - 1
            assert r.returncode == code, f"SIG{sig} before step {n}: {r.stdout}{r.stderr}"
            assert f"stopped by SIG{sig}" in r.stderr and "Traceback" not in r.stderr, r.stderr
            assert tree(root) == before, f"SIG{sig} before step {n} left the root changed"


def test_a_signal_at_any_install_step_leaves_the_root_as_it_was(tmp_path, monkeypatch):
    prof, _ = load_profile("dgx-mac")
    root = foreign_target(tmp_path / "root")
    kinds = steps_of(
        monkeypatch, lambda: svc.install(prof, prof.host("dgx"), target_paths("dgx-mac"), root=root)
    )
    assert {"mkdir", "backup", "write"} <= set(kinds)
    assert interrupt_every_step(root, profile="dgx-mac", host="dgx") == len(kinds)
    assert (root / f"etc/systemd/system/linkctl-serve.service{svc.BACKUP_SUFFIX}").is_file()


def test_a_signal_at_any_step_of_an_update_leaves_the_first_install(tmp_path, monkeypatch):
    """Over an existing install, another profile: units rewritten, the old profile copy
    removed, a foreign file at the new one's path backed up."""
    root = foreign_target(tmp_path / "root")
    assert cli_install(root).returncode == 0
    (root / "etc/linkctl/profiles/dgx2-mac-switch.toml").write_text("# a foreign profile\n")
    prof, _ = load_profile("dgx2-mac-switch")
    paths = target_paths("dgx2-mac-switch")
    kinds = steps_of(monkeypatch, lambda: svc.install(prof, prof.host("dgx2"), paths, root=root))
    assert {"backup", "write", "remove"} <= set(kinds)
    assert interrupt_every_step(root, profile="dgx2-mac-switch", host="dgx2") == len(kinds)
    assert not (root / "etc/linkctl/profiles/dgx-mac.toml").exists()


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_during_the_undo_does_not_cut_it_short(tmp_path, signum):
    """A failing step makes the transaction undo; the signal arrives during the undo
    (the first undo sends it): every other undo still runs, then the signal is raised,
    and the handlers from before are back."""
    handlers = {s: signal.getsignal(s) for s in EXIT_SIGNALS}
    tx = Transaction()
    tx.mkdir(tmp_path / "made")
    tx.steps.append(("write", lambda: lambda: signal.raise_signal(signum)))

    def fail() -> Callable[[], None]:
        raise OSError("disk full")

    tx.steps.append(("write", fail))
    with pytest.raises(Interrupted) as e:
        tx.run()
    assert not (tmp_path / "made").exists()  # the undo after the signal's ran too
    assert (e.value.signum, e.value.code) == (signum, 128 + signum)
    assert isinstance(e.value.__cause__, OSError)
    assert {s: signal.getsignal(s) for s in EXIT_SIGNALS} == handlers
