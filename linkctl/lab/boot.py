"""Boot the profile's hosts for real: systemd as PID 1 in containers on the lab's namespaces.

`linkctl lab boot` and tests/test_boot.py: a lab (`linkctl lab up`) of its own, one
container (linkctl.lab.container) per profile host on the image of linkctl.lab.rootfs,
with the llama.cpp build and the head's model bound read-only. Everything created
(containers, mounts, cgroups, the namespaces) is removed at the end, also after a
failure, Ctrl-C or SIGTERM.
"""

from __future__ import annotations

import contextlib
import signal
import sys
import time
import tomllib
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from linkctl.core.errors import InputError
from linkctl.core.profile import Profile, parse_profile
from linkctl.core.runner import Result, Runner, default_runner
from linkctl.core.stopflag import sigterm_as_interrupt
from linkctl.lab import netns
from linkctl.lab.container import Bind, Container
from linkctl.lab.rootfs import VENV, Image, ImagePlan, Log, quiet
from linkctl.trust import secret

MODEL_DIR = "/srv/linkctl"  # the head's model, bound read-only


@contextlib.contextmanager
def cleanup_on_exit(fns: list[Callable[[], object]]) -> Iterator[None]:
    """Run ``fns`` in reverse order at the end of the block, whatever ends it (SIGTERM
    is turned into KeyboardInterrupt for the block's duration so it unwinds too)."""

    with sigterm_as_interrupt():
        try:
            yield
        finally:
            # No second interrupt while the cleanup runs; sigterm_as_interrupt puts the
            # old handler back afterwards.
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            for fn in reversed(fns):
                with contextlib.suppress(Exception):
                    fn()


def boot_profile_text(lab_profile_path: Path, model: str | None) -> str:
    """The lab's profile with every host running Linux (each is a Linux container; the
    Mac's role is played by one) and the head's model where the container binds it."""
    import tomli_w

    data = tomllib.loads(lab_profile_path.read_text())
    for h in data["hosts"]:
        h["os"] = "linux"
    if model:
        data.setdefault("serve", {})["model"] = model
    parse_profile(data, str(lab_profile_path))  # still a valid profile
    return f"# boot lab: {lab_profile_path} with os=linux everywhere\n" + tomli_w.dumps(data)


def llama_dir() -> Path | None:
    """The cached llama.cpp build (its version directory) the containers bind read-only,
    so that `linkctl serve` inside finds it where it would on a real host."""
    from linkctl.llama.bins import find_bins

    bins = find_bins(versions=False)
    if bins.rpc_server is None or bins.llama_server is None:
        return None
    d = Path(bins.llama_server.path).parent.parent
    return d if (d / ".complete").is_file() else None  # scripts/build-llama.sh's marker


def binds_for(profile: Profile, host: str, llama: Path | None, model: Path | None) -> list[Bind]:
    """What a host's container binds read-only: the llama.cpp build, and the head's model."""
    binds = []
    if llama:
        binds.append(Bind(str(llama), str(llama)))
    if model and profile.host(host).role == "head":
        binds.append(Bind(str(model.parent), MODEL_DIR))
    return binds


@dataclass
class BootPlan:
    """`lab boot --dry-run`: the lab, the image and the containers it would make."""

    profile: str
    lab: netns.Lab
    namespaces: list[str]
    image: ImagePlan
    containers: dict[str, dict[str, Any]]  # by profile host: name, directory, netns, binds
    llama: str | None
    install: bool

    def as_json(self) -> dict[str, Any]:
        return {**asdict(self), "dry_run": True}


def plan(profile: Profile, name: str, llama: Path | None, install: bool) -> BootPlan:
    """What `lab boot` would make, changing nothing (the refusals of netns.plan and
    rootfs's apt source included)."""
    from linkctl.lab import rootfs

    lab = netns.plan(profile, name)
    containers = {
        h.name: {
            "name": f"{name}-{h.name}",
            "dir": str(rootfs.WORK / f"{name}-{h.name}"),
            "netns": h.netns,
            "binds": [b.arg() for b in binds_for(profile, h.name, llama, None)],
        }
        for h in lab.hosts
    }
    return BootPlan(
        profile.name,
        lab,
        netns.namespaces(lab),
        rootfs.plan(),
        containers,
        str(llama) if llama else None,
        install,
    )


@dataclass
class BootLab:
    """The profile's hosts as booted containers on a lab (`linkctl lab up`) of their own.

    Use as a context manager: everything is removed at the end, whatever ends it."""

    profile: Profile
    name: str
    image: Image
    llama: Path | None = None  # llama.cpp version directory, bound read-only
    model: Path | None = None  # the head's GGUF, its directory bound read-only at MODEL_DIR
    runner: Runner = field(default_factory=default_runner)
    log: Log = quiet
    containers: dict[str, Container] = field(default_factory=dict)  # by profile host name
    lab: netns.Lab | None = None  # set by up()
    profile_in_container: str = ""
    _undo: list[Callable[[], object]] = field(default_factory=list)

    def __enter__(self) -> BootLab:
        self._cleanup = cleanup_on_exit(self._undo)
        self._cleanup.__enter__()
        try:
            self.up()
        except BaseException:
            self._cleanup.__exit__(*sys.exc_info())
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self._cleanup.__exit__(*exc)  # type: ignore[arg-type]

    def up(self) -> None:
        profile = self.profile
        self._undo.append(lambda: netns.down(self.name))
        self.lab = lab = netns.up(profile, self.name)
        text = boot_profile_text(
            Path(lab.profile_path),
            f"{MODEL_DIR}/{self.model.name}" if self.model else None,
        )
        self.profile_in_container = f"/root/{profile.name}-lab.toml"
        key = secret.load(f"{profile.name}-lab", lab.host_state_dir(lab.hosts[0].name)).key
        for h in lab.hosts:
            binds = binds_for(profile, h.name, self.llama, self.model)
            c = Container(f"{self.name}-{h.name}", h.netns, self.image, binds, runner=self.runner)
            self._undo.append(c.destroy)
            c.create()
            (c.root / self.profile_in_container.lstrip("/")).write_text(text)
            secret.store(f"{profile.name}-lab", key, c.root / "var/lib/linkctl")
            self.containers[h.name] = c
        self.boot_all()

    def down(self) -> None:
        """Remove everything now (idempotent: a second call finds nothing to do)."""
        self.__exit__(None, None, None)
        self._undo.clear()

    def linkctl(self, host: str, *args: str, timeout: float = 180) -> Result:
        """`linkctl ARGS` run by root inside ``host``'s container, as a user would."""
        return self.containers[host].exec(
            [f"{VENV}/bin/linkctl", *args], check=False, timeout=timeout
        )

    def install_services(self) -> dict[str, Result]:
        """`linkctl service install --profile P` in every container (the real command:
        it writes the container's /etc/systemd/system and enables the units)."""
        out = {}
        for n in self.containers:
            r = self.linkctl(n, "service", "install", "--profile", self.profile_in_container)
            if not r.ok:
                raise InputError(f"service install on {n} failed: {(r.stderr or r.stdout)[-500:]}")
            out[n] = r
        return out

    def boot_all(self, which: list[str] | None = None, timeout: float = 180.0) -> float:
        """Start the containers (their ports reset, as a power-on resets a NIC) and wait
        until every PID 1 is up; returns the wall seconds."""
        assert self.lab is not None, "boot_all before up"
        t0 = time.monotonic()
        names = which or list(self.containers)
        for n in names:
            netns.reset_port(self.lab, n)
            self.containers[n].start()
        for n in names:
            self.containers[n].wait_booted(timeout)
        took = time.monotonic() - t0
        self.log(f"booted {', '.join(names)} in {took:.1f} s")
        return took

    def reboot_all(self, which: list[str] | None = None, timeout: float = 180.0) -> float:
        """`systemctl reboot` in each, then boot them again together."""
        t0 = time.monotonic()
        names = which or list(self.containers)
        for n in names:
            self.containers[n].exec(["systemctl", "reboot"], check=False, timeout=30)
        for n in names:
            if self.containers[n].wait_exit(90) is None:
                raise InputError(f"container {n} did not go down within 90 s of reboot")
        self.boot_all(names, timeout)
        return time.monotonic() - t0
