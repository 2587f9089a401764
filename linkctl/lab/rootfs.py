"""The image the boot lab's containers start from: a Debian rootfs and linkctl in it.

A minimal Debian rootfs (mmdebstrap from this machine's own apt sources) is built
once and cached by a hash of its recipe under /var/cache/linkctl/rootfs/; a second
cached layer holds a virtualenv with linkctl's dependencies, installed offline
from wheels built on this host. linkctl's own wheel, built from the checkout for
each run, goes into every container's overlay (linkctl.lab.container).

The rootfs changes that make a device unit work in a container and keep the host
safe (every udev rule but 99-systemd.rules masked, a trigger limited to net devices,
the units that write kernel tunables masked) are those worked out on this machine
and recorded in ../shared/notes/systemd-boot-in-nspawn.md.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import tempfile
import time
import tomllib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from linkctl.core.errors import InputError
from linkctl.core.paths import is_published, publish_dir
from linkctl.core.runner import Result, Runner, default_runner

# The checkout the wheel is built from (the harness runs from a source tree).
REPO_ROOT = Path(__file__).resolve().parents[2]
CACHE = Path("/var/cache/linkctl")
WORK = Path("/var/tmp/linkctl-boot")  # per run: linkctl's wheel, one directory per container
VENV = "/opt/linkctl"  # linkctl inside the containers: /opt/linkctl/bin/linkctl
# What each container runs: systemd and udev (PID 1, device units), python3 + venv
# (linkctl), iproute2/iperf3/ping (setup, probe, responder), libgomp1 (llama.cpp's
# OpenMP build), curl (the first request `linkctl up` tells its owner to send).
PACKAGES = (
    "systemd",
    "systemd-sysv",
    "dbus",
    "udev",
    "python3",
    "python3-venv",
    "iproute2",
    "iperf3",
    "iputils-ping",
    "libgomp1",
    "curl",
)
NM_PACKAGES = ("network-manager",)
# Only 99-systemd.rules (TAG+="systemd" on net devices) is kept; every other rule
# would act on the host's devices through the writable /sys.
KEEP_RULES = ("99-systemd.rules",)
TRIGGER_DROPIN = (
    "# linkctl boot harness: replay only net devices (the container's own links);\n"
    "# the stock trigger writes to every uevent file in the host's /sys.\n"
    "[Service]\n"
    "ExecStart=\n"
    "ExecStart=-udevadm trigger --type=devices --subsystem-match=net --action=add\n"
)
# Units that write host-global kernel state (sysctls, binfmt, modules) or have no
# business in a container: masked in the rootfs (and /proc/sys is read-only anyway).
MASKED = (
    "systemd-sysctl.service",
    "systemd-binfmt.service",
    "proc-sys-fs-binfmt_misc.automount",
    "systemd-modules-load.service",
    "kmod-static-nodes.service",
    "systemd-timesyncd.service",
    "getty@.service",
    "console-getty.service",
    # Periodic housekeeping a lab host has no use for, which writes the state the lab
    # tests compare before and after (apt-daily, Persistent=true, ran in a CI boot and
    # wrote /var/cache/apt and /var/lib/apt/daily_lock between two reads).
    "apt-daily.timer",
    "apt-daily-upgrade.timer",
    "dpkg-db-backup.timer",
    "logrotate.timer",
    "man-db.timer",
    "e2scrub_all.timer",
    "fstrim.timer",
)
RECIPE_VERSION = 1
CLEAN_ENV = {
    "PATH": f"{VENV}/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "LANG": "C.UTF-8",
    "HOME": "/root",
    "TERM": "dumb",
}

Log = Callable[[str], None]


def quiet(_msg: str) -> None:
    """The default log: say nothing."""


@dataclass(frozen=True)
class AptSource:
    uri: str
    suite: str
    components: tuple[str, ...]


def apt_source(etc: Path = Path("/etc/apt")) -> AptSource:
    """The first Debian archive this machine's apt is configured for (one-line or deb822)."""
    files = [etc / "sources.list", *sorted((etc / "sources.list.d").glob("*.list"))]
    for f in files:
        for line in f.read_text().splitlines() if f.is_file() else []:
            words = line.split("#", 1)[0].split()
            if words[:1] != ["deb"]:
                continue
            words = [w for w in words[1:] if not w.startswith("[")]
            if len(words) >= 3 and "security" not in words[1]:
                return AptSource(words[0], words[1], tuple(words[2:]))
    for f in sorted((etc / "sources.list.d").glob("*.sources")):
        for stanza in f.read_text().split("\n\n"):
            fields: dict[str, str] = {}
            for line in stanza.splitlines():
                if ":" in line and not line.startswith(("#", " ")):
                    k, v = line.split(":", 1)
                    fields[k.strip().lower()] = v.strip()
            if "deb" not in fields.get("types", "").split() or fields.get("enabled") == "no":
                continue
            suites = [s for s in fields.get("suites", "").split() if "security" not in s]
            uris = fields.get("uris", "").split()
            if suites and uris:
                comps = tuple(fields.get("components", "main").split())
                return AptSource(uris[0], suites[0], comps)
    raise InputError(
        f"no Debian archive in {etc}/sources.list*",
        "configure apt (a `deb URI SUITE main` line) so the rootfs can be built from it",
    )


def _digest(obj: object) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:16]


@dataclass(frozen=True)
class Recipe:
    source: AptSource
    packages: tuple[str, ...]

    @property
    def key(self) -> str:
        return _digest(
            {
                "v": RECIPE_VERSION,
                "uri": self.source.uri,
                "suite": self.source.suite,
                "components": self.source.components,
                "packages": sorted(self.packages),
                "keep_rules": KEEP_RULES,
                "trigger": TRIGGER_DROPIN,
                "masked": MASKED,
            }
        )


def base_dir(recipe: Recipe) -> Path:
    return CACHE / "rootfs" / recipe.key


def build_base(recipe: Recipe, runner: Runner, log: Log = quiet) -> Path:
    """The base rootfs for ``recipe`` (cached): returns its root directory."""
    final = base_dir(recipe)
    if is_published(final):
        return final / "root"
    if not runner.which("mmdebstrap"):
        raise InputError(
            "mmdebstrap is not installed", "apt-get install mmdebstrap (scripts/bootstrap.sh does)"
        )
    t0 = time.monotonic()
    log(f"rootfs: mmdebstrap {recipe.source.suite} from {recipe.source.uri} ({recipe.key})")
    with publish_dir(final) as tmp:
        root = tmp / "root"
        runner.run(
            [
                "mmdebstrap",
                "--quiet",
                "--variant=minbase",
                "--mode=root",
                "--format=directory",
                f"--components={','.join(recipe.source.components)}",
                f"--include={','.join(recipe.packages)}",
                recipe.source.suite,
                str(root),
                recipe.source.uri,
            ],
            timeout=1200,
        )
        _customize(root)
        (tmp / "recipe.json").write_text(
            json.dumps({"key": recipe.key, "packages": recipe.packages}, indent=2)
        )
        log(f"rootfs: built in {time.monotonic() - t0:.0f} s")
    return final / "root"


def _customize(root: Path) -> None:
    """The container-platform changes of the notes (udev rules, trigger, masks)."""
    rules = root / "etc/udev/rules.d"
    rules.mkdir(parents=True, exist_ok=True)
    for d in ("usr/lib/udev/rules.d", "lib/udev/rules.d"):
        src = root / d
        if src.is_dir() and not src.is_symlink():
            for r in src.glob("*.rules"):
                if r.name not in KEEP_RULES and not (rules / r.name).exists():
                    (rules / r.name).symlink_to("/dev/null")
    dropin = root / "etc/systemd/system/systemd-udev-trigger.service.d"
    dropin.mkdir(parents=True, exist_ok=True)
    (dropin / "linkctl-boot.conf").write_text(TRIGGER_DROPIN)
    for unit in MASKED:
        link = root / "etc/systemd/system" / unit
        if not link.exists() and not link.is_symlink():
            link.symlink_to("/dev/null")
    # No apt runs in the containers: the package lists only cost space.
    shutil.rmtree(root / "var/lib/apt/lists", ignore_errors=True)
    (root / "var/lib/apt/lists/partial").mkdir(parents=True, exist_ok=True)


def _dependencies(repo: Path) -> list[str]:
    return tomllib.loads((repo / "pyproject.toml").read_text())["project"]["dependencies"]


def wheels_dir(repo: Path = REPO_ROOT) -> Path:
    """Where the wheels of linkctl's dependencies are cached (for this Python)."""
    if not (repo / "pyproject.toml").is_file():
        raise InputError(f"no pyproject.toml in {repo}", "run the boot harness from a checkout")
    key = _digest({"deps": _dependencies(repo), "python": sys.version_info[:2]})
    return CACHE / "wheels" / key


def host_wheels(runner: Runner, repo: Path = REPO_ROOT, log: Log = quiet) -> Path:
    """Wheels of linkctl's dependencies, built on this host with its pip (cached)."""
    final = wheels_dir(repo)
    deps = _dependencies(repo)
    if is_published(final):
        return final
    log(f"wheels: pip wheel {len(deps)} dependencies")
    with publish_dir(final) as tmp:
        runner.run([sys.executable, "-m", "pip", "wheel", "-q", "-w", str(tmp), *deps], timeout=900)
    return final


def linkctl_wheel(runner: Runner, out: Path, repo: Path = REPO_ROOT) -> Path:
    """linkctl's own wheel, built from the checkout into ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    runner.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(out), str(repo)],
        timeout=300,
    )
    wheels = sorted(out.glob("linkctl-*.whl"))
    if not wheels:
        raise InputError(f"pip wheel made no linkctl wheel in {out}")
    return wheels[-1]


def in_chroot(runner: Runner, root: Path, argv: list[str], timeout: float = 600) -> Result:
    return runner.run(["chroot", str(root), *argv], timeout=timeout, env=CLEAN_ENV)


def build_deps(base: Path, wheels: Path, runner: Runner, log: Log = quiet) -> Path:
    """The layer above ``base`` holding /opt/linkctl, a venv with the dependencies (cached)."""
    wheel_files = sorted(p.name for p in wheels.glob("*.whl"))
    key = _digest({"base": str(base), "wheels": wheel_files})
    final = CACHE / "rootfs" / f"deps-{key}"
    if is_published(final):
        return final / "upper"
    log(f"rootfs: venv {VENV} with {len(wheel_files)} wheels, offline")
    with publish_dir(final) as tmp:
        for d in ("upper", "work", "merged"):
            (tmp / d).mkdir()
        merged = tmp / "merged"
        mount_overlay(runner, merged, [base], tmp / "upper", tmp / "work")
        try:
            dest = merged / "tmp/linkctl-wheels"
            shutil.copytree(wheels, dest)
            in_chroot(runner, merged, ["python3", "-m", "venv", VENV])
            in_chroot(
                runner,
                merged,
                [f"{VENV}/bin/pip", "install", "-q", "--no-index", "--no-cache-dir",
                 "--disable-pip-version-check", "--find-links", "/tmp/linkctl-wheels",
                 *_dependencies(REPO_ROOT)],
            )  # fmt: skip
            shutil.rmtree(dest)
        finally:
            umount(runner, merged)  # before the entry is published, or removed on failure
        shutil.rmtree(tmp / "work", ignore_errors=True)
        merged.rmdir()
    return final / "upper"


def mount_overlay(
    runner: Runner, target: Path, lowers: list[Path], upper: Path, work: Path
) -> None:
    """overlayfs; ``lowers`` top first."""
    opts = f"lowerdir={':'.join(map(str, lowers))},upperdir={upper},workdir={work}"
    runner.run(["mount", "-t", "overlay", "overlay", "-o", opts, str(target)])


def umount(runner: Runner, target: Path) -> None:
    if os.path.ismount(target):
        runner.run(["umount", str(target)], check=False)
        if os.path.ismount(target):
            runner.run(["umount", "-l", str(target)], check=False)


@dataclass
class Image:
    """The layers a container boots from, top first (linkctl's wheel is per container)."""

    layers: list[Path]
    wheel: Path

    def discard(self) -> None:
        """Remove the per-run wheel (the cached layers stay)."""
        shutil.rmtree(self.wheel.parent, ignore_errors=True)


@dataclass
class ImagePlan:
    """What prepare() would use or build (`lab boot --dry-run`)."""

    base: str  # the Debian rootfs (mmdebstrap), cached
    base_cached: bool
    wheels: str  # linkctl's dependencies as wheels, cached
    wheels_cached: bool
    work: str  # per run: linkctl's wheel and one directory per container, removed after


def recipe(network_manager: bool = False) -> Recipe:
    return Recipe(apt_source(), PACKAGES + (NM_PACKAGES if network_manager else ()))


def plan(*, network_manager: bool = False, work: Path = WORK) -> ImagePlan:
    base, wheels = base_dir(recipe(network_manager)), wheels_dir()
    return ImagePlan(str(base), is_published(base), str(wheels), is_published(wheels), str(work))


def prepare(
    runner: Runner | None = None,
    *,
    network_manager: bool = False,
    work: Path = WORK,
    log: Log = quiet,
) -> Image:
    """Everything a container needs before its first boot, cached where possible."""
    runner = runner or default_runner()
    base = build_base(recipe(network_manager), runner, log)
    deps = build_deps(base, host_wheels(runner, log=log), runner, log)
    work.mkdir(parents=True, exist_ok=True)
    wheel = linkctl_wheel(runner, Path(tempfile.mkdtemp(prefix="wheel-", dir=work)))
    return Image([deps, base], wheel)
