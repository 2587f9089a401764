"""Boot the profile's hosts for real: systemd as PID 1 in containers on the lab's namespaces.

A minimal Debian rootfs (mmdebstrap from this machine's own apt sources) is built
once and cached by a hash of its recipe under /var/cache/linkctl/rootfs/; a second
cached layer holds a virtualenv with linkctl's dependencies, installed offline
from wheels built on this host. Each host is a container on an overlayfs of those
layers (plus linkctl's own wheel, built from the checkout), started with
systemd-nspawn from inside the host's lab namespace, so the container's only
links are the lab's: the link port named like the profile's interface and the
"wifi" port that holds the default route.

What makes a device unit (sys-subsystem-net-devices-IFACE.device) work in such a
container, and what keeps the host safe, was worked out on this machine and is
recorded in ../shared/notes/systemd-boot-in-nspawn.md:
- nspawn is started with `nsenter --net` inside the pre-made namespace (with an
  nspawn network option, or under `ip netns exec`, /sys shows the host's links or
  the cgroup mounts vanish);
- SYSTEMD_NSPAWN_API_VFS_WRITABLE=yes, else device units are "unsupported";
- CAP_NET_ADMIN, so udevd can broadcast its events;
- a fresh /run/udev holding an empty `control` file at every boot, every udev rule
  but 99-systemd.rules masked, and a trigger limited to net devices;
- the launcher in cgroup directories of its own, so parallel containers do not
  share nspawn's payload/supervisor cgroups.
Writable API filesystems would let the container's root write host-global
/proc/sys (its PID 1 raised the host's fs.file-max): /proc/sys is bound read-only
and the units that write kernel tunables are masked. Everything created (mounts,
cgroups, nspawn's propagate directory, the namespaces) is listed and removed at
the end, also after a failure or Ctrl-C.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import tomllib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from linkctl.core.errors import InputError
from linkctl.core.paths import is_published, publish_dir
from linkctl.core.runner import Result, Runner, default_runner

# The checkout the wheel is built from (the harness runs from a source tree).
REPO_ROOT = Path(__file__).resolve().parents[2]
CACHE = Path("/var/cache/linkctl")
WORK = Path("/var/tmp/linkctl-boot")
CGROUP_ROOTS = (Path("/sys/fs/cgroup/systemd"), Path("/sys/fs/cgroup/unified"))
PROPAGATE = Path("/run/systemd/nspawn/propagate")
VENV = "/opt/linkctl"  # linkctl inside the containers: /opt/linkctl/bin/linkctl
MODEL_DIR = "/srv/linkctl"  # the head's model, bound read-only
# What each container runs: systemd and udev (PID 1, device units), python3 + venv
# (linkctl), iproute2/iperf3/ping (setup, probe, responder), libgomp1 (llama.cpp's
# OpenMP build).
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
)
RECIPE_VERSION = 1
CLEAN_ENV = {
    "PATH": f"{VENV}/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "LANG": "C.UTF-8",
    "HOME": "/root",
    "TERM": "dumb",
}

Log = Callable[[str], None]


def _quiet(_msg: str) -> None:
    pass


# ---- the rootfs -------------------------------------------------------------------------


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


def build_base(recipe: Recipe, runner: Runner, log: Log = _quiet) -> Path:
    """The base rootfs for ``recipe`` (cached): returns its root directory."""
    final = CACHE / "rootfs" / recipe.key
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


def host_wheels(runner: Runner, repo: Path = REPO_ROOT, log: Log = _quiet) -> Path:
    """Wheels of linkctl's dependencies, built on this host with its pip (cached)."""
    if not (repo / "pyproject.toml").is_file():
        raise InputError(f"no pyproject.toml in {repo}", "run the boot harness from a checkout")
    deps = _dependencies(repo)
    key = _digest({"deps": deps, "python": sys.version_info[:2]})
    final = CACHE / "wheels" / key
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


def _in_chroot(runner: Runner, root: Path, argv: list[str], timeout: float = 600) -> Result:
    return runner.run(["chroot", str(root), *argv], timeout=timeout, env=CLEAN_ENV)


def build_deps(base: Path, wheels: Path, runner: Runner, log: Log = _quiet) -> Path:
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
            _in_chroot(runner, merged, ["python3", "-m", "venv", VENV])
            _in_chroot(
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


def mount_overlay(runner: Runner, target: Path, lowers: list[Path], upper: Path, work: Path):
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
    packages: tuple[str, ...]

    def discard(self) -> None:
        """Remove the per-run wheel (the cached layers stay)."""
        shutil.rmtree(self.wheel.parent, ignore_errors=True)


def prepare(
    runner: Runner | None = None,
    *,
    network_manager: bool = False,
    work: Path = WORK,
    log: Log = _quiet,
) -> Image:
    """Everything a container needs before its first boot, cached where possible."""
    runner = runner or default_runner()
    packages = PACKAGES + (NM_PACKAGES if network_manager else ())
    base = build_base(Recipe(apt_source(), packages), runner, log)
    deps = build_deps(base, host_wheels(runner, log=log), runner, log)
    import tempfile

    work.mkdir(parents=True, exist_ok=True)
    wheel = linkctl_wheel(runner, Path(tempfile.mkdtemp(prefix="wheel-", dir=work)))
    return Image([deps, base], wheel, packages)


# ---- containers ---------------------------------------------------------------------------


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
        _in_chroot(
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


# ---- host safety ---------------------------------------------------------------------------

# Counters and clocks that change on their own; everything else in /proc/sys must not.
_VOLATILE_SYSCTL = (
    "fs/dentry-state",
    "fs/file-nr",
    "fs/inode-nr",
    "fs/inode-state",
    "fs/quota/",
    "kernel/ns_last_pid",
    "kernel/random/",
    "kernel/pty/nr",
    "kernel/tainted",
    "net/netfilter/nf_conntrack_count",
    "fs/aio-nr",
    "fs/binfmt_misc/",
    "kernel/sched_domain/",
    "vm/stat_refresh",
    "kernel/sysctl_writes_strict",
    "fs/mqueue/",
)


def host_snapshot() -> dict[str, object]:
    """This machine's own state the containers must not touch: every readable sysctl
    (minus counters), the host namespace's links, addresses and routes, and the
    writable attributes of its network devices in /sys. (Named namespaces are not in
    it: other labs come and go; `leftovers` checks this lab's own.)"""

    def read(p: Path) -> str | None:
        try:
            return p.read_text(errors="replace").strip()
        except OSError:
            return None

    sysctl = {}
    for p in sorted(Path("/proc/sys").rglob("*")):
        rel = str(p.relative_to("/proc/sys"))
        if p.is_file() and os.access(p, os.R_OK) and not rel.startswith(_VOLATILE_SYSCTL):
            v = read(p)
            if v is not None:
                sysctl[rel] = v
    sysnet = {}
    for dev in sorted(Path("/sys/class/net").iterdir()):
        for attr in ("mtu", "flags", "address", "tx_queue_len", "operstate", "ifalias"):
            sysnet[f"{dev.name}/{attr}"] = read(dev / attr)

    def ip(*args: str) -> object:
        out = subprocess.run(["ip", "-j", *args], capture_output=True, text=True, check=True)
        return json.loads(out.stdout or "[]")

    links = [
        {k: link.get(k) for k in ("ifname", "mtu", "flags", "operstate", "address")}
        for link in ip("link", "show")
    ]
    return {
        "sysctl": sysctl,
        "sys_class_net": sysnet,
        "links": links,
        "addrs": ip("addr", "show"),
        "routes": ip("route", "show", "table", "all"),
    }


def snapshot_diff(before: dict, after: dict) -> list[str]:
    out = []
    for section in before.keys() | after.keys():
        a, b = before.get(section), after.get(section)
        if isinstance(a, dict) and isinstance(b, dict):
            for k in sorted(a.keys() | b.keys()):
                if a.get(k) != b.get(k):
                    out.append(f"{section} {k}: {a.get(k)!r} -> {b.get(k)!r}")
        elif a != b:
            out.append(f"{section} changed: {a!r} -> {b!r}"[:2000])
    return out


def leftovers(names: list[str], lab_name: str) -> list[str]:
    """What a boot lab could leave behind on this host, still there."""
    out = []
    for n in names:
        if (WORK / n).exists():
            out.append(str(WORK / n))
        if (PROPAGATE / n).exists():
            out.append(str(PROPAGATE / n))
        for r in CGROUP_ROOTS:
            if (r / f"linkctl-boot-{n}").exists():
                out.append(str(r / f"linkctl-boot-{n}"))
    mounts = Path("/proc/self/mounts").read_text()
    # Only this lab's: other boot labs (another test run) may be up at the same time.
    mine = tuple(f"{WORK / n}/" for n in names)
    out += [m for m in (line.split()[1] for line in mounts.splitlines()) if m.startswith(mine)]
    if os.path.isdir("/run/netns"):
        out += [
            f"netns {ns}" for ns in os.listdir("/run/netns") if ns.startswith(f"lk-{lab_name}-")
        ]
    return out


@contextlib.contextmanager
def cleanup_on_exit(fns: list[Callable[[], object]]) -> Iterator[None]:
    """Run ``fns`` in reverse order at the end of the block, whatever ends it (SIGTERM
    is turned into KeyboardInterrupt for the block's duration so it unwinds too)."""

    def on_term(signum: int, _frame: object) -> None:
        raise KeyboardInterrupt

    old = signal.signal(signal.SIGTERM, on_term)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        try:
            for fn in reversed(fns):
                with contextlib.suppress(Exception):
                    fn()
        finally:
            signal.signal(signal.SIGTERM, old)


# ---- a lab of booted hosts -----------------------------------------------------------------

COMPLETE = """
import json, sys, urllib.request
body = json.dumps({"prompt": sys.argv[2], "n_predict": int(sys.argv[3]), "temperature": 0,
                   "cache_prompt": False}).encode()
req = urllib.request.Request(sys.argv[1], body, {"Content-Type": "application/json"})
with urllib.request.urlopen(req, timeout=float(sys.argv[4])) as r:
    print(r.read().decode())
"""


def boot_profile_text(lab_profile_path: Path, model: str | None) -> str:
    """The lab's profile with every host running Linux (each is a Linux container; the
    Mac's role is played by one) and the head's model where the container binds it."""
    import tomli_w

    from linkctl.core.profile import parse_profile

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


def unit_props(c: Container, unit: str, *props: str) -> dict[str, str]:
    r = c.exec(["systemctl", "show", unit, "-p", ",".join(props)], check=False, timeout=30)
    return dict(line.split("=", 1) for line in r.stdout.splitlines() if "=" in line)


def completion(c: Container, port: int, prompt: str = "hello", n: int = 8) -> dict | None:
    """One completion through the llama-server in ``c`` (None when it does not answer)."""
    url = f"http://127.0.0.1:{port}/completion"
    try:
        r = c.exec(["python3", "-c", COMPLETE, url, prompt, str(n), "20"], check=False, timeout=40)
    except InputError:
        return None
    if not r.ok:
        return None
    try:
        return json.loads(r.stdout)
    except ValueError:
        return None


def wait_for(pred: Callable[[], object], timeout: float, what: str, step: float = 0.25) -> float:
    """Poll ``pred`` until truthy; returns the seconds it took (InputError after timeout)."""
    t0 = time.monotonic()
    while True:
        if pred():
            return time.monotonic() - t0
        if time.monotonic() - t0 > timeout:
            raise InputError(f"{what}: not within {timeout:g} s")
        time.sleep(step)


@dataclass
class BootLab:
    """The profile's hosts as booted containers on a lab (`linkctl lab up`) of their own.

    Use as a context manager: everything is removed at the end, whatever ends it."""

    profile: object  # linkctl.core.profile.Profile
    name: str
    image: Image
    llama: Path | None = None  # llama.cpp version directory, bound read-only
    model: Path | None = None  # the head's GGUF, its directory bound read-only at MODEL_DIR
    runner: Runner = field(default_factory=default_runner)
    log: Log = _quiet
    containers: dict[str, Container] = field(default_factory=dict)
    lab: object = None
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
        from linkctl.lab import netns as labmod

        profile = self.profile
        self._undo.append(lambda: labmod.down(self.name))
        self.lab = labmod.up(profile, self.name)
        text = boot_profile_text(
            Path(self.lab.profile_path),
            f"{MODEL_DIR}/{self.model.name}" if self.model else None,
        )
        self.profile_in_container = f"/root/{profile.name}-lab.toml"
        for h in self.lab.hosts:
            binds = []
            if self.llama:
                binds.append(Bind(str(self.llama), str(self.llama)))
            if self.model and profile.host(h.name).role == "head":
                binds.append(Bind(str(self.model.parent), MODEL_DIR))
            c = Container(f"{self.name}-{h.name}", h.netns, self.image, binds, runner=self.runner)
            self._undo.append(c.destroy)
            c.create()
            (c.root / self.profile_in_container.lstrip("/")).write_text(text)
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
        from linkctl.lab import netns as labmod

        t0 = time.monotonic()
        names = which or list(self.containers)
        for n in names:
            labmod.reset_port(self.lab, n)
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

    def power_cut_all(self, which: list[str] | None = None) -> None:
        for n in which or list(self.containers):
            self.containers[n].power_cut()

    def container_names(self) -> list[str]:
        return [c.name for c in self.containers.values()]

    def head(self) -> Container:
        return self.containers[self.profile.head.name]

    def answers(self) -> dict | None:
        """A completion through the head's llama-server (None when the pair does not answer)."""
        return completion(self.head(), self.profile.serve.port)
