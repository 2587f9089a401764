"""The boot harness's test side: what tests/test_boot.py checks a booted lab with.

Host-safety snapshots (this machine's sysctls, links and routes, before and after),
what a lab left behind, systemd unit properties, completions through the head,
and the faults the tests inject (a pulled cable, a power cut).
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

from linkctl.core.errors import InputError
from linkctl.lab import netns
from linkctl.lab.boot import BootLab
from linkctl.lab.container import CGROUP_ROOTS, PROPAGATE, Container
from linkctl.lab.rootfs import WORK

# ---- host safety ---------------------------------------------------------------------

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


# ---- faults --------------------------------------------------------------------------


def unplug(lab: netns.Lab) -> None:
    """Pull every link cable: delete each host's link port (its veth peer goes with it)."""
    from pyroute2 import IPRoute

    for h in lab.hosts:
        with IPRoute(netns=h.netns) as ipr:
            idx = ipr.link_lookup(ifname=h.interface)
            if idx:
                ipr.link("del", index=idx[0])


def plug(lab: netns.Lab) -> None:
    """Plug the cables back in: fresh ports, down at MTU 1500, like `lab up` made them."""
    netns.wire_link(lab)


def power_cut_all(bl: BootLab, which: list[str] | None = None) -> None:
    for n in which or list(bl.containers):
        bl.containers[n].power_cut()


# ---- reading a booted lab ------------------------------------------------------------


def container_names(bl: BootLab) -> list[str]:
    return [c.name for c in bl.containers.values()]


COMPLETE = """
import json, sys, urllib.request
body = json.dumps({"prompt": sys.argv[2], "n_predict": int(sys.argv[3]), "temperature": 0,
                   "cache_prompt": False}).encode()
req = urllib.request.Request(sys.argv[1], body, {"Content-Type": "application/json"})
with urllib.request.urlopen(req, timeout=float(sys.argv[4])) as r:
    print(r.read().decode())
"""


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
    """Poll ``pred`` until truthy; returns the seconds it took (AssertionError after
    ``timeout``)."""
    t0 = time.monotonic()
    while True:
        if pred():
            return time.monotonic() - t0
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"{what}: not within {timeout:g} s")
        time.sleep(step)


def answers(bl: BootLab) -> dict | None:
    """A completion through the head's llama-server (None when the pair does not answer)."""
    return completion(bl.containers[bl.profile.head.name], bl.profile.serve.port)


# ---- a booted host's own state -------------------------------------------------------

# Inside a container: every file and directory under ROOTS (type, mode, owner, and a
# file's hash or a link's target), as JSON. What changes by itself between two reads
# on an idle booted Debian is left out (each named with why): the journal and logs,
# systemd's own timer stamps, random seed and credentials, and ldconfig's cache. A
# serving supervisor's status (serve/<role>.json) is hashed without its "watch" and
# "rpc_ends": the watch rewrites its reading every interval (checked_at, figures) while
# nothing changes, and the head's health poll adds the end llama-server connected from
# about half a second after ready, which `up` may return before; a restart still shows
# (pid, child_pid, starts, events).
TREE = r"""
import hashlib, json, os, re, stat, sys
roots, skip = sys.argv[1].split(","), tuple(sys.argv[2].split(","))
status = re.compile(r".*/serve/(rpc|head|prefill|route)[.]json$")
out = {}
for root in roots:
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if not os.path.join(dirpath, d).startswith(skip)]
        for name in [*dirnames, *filenames]:
            p = os.path.join(dirpath, name)
            if p.startswith(skip):
                continue
            st = os.lstat(p)
            e = [stat.S_IFMT(st.st_mode), stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid]
            if stat.S_ISLNK(st.st_mode):
                e.append(os.readlink(p))
            elif stat.S_ISREG(st.st_mode):
                with open(p, "rb") as f:
                    data = f.read()
                if status.match(p):
                    record = json.loads(data)
                    record.pop("watch", None)
                    record.pop("rpc_ends", None)
                    data = json.dumps(record, sort_keys=True).encode()
                e.append(hashlib.sha256(data).hexdigest())
            out[p] = e
print(json.dumps(out))
"""
STATE_ROOTS = ("/etc", "/var/lib", "/var/cache", "/run/systemd/system", "/run/linkctl", "/srv")
STATE_SKIP = (
    "/var/lib/systemd/timers",  # timer stamps
    "/var/lib/systemd/random-seed",  # rewritten at boot and shutdown
    "/var/lib/systemd/credential.secret",
    "/var/lib/systemd/catalog",
    "/var/lib/systemd/coredump",
    "/var/cache/ldconfig",
    "/var/lib/dhcp",
)


def settled(c: Container, timeout: float = 30.0) -> None:
    """Until the host's IPv6 addresses left duplicate address detection ("tentative"
    for about a second after a port comes up): a state read before would differ from
    any read after for that reason alone."""
    wait_for(
        lambda: not c.exec(["ip", "-6", "addr", "show", "tentative"], timeout=30).stdout.strip(),
        timeout,
        f"{c.name}: IPv6 duplicate address detection",
    )


def host_state(c: Container) -> dict[str, object]:
    """A booted host as `linkctl down` must leave it: the files under STATE_ROOTS, the
    links, addresses and routes of its namespace, linkctl's units (loaded or as files)
    and the processes linkctl starts."""
    tree = c.exec(["python3", "-c", TREE, ",".join(STATE_ROOTS), ",".join(STATE_SKIP)], timeout=120)

    def ip(*args: str) -> object:
        return json.loads(c.exec(["ip", "-j", *args], timeout=30).stdout or "[]")

    links = [
        {k: link.get(k) for k in ("ifname", "mtu", "flags", "operstate", "address")}
        for link in ip("link", "show")
    ]
    units = c.exec(
        ["systemctl", "list-units", "--all", "--no-legend", "--plain", "linkctl*"], timeout=30
    ).stdout.split("\n")
    unit_files = c.exec(
        ["systemctl", "list-unit-files", "--no-legend", "linkctl*"], check=False, timeout=30
    ).stdout.split("\n")
    procs = c.exec(["python3", "-c", PROCS], timeout=30).stdout.split()
    # The kernel attaches a port's default qdisc the first time it goes up (noop ->
    # noqueue on a veth) and keeps it: nothing linkctl sets, nor could put back.
    addrs = [{k: v for k, v in a.items() if k != "qdisc"} for a in ip("addr", "show")]
    return {
        "files": json.loads(tree.stdout),
        "links": links,
        "addrs": addrs,
        "routes": ip("route", "show", "table", "all"),
        "units": sorted(u for u in units if u.strip()),
        "unit_files": sorted(u for u in unit_files if u.strip()),
        "processes": sorted(procs),
    }


# The processes linkctl runs or starts, by name (comm), wherever they are.
PROCS = r"""
import os
names = ("linkctl", "ggml-rpc-server", "llama-server", "iperf3")
for p in os.listdir("/proc"):
    if p.isdigit():
        try:
            comm = open(f"/proc/{p}/comm").read().strip()
        except OSError:
            continue
        if comm in names or comm.startswith("linkctl"):
            print(comm)
"""
