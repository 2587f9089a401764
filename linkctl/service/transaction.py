"""The file transaction behind `service install` and `uninstall`: every step (mkdir,
backup, write, remove) records how to undo itself as it runs, so a failure anywhere,
or SIGTERM / SIGINT, puts back every file it touched, removed ones included. Writes
are atomic (paths.write_atomic).

Tests inject a failure with LINKCTL_INJECT_FAULT=KIND or KIND#N (the Nth step overall,
1-based), KIND one of mkdir / backup / write / remove, as plan.apply does for link
changes; ``signal:TERM#N`` or ``signal:INT#N`` sends this process that signal just
before step N."""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from linkctl.core.paths import atomic_path, write_atomic
from linkctl.core.stopflag import stop_on_signals
from linkctl.net.plan import FAULT_ENV

Undo = Callable[[], None]


class Interrupted(SystemExit):
    """SIGTERM or SIGINT stopped a transaction, which undid every step it had run.
    Exits 128 + the signal's number (143, 130), as a shell reports a process that
    signal ended; a SystemExit, so no ``except Exception`` on the way out swallows it."""

    def __init__(self, signum: int) -> None:
        super().__init__(128 + signum)
        self.signum = signum
        self.signame = signal.Signals(signum).name


@dataclass
class _Saved:
    """A file as it was before a step changed it (data None: it did not exist), so the
    undo puts back its bytes, mode, owner and mtime."""

    data: bytes | None
    mode: int = 0o644
    owner: tuple[int, int] = (0, 0)
    mtime_ns: int = 0

    @classmethod
    def of(cls, p: Path) -> _Saved:
        if not p.is_file():
            return cls(None)
        st = p.stat()
        return cls(p.read_bytes(), st.st_mode & 0o7777, (st.st_uid, st.st_gid), st.st_mtime_ns)

    def put_back(self, p: Path) -> None:
        if self.data is None:
            p.unlink(missing_ok=True)
            return
        with atomic_path(p, self.mode) as tmp:
            tmp.write_bytes(self.data)
            if os.geteuid() == 0:
                os.chown(tmp, *self.owner)
            os.utime(tmp, ns=(self.mtime_ns, self.mtime_ns))


@dataclass
class Transaction:
    steps: list[tuple[str, Callable[[], Undo]]] = field(default_factory=list)

    def mkdir(self, target: Path) -> None:
        def do() -> Undo:
            target.mkdir(mode=0o755)
            os.chmod(target, 0o755)
            return target.rmdir

        self.steps.append(("mkdir", do))

    def backup(self, target: Path, bak: Path) -> None:
        """Move a foreign file aside (FILE.linkctl-bak) before ours replaces it."""

        def do() -> Undo:
            os.replace(target, bak)
            return lambda: os.replace(bak, target)

        self.steps.append(("backup", do))

    def write(self, target: Path, text: str) -> None:
        def do() -> Undo:
            before = _Saved.of(target)
            write_atomic(target, text, 0o644)
            return lambda: before.put_back(target)

        self.steps.append(("write", do))

    def remove(self, target: Path, bak: Path | None) -> None:
        """Delete our file; put back the foreign one it replaced (``bak``) if any."""

        def do() -> Undo:
            before = _Saved.of(target)
            target.unlink(missing_ok=True)
            back = bak if bak is not None and bak.exists() else None
            if back is not None:
                os.replace(back, target)

            def undo() -> None:
                if back is not None:
                    os.replace(target, back)
                before.put_back(target)

            return undo

        self.steps.append(("remove", do))

    def run(self) -> None:
        """Every step or none: on any exception, SIGTERM and SIGINT included (as
        Interrupted), undo what ran, last first, and re-raise.

        While run() runs, those two signals only set a flag (core.stopflag: no lock, so
        the handler cannot deadlock) that is read between steps: a step never stops half
        done with its undo unrecorded, and a signal during the undo cannot cut it short;
        it is raised once the undo is done. The previous handlers are back afterwards."""
        undo: list[Undo] = []
        with stop_on_signals() as stop:
            try:
                for n, (kind, do) in enumerate(self.steps, start=1):
                    _inject_fault(kind, n)
                    if stop.signum is not None:
                        raise Interrupted(stop.signum)
                    undo.append(do())
                if stop.signum is not None:  # after the last step, still before run() returns
                    raise Interrupted(stop.signum)
            except BaseException as exc:
                for u in reversed(undo):
                    with contextlib.suppress(OSError):
                        u()
                if stop.signum is not None and not isinstance(exc, Interrupted):
                    raise Interrupted(stop.signum) from exc  # arrived during the undo
                raise


def _inject_fault(kind: str, n: int) -> None:
    fault = os.environ.get(FAULT_ENV, "")
    if fault in (kind, f"{kind}#{n}"):
        raise OSError(f"injected fault before {kind} step {n} ({FAULT_ENV})")
    sig, _, at = fault.removeprefix("signal:").partition("#")
    if fault.startswith("signal:") and at == str(n):
        # raise_signal runs the Python handler before it returns: the signal lands
        # exactly before step n.
        signal.raise_signal(signal.Signals[f"SIG{sig}"])
