"""What the lab benches share: linkctl and commands run inside a lab host, children
stopped by their own process group, waits on ports, timed completions, and a CPU
limit for one host's processes (a cgroup the bench creates and removes).

Imported by bench/decode.py, disagg.py, estimate_accuracy.py and split_gain.py (run as scripts:
their directory is on sys.path).
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

PY = sys.executable

# Runs inside a namespace: timed /completion requests against llama-server on 127.0.0.1.
COMPLETE = r"""
import json, sys, urllib.request
port, n, runs = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
prompt = sys.argv[4]
def post(n_predict):
    body = json.dumps({"prompt": prompt, "n_predict": n_predict, "ignore_eos": True,
                       "temperature": 0, "cache_prompt": False, "seed": 0}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/completion", body,
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        d = json.loads(r.read())
        return d["timings"] | {"tokens_predicted": d.get("tokens_predicted")}
out = [post(n) for _ in range(runs)]
print(json.dumps(out))
"""

HEALTH = r"""
import sys, time, urllib.request
port, deadline = int(sys.argv[1]), time.monotonic() + float(sys.argv[2])
while time.monotonic() < deadline:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
            if r.status == 200:
                sys.exit(0)
    except Exception:
        pass
    time.sleep(0.2)
sys.exit(1)
"""

RTT = r"""
import sys
from linkctl.llama.rpc import round_trip_us
print(round_trip_us(sys.argv[1], int(sys.argv[2]), 200))
"""

PROMPT = "the link between two machines carries activations for every token " * 2


def start(prefix: str, why_root: str):
    """What every lab bench checks and makes first: root, the llama.cpp binaries, a
    unique lab name, a work directory and the state directory (LINKCTL_STATE_DIR
    unless already set). Returns (name, work, state, bins)."""
    import tempfile

    from linkctl.llama.bins import find_bins

    if os.geteuid() != 0:
        raise SystemExit(f"needs root ({why_root})")
    bins = find_bins(versions=False)
    if not (bins.rpc_server and bins.llama_server):
        raise SystemExit("llama.cpp binaries not found: run scripts/build-llama.sh")
    name = prefix[:2] + uuid.uuid4().hex[:6]
    work = Path(tempfile.mkdtemp(prefix=f"{prefix}-"))
    state = Path(os.environ.setdefault("LINKCTL_STATE_DIR", str(work / "state")))
    return name, work, state, bins


def run(argv: list[str], timeout: float = 600, check: bool = True, env=None) -> str:
    r = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=env)
    if check and r.returncode != 0:
        raise SystemExit(f"failed: {' '.join(argv)}\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}")
    return r.stdout


def linkctl(*args: str, timeout: float = 600) -> str:
    return run([PY, "-m", "linkctl", *args], timeout=timeout)


def ns_argv(lab: str, host: str, argv: list[str], limit: CpuLimit | None = None) -> list[str]:
    """`linkctl lab exec` argv; inside ``limit``'s cgroup when given. The group is
    joined outside the namespace: `ip netns exec` mounts its own /sys, without the
    cgroup tree."""
    out = [PY, "-m", "linkctl", "lab", "exec", host, "--name", lab, "--", *argv]
    return limit.wrap(out) if limit else out


def in_ns(
    lab: str, host: str, *argv: str, timeout: float = 600, limit: CpuLimit | None = None
) -> str:
    return run(ns_argv(lab, host, list(argv), limit), timeout=timeout)


def in_ns_rpc_limited(
    lab: str,
    host: str,
    *argv: str,
    timeout: float,
    limit: CpuLimit | None,
    exe: str,
    outer: CpuLimit | None = None,
) -> tuple[str, list[int]]:
    """`in_ns` with only the processes named ``exe`` (the rpc-server) that the command
    starts inside ``limit``'s group; the rest of the command in ``outer``'s, if given."""
    if limit is None:
        return in_ns(lab, host, *argv, timeout=timeout, limit=outer), []
    p = subprocess.Popen(
        ns_argv(lab, host, list(argv), outer),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    stop, moved = threading.Event(), []
    t = threading.Thread(target=limit.adopt, args=(p.pid, exe, stop, moved))
    t.start()
    try:
        out, err = p.communicate(timeout=timeout)
    finally:
        stop.set()
        t.join()
    if p.returncode != 0:
        raise SystemExit(f"failed: {' '.join(argv)}\n{out[-2000:]}\n{err[-2000:]}")
    return out, moved


def complete(lab: str, host: str, port: int, n: int, runs: int) -> list[dict]:
    return json.loads(in_ns(lab, host, PY, "-c", COMPLETE, str(port), str(n), str(runs), PROMPT))


class Proc:
    """A child in a namespace, stopped by its own process group."""

    def __init__(
        self, lab: str, host: str, argv: list[str], log: Path, limit: CpuLimit | None = None
    ):
        self.log = log
        self.f = log.open("w")
        self.p = subprocess.Popen(
            ns_argv(lab, host, argv, limit),
            stdout=self.f,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def stop(self) -> None:
        if self.p.poll() is None:
            os.killpg(self.p.pid, 15)
            try:
                self.p.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.p.pid, 9)
                self.p.wait(5)
        self.f.close()

    def text(self) -> str:
        if not self.f.closed:
            self.f.flush()
        return self.log.read_text(errors="replace")


def wait_port(lab: str, host: str, addr: str, port: int, timeout: float = 30) -> None:
    code = (
        "import socket,sys,time\nd=time.monotonic()+float(sys.argv[3])\n"
        "while time.monotonic()<d:\n s=socket.socket()\n s.settimeout(0.5)\n"
        " if s.connect_ex((sys.argv[1],int(sys.argv[2])))==0: sys.exit(0)\n"
        " s.close(); time.sleep(0.1)\nsys.exit(1)"
    )
    in_ns(lab, host, PY, "-c", code, addr, str(port), str(timeout), timeout=timeout + 10)


def wait_status(path: Path, proc: Proc, timeout: float, what: str, state: str = "ready") -> dict:
    """Until `linkctl serve`'s status file (linkctl.core.records: records.status_path(role,
    root=host state dir); route's is a RouteStatus, the rest ServeStatus) says ``state``
    (or the process ends); the status as a dict."""
    from linkctl.core.errors import InputError
    from linkctl.core.records import load_route_status, load_status

    load = load_route_status if path.name == "route.json" else load_status
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(InputError):  # not there yet, or caught mid-write
            st = load(path)
            if st.state == state:
                return st.model_dump()
        if proc.p.poll() is not None:
            break
        time.sleep(0.2)
    raise SystemExit(f"{what} not ready after {timeout:.0f} s; log:\n{proc.text()[-3000:]}")


class CpuLimit:
    """A CPU quota, weight and/or set of CPUs for the processes a bench puts in it: a
    child cgroup created here and removed on close. cgroup v2 ``cpu.max``/``cpu.weight``
    when the unified hierarchy has the cpu controller, else the v1 cpu controller's CFS
    quota and ``cpu.shares`` (on this machine cgroup2 at /sys/fs/cgroup/unified has no
    controllers: cpu is bound to v1). The CPUs are a scheduler affinity (taskset /
    sched_setaffinity, inherited by children and threads), not a cpuset group. Nothing
    else of the machine's cgroups is touched."""

    V2 = Path("/sys/fs/cgroup/unified")
    V2_ALT = Path("/sys/fs/cgroup")
    V1 = Path("/sys/fs/cgroup/cpu")

    def __init__(
        self, fraction: float | None = None, *, weight: int = 1, cpus: set[int] | None = None
    ):
        # A quota caps the group's CPU share per period; a host that idles between its
        # bursts (waiting for the other host's layers) would never reach a long period's
        # cap. With the kernel's smallest quota (1 ms) and a period of quota / fraction,
        # every burst longer than a few ms is slowed by ~1/fraction: a slower device.
        # ``weight``: the group's share against other groups when a CPU is contended, in
        # multiples of the default (v1 cpu.shares 1024, v2 cpu.weight 100), so the other
        # jobs on a shared machine move a lab host's speed less.
        if fraction is not None and not 0.05 <= fraction <= 1:
            raise SystemExit(f"cpu fraction {fraction}: give 0.05..1")
        if not 1 <= weight <= 64:
            raise SystemExit(f"cpu weight {weight}: give 1..64")
        if cpus is not None and not cpus <= os.sched_getaffinity(0):
            raise SystemExit(
                f"cpus {sorted(cpus)}: this machine has {sorted(os.sched_getaffinity(0))}"
            )
        quota = 1000
        period_us = int(quota / fraction) if fraction else 0
        self.fraction, self.period_us, self.weight, self.cpus = fraction, period_us, weight, cpus
        name = "linkctl-bench-" + uuid.uuid4().hex[:8]
        for root in (self.V2, self.V2_ALT):
            ctl = root / "cgroup.controllers"
            sub = root / "cgroup.subtree_control"
            if ctl.is_file() and "cpu" in ctl.read_text().split():
                if "cpu" not in sub.read_text().split():
                    continue  # enabling it would change the machine's own hierarchy
                self.path = root / name
                self.path.mkdir()
                if fraction:
                    (self.path / "cpu.max").write_text(f"{quota} {period_us}\n")
                (self.path / "cpu.weight").write_text(f"{100 * weight}\n")
                self.kind = f"cgroup v2 {self.path} cpu.max {quota} {period_us or 'max'}"
                break
        else:
            if not (self.V1 / "cpu.cfs_quota_us").is_file():
                raise SystemExit("no cgroup cpu controller (v2 cpu.max or v1 cpu) to limit with")
            self.path = self.V1 / name
            self.path.mkdir()
            if fraction:
                (self.path / "cpu.cfs_period_us").write_text(f"{period_us}\n")
                (self.path / "cpu.cfs_quota_us").write_text(f"{quota}\n")
            (self.path / "cpu.shares").write_text(f"{1024 * weight}\n")
            self.kind = f"cgroup v1 {self.path} cfs_quota_us {quota if fraction else -1}"
            self.kind += f" / cfs_period_us {period_us}" if fraction else ""
        self.kind += f", weight x{weight}" + (f", cpus {sorted(cpus)}" if cpus else "")

    def pids(self) -> list[int]:
        return [int(x) for x in (self.path / "cgroup.procs").read_text().split()]

    def throttled(self) -> dict[str, int]:
        """cpu.stat counters (nr_periods, nr_throttled, throttled time)."""
        out = {}
        for line in (self.path / "cpu.stat").read_text().splitlines():
            k, _, v = line.partition(" ")
            if v.isdigit():
                out[k] = int(v)
        return out

    def adopt(self, root_pid: int, exe: str, stop: threading.Event, moved: list[int]) -> None:
        """Until ``stop``: every process named ``exe`` below ``root_pid`` joins this group
        (polled every 10 ms; the pids moved go to ``moved``). For `calibrate --rpc`: only
        its rpc-server is quota'd, as under `serve`, while the llama-server that drives it
        (the head's work: sampling, HTTP) runs outside, as the real head does. After the
        first move, polled every 1 s: one scan of /proc costs ~2 ms of CPU, so every
        10 ms it took ~15 % of a core from the calibration it watches."""
        procs = self.path / "cgroup.procs"
        while not stop.wait(1.0 if moved else 0.01):
            kids: dict[int, list[int]] = {}
            names: dict[int, str] = {}
            for d in Path("/proc").iterdir():
                if not d.name.isdigit():
                    continue
                with contextlib.suppress(OSError, ValueError, IndexError):
                    stat = (d / "stat").read_text()
                    names[int(d.name)] = stat[stat.index("(") + 1 : stat.rindex(")")]
                    ppid = int(stat[stat.rindex(")") + 2 :].split()[1])
                    kids.setdefault(ppid, []).append(int(d.name))
            todo = [root_pid]
            while todo:
                pid = todo.pop()
                for k in kids.get(pid, []):
                    todo.append(k)
                    if names.get(k, "")[:15] == exe[:15] and k not in moved:
                        with contextlib.suppress(OSError):
                            procs.write_text(f"{k}\n")
                            self.pin(k)
                            moved.append(k)

    def pin(self, pid: int) -> None:
        """Every thread of ``pid`` onto this group's CPUs (threads started later inherit)."""
        if self.cpus:
            for t in Path(f"/proc/{pid}/task").iterdir():
                with contextlib.suppress(OSError):
                    os.sched_setaffinity(int(t.name), self.cpus)

    def wrap(self, argv: list[str]) -> list[str]:
        """argv run inside this group (the shell joins it, then execs argv), on its CPUs."""
        procs = self.path / "cgroup.procs"
        pin = f"taskset -c {','.join(map(str, sorted(self.cpus)))} " if self.cpus else ""
        return ["sh", "-c", f'echo $$ > {procs} && exec {pin}"$@"', "sh", *argv]

    def close(self) -> None:
        if not self.path.exists():
            return
        # Move stragglers back to the root group, then remove ours.
        root = self.path.parent / "cgroup.procs"
        for _ in range(50):
            pids = (self.path / "cgroup.procs").read_text().split()
            for pid in pids:
                with contextlib.suppress(OSError):
                    root.write_text(pid + "\n")
            try:
                self.path.rmdir()
                return
            except OSError:
                time.sleep(0.1)
