"""The file transaction behind `service install`: every step (mkdir, backup, write,
remove) records how to undo itself as it runs, so a failure anywhere puts back every
file it touched, removed ones included. Writes are atomic (paths.write_atomic).

Tests inject a failure with LINKCTL_INJECT_FAULT=KIND or KIND#N (the Nth step overall,
1-based), KIND one of mkdir / backup / write / remove, as plan.apply does for link changes."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from linkctl.core.paths import atomic_path, write_atomic
from linkctl.net.plan import FAULT_ENV


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
    steps: list[tuple[str, Callable[[], Callable[[], None]]]] = field(default_factory=list)

    def mkdir(self, target: Path) -> None:
        def do() -> Callable[[], None]:
            target.mkdir(mode=0o755)
            os.chmod(target, 0o755)
            return target.rmdir

        self.steps.append(("mkdir", do))

    def backup(self, target: Path, bak: Path) -> None:
        """Move a foreign file aside (FILE.linkctl-bak) before ours replaces it."""

        def do() -> Callable[[], None]:
            os.replace(target, bak)
            return lambda: os.replace(bak, target)

        self.steps.append(("backup", do))

    def write(self, target: Path, text: str) -> None:
        def do() -> Callable[[], None]:
            before = _Saved.of(target)
            write_atomic(target, text, 0o644)
            return lambda: before.put_back(target)

        self.steps.append(("write", do))

    def remove(self, target: Path, bak: Path | None) -> None:
        """Delete our file; put back the foreign one it replaced (``bak``) if any."""

        def do() -> Callable[[], None]:
            before = _Saved.of(target)
            target.unlink(missing_ok=True)
            restored = bak is not None and bak.exists()
            if restored:
                os.replace(bak, target)

            def undo() -> None:
                if restored:
                    os.replace(target, bak)
                before.put_back(target)

            return undo

        self.steps.append(("remove", do))

    def run(self) -> None:
        """Every step or none: on any OSError, undo what ran, last first, and re-raise."""
        undo: list[Callable[[], None]] = []
        fault = os.environ.get(FAULT_ENV)
        try:
            for n, (kind, do) in enumerate(self.steps, start=1):
                if fault in (kind, f"{kind}#{n}"):
                    raise OSError(f"injected fault before {kind} step {n} ({FAULT_ENV})")
                undo.append(do())
        except OSError:
            for u in reversed(undo):
                with contextlib.suppress(OSError):
                    u()
            raise
