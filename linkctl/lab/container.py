"""One booted host: systemd as PID 1 in systemd-nspawn, inside a lab namespace.

nspawn is started from inside the host's pre-made namespace, so the container's
only links are the lab's: the link port named like the profile's interface and the
"wifi" port that holds the default route. What makes a device unit
(sys-subsystem-net-devices-IFACE.device) work in such a container, and what keeps
the host safe, was worked out on this machine and is recorded in
../shared/notes/systemd-boot-in-nspawn.md:
- nspawn is started with `nsenter --net` inside the pre-made namespace (with an
  nspawn network option, or under `ip netns exec`, /sys shows the host's links or
  the cgroup mounts vanish);
- SYSTEMD_NSPAWN_API_VFS_WRITABLE=yes, else device units are "unsupported";
- CAP_NET_ADMIN, so udevd can broadcast its events;
- a fresh /run/udev holding an empty `control` file at every boot (the rootfs masks
  every udev rule but 99-systemd.rules and limits the trigger to net devices);
- the launcher in cgroup directories of its own, so parallel containers do not
  share nspawn's payload/supervisor cgroups.
Writable API filesystems would let the container's root write host-global
/proc/sys (its PID 1 raised the host's fs.file-max): /proc/sys is bound read-only.
`destroy` removes what a container made (mounts, cgroups, nspawn's propagate
directory, its files).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from linkctl.core.errors import InputError
from linkctl.core.runner import Result, Runner, default_runner
from linkctl.lab.rootfs import CLEAN_ENV, VENV, WORK, Image, in_chroot, mount_overlay, umount

CGROUP_ROOTS = (Path("/sys/fs/cgroup/systemd"), Path("/sys/fs/cgroup/unified"))
PROPAGATE = Path("/run/systemd/nspawn/propagate")


@dataclass
class Bind:
    source: str
    target: str
    read_only: bool = True

    def arg(self) -> str:
        return f"--bind{'-ro' if self.read_only else ''}={self.source}:{self.target}"


@dataclass
class Container:
    """One host: systemd as PID 1 in systemd-nspawn, inside lab namespace ``netns``."""

    name: str
    netns: str
    image: Image
    binds: list[Bind] = field(default_factory=list)
    work: Path = WORK
    runner: Runner = field(default_factory=default_runner)
    proc: subprocess.Popen | None = None
    boots: int = 0

    @property
    def dir(self) -> Path:
        return self.work / self.name

    @property
    def root(self) -> Path:
        return self.dir / "root"

    @property
    def cgroups(self) -> list[Path]:
        return [r / f"linkctl-boot-{self.name}" for r in CGROUP_ROOTS if r.is_dir()]

    def create(self) -> None:
        """The overlay root, with linkctl's wheel installed (offline, no dependencies)."""
        if self.dir.exists():
            raise InputError(f"container directory {self.dir} exists", "remove it first")
        for d in ("upper", "work", "root"):
            (self.dir / d).mkdir(parents=True)
        mount_overlay(
            self.runner, self.root, self.image.layers, self.dir / "upper", self.dir / "work"
        )
        dest = self.root / "tmp" / self.image.wheel.name
        shutil.copy(self.image.wheel, dest)
        in_chroot(
            self.runner,
            self.root,
            [f"{VENV}/bin/pip", "install", "-q", "--no-index", "--no-deps", "--no-cache-dir",
             "--disable-pip-version-check", f"/tmp/{dest.name}"],
        )  # fmt: skip
        dest.unlink()
        for b in self.binds:
            (self.root / b.target.lstrip("/")).mkdir(parents=True, exist_ok=True)

    def start(self) -> None:
        """Boot: nspawn, from inside the namespace, in cgroups of its own."""
        if self.running:
            raise InputError(f"container {self.name} is already running")
        run_udev = self.dir / "run-udev"
        shutil.rmtree(run_udev, ignore_errors=True)
        run_udev.mkdir()
        (run_udev / "control").touch()
        for cg in self.cgroups:
            cg.mkdir(exist_ok=True)
        argv = [
            "nsenter",
            f"--net=/run/netns/{self.netns}",
            "systemd-nspawn",
            "--quiet",
            "--boot",
            "--directory",
            str(self.root),
            "--register=no",
            "--keep-unit",
            f"--machine={self.name}",
            "--capability=CAP_NET_ADMIN",
            "--console=pipe",
            f"--bind={run_udev}:/run/udev",
            # Host-global tunables stay the host's: the container sees them read-only.
            "--bind-ro=/proc/sys:/proc/sys",
            *(b.arg() for b in self.binds),
        ]
        env = {**CLEAN_ENV, "SYSTEMD_NSPAWN_API_VFS_WRITABLE": "yes"}
        self.boots += 1
        log = open(self.dir / "console.log", "ab")  # noqa: SIM115 (the child holds it)
        log.write(f"\n--- boot {self.boots} ---\n".encode())
        log.flush()
        try:
            self.proc = self.runner.spawn(
                argv,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                cgroups=list(map(str, self.cgroups)),
            )
        finally:
            log.close()

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def leader(self) -> int | None:
        """The container's PID 1 (as the host sees it): nspawn's child."""
        if not self.running:
            return None
        assert self.proc is not None
        try:
            kids = Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children").read_text().split()
        except OSError:
            return None
        return int(kids[0]) if kids else None

    def wait_booted(self, timeout: float = 120.0) -> float:
        """Until PID 1 reports running (or degraded); returns seconds since the call."""
        t0 = time.monotonic()
        deadline = t0 + timeout
        state = "no PID 1"
        while time.monotonic() < deadline:
            if not self.running:
                raise InputError(f"container {self.name} exited during boot: {self.console()}")
            if self.leader():
                r = self.exec(["systemctl", "is-system-running"], check=False, timeout=20)
                state = r.stdout.strip() or state
                if state in ("running", "degraded"):
                    return time.monotonic() - t0
            time.sleep(0.2)
        raise InputError(f"container {self.name} not booted within {timeout:g} s (state {state})")

    def exec(
        self, argv: list[str], *, check: bool = True, timeout: float = 120, input: str | None = None
    ) -> Result:
        """Run ``argv`` inside the container, as root with a clean environment."""
        pid = self.leader()
        if pid is None:
            raise InputError(f"container {self.name} is not running")
        return self.runner.run(
            ["nsenter", "-t", str(pid), "-a", *argv],
            check=check,
            timeout=timeout,
            input=input,
            env=CLEAN_ENV,
        )

    def console(self, tail: int = 2000) -> str:
        try:
            return (self.dir / "console.log").read_text(errors="replace")[-tail:]
        except OSError:
            return ""

    def wait_exit(self, timeout: float) -> int | None:
        if self.proc is None:
            return None
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def power_cut(self) -> None:
        """Pulled plug: SIGKILL to PID 1 takes down every process of the container at
        once (nothing is stopped, nothing flushed); nspawn then exits."""
        pid = self.leader()
        if pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if self.wait_exit(30) is None and self.proc is not None:
            self.proc.kill()
            self.proc.wait(10)

    def stop(self, timeout: float = 30.0) -> None:
        """Poweroff (SIGRTMIN+4 to PID 1), SIGKILL when it takes longer than ``timeout``."""
        if self.running:
            pid = self.leader()
            if pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGRTMIN + 4)
            if self.wait_exit(timeout) is None:
                self.power_cut()
        self._remove_cgroups()

    def _remove_cgroups(self) -> None:
        for cg in self.cgroups:
            if cg.is_dir():
                for d in sorted((p for p in cg.rglob("*") if p.is_dir()), reverse=True):
                    with contextlib.suppress(OSError):
                        d.rmdir()
                with contextlib.suppress(OSError):
                    cg.rmdir()

    def destroy(self) -> list[str]:
        """Stop, unmount, remove every file and directory made for this container."""
        self.stop()
        left = []
        umount(self.runner, self.root)
        if os.path.ismount(self.root):
            left.append(f"mount {self.root}")
        else:
            shutil.rmtree(self.dir, ignore_errors=True)
        shutil.rmtree(PROPAGATE / self.name, ignore_errors=True)
        left += [f"cgroup {cg}" for cg in self.cgroups if cg.exists()]
        return left
