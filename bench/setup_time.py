#!/usr/bin/env python3
"""bench/setup_time: how long `linkctl setup` takes in the lab, next to iproute2.

Run as root from the repo:  .venv/bin/python bench/setup_time.py [--rounds 5]

Prints, per round and as medians:
  - apply: linkctl's own elapsed time for a setup that changes MTU, up, address
    (the peer end is already up, so carrier is there and the duplicate-address
    ARP probe runs, as on a real cable);
  - re-run: the idempotent second setup (zero changes), whole process wall time;
  - status: `linkctl status` on the configured link, whole process wall time;
  - the same three changes made with `ip link`/`ip addr` (reference), wall time;
  - `linkctl --help` wall time next to `python -c pass`.
Targets (issues 2 and 12): apply < 1 s, re-run and status < 0.5 s, --help < 0.3 s.
Each figure is a median with its spread (min-max) over the rounds; for the
process-wall rows the child's CPU time (user + sys) is printed too, since on a
shared machine wall time mostly measures the other jobs.

linkctl is measured as installed: pip byte-compiles a package when it installs it,
so the bench compiles the linkctl package first (an editable install run with
PYTHONDONTWRITEBYTECODE=1, as this machine's sessions set, would otherwise compile
every linkctl module from source on every run, ~40 ms of each process-wall row).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid

PY = sys.executable


CPU: dict[str, list[float]] = {}  # row -> child CPU seconds (user + sys) per round


def wall(
    argv: list[str], env: dict[str, str] | None = None, cpu: str | None = None
) -> tuple[float, str]:
    t0 = time.perf_counter()
    before = os.times()
    r = subprocess.run(argv, capture_output=True, text=True, env=env)
    dt = time.perf_counter() - t0
    after = os.times()
    if r.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} failed: {r.stderr.strip()}")
    if cpu:
        used = (after.children_user - before.children_user) + (
            after.children_system - before.children_system
        )
        CPU.setdefault(cpu, []).append(used)
    return dt, r.stdout


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    os.environ.setdefault("LINKCTL_STATE_DIR", tempfile.mkdtemp(prefix="linkctl-bench-"))
    import compileall

    import linkctl

    compileall.compile_dir(os.path.dirname(linkctl.__file__), quiet=1)
    from linkctl.core.profile import load_profile
    from linkctl.lab import netns

    prof, _ = load_profile("dgx-mac")
    apply_s, rerun_s, status_s, ip_s, help_s, pass_s = [], [], [], [], [], []
    for _ in range(args.rounds):
        name = "b" + uuid.uuid4().hex[:6]
        lb = netns.up(prof, name)
        try:
            mac, dgx = lb.host("mac"), lb.host("dgx")

            def run(host, *a, _lb=lb, cpu=None):
                argv, env = netns.exec_argv(_lb, host, ["linkctl", *a])
                return wall(argv, env, cpu)

            run("mac", "setup")  # the peer end is up first
            _, out = run("dgx", "setup", "--json")
            apply_s.append(json.loads(out)["elapsed_s"])
            dt, out = run("dgx", "setup", "--json", cpu="rerun")
            assert json.loads(out)["nothing_to_do"]
            rerun_s.append(dt)
            dt, out = run("dgx", "status", cpu="status")
            assert "none: link is as profiled" in out
            status_s.append(dt)
            # Reference: the same three changes on the mac end with iproute2, after teardown.
            run("mac", "teardown")
            ns = mac.netns
            t0 = time.perf_counter()
            for cmd in (
                ["link", "set", "en0", "mtu", "9000"],
                ["link", "set", "en0", "up"],
                ["addr", "add", mac.address, "dev", "en0"],
            ):
                subprocess.run(["ip", "-n", ns, *cmd], check=True)
            ip_s.append(time.perf_counter() - t0)
            del dgx
        finally:
            netns.down(name)
        help_s.append(wall([PY, "-m", "linkctl", "--help"], cpu="help")[0])
        pass_s.append(wall([PY, "-c", "pass"])[0])

    med = statistics.median
    rows = [
        (
            "setup apply (3 changes, ARP probe incl.)",
            apply_s,
            med(ip_s),
            "ip link/addr x3",
            1.0,
            "",
        ),
        ("setup re-run, 0 changes (process wall)", rerun_s, None, "", 0.5, "rerun"),
        ("status (process wall)", status_s, None, "", 0.5, "status"),
        ("linkctl --help (process wall)", help_s, med(pass_s), "python -c pass", 0.3, "help"),
    ]
    load = os.getloadavg()[0]
    print(
        f"rounds: {args.rounds}; medians (min-max); {os.cpu_count()} cores, load {load:.1f}; "
        "linkctl byte-compiled, as installed"
    )
    print(
        f"{'measure':42} {'linkctl':>9} {'spread':>13} {'cpu':>8} {'reference':>10} "
        f"{'ratio':>6} {'target':>8}"
    )
    for label, vals, ref, ref_name, target, cpu_key in rows:
        v = med(vals)
        spread = f"{min(vals) * 1000:.0f}-{max(vals) * 1000:.0f} ms"
        cpu = f"{med(CPU[cpu_key]) * 1000:5.0f} ms" if cpu_key else "       -"
        ratio = f"{v / ref:5.1f}x" if ref else "     -"
        refs = f"{ref * 1000:7.1f} ms" if ref else "         -"
        ok = "ok" if v < target else "MISSED"
        print(
            f"{label:42} {v * 1000:6.1f} ms {spread:>13} {cpu} {refs} {ratio} "
            f"<{target * 1000:.0f} ms {ok}" + (f"  (ref: {ref_name})" if ref_name else "")
        )


if __name__ == "__main__":
    main()
