"""`linkctl up --dry-run` / `down --dry-run` as the CLI runs them, inside a lab host's
namespace: the plan of every stage, and nothing written anywhere (the state directory
stays empty, no unit or profile appears under /etc)."""

from __future__ import annotations

import json
from pathlib import Path

from support.lab import LabHandle

SYSTEM = [Path("/etc/linkctl"), *Path("/etc/systemd/system").glob("linkctl*")]


def tree(d: Path) -> list[str]:
    return sorted(str(p.relative_to(d)) for p in d.rglob("*")) if d.exists() else []


def test_up_and_down_dry_run_write_nothing(lab: LabHandle):
    # `lab exec` gives the host its own state directory (LINKCTL_STATE_DIR).
    state = lab.state / "lab" / lab.name / "hosts" / "dgx"
    state_before = tree(state)
    etc_before = [p for p in SYSTEM if p.exists()]
    r = lab.run("dgx", "up", "--profile", lab.profile_path, "--dry-run", "--json")
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout)
    assert res["dry_run"] and res["profile_path"] == lab.profile_path
    stages = {s["name"]: s for s in res["stages"]}
    assert list(stages) == ["link", "calibration", "services", "peer", "serve"]
    assert stages["link"]["detail"].startswith("would apply: ")
    assert "linkctl-serve.service" in stages["services"]["detail"]
    assert "enable --now --no-block" in stages["services"]["detail"]
    assert res["summary"].startswith("up --dry-run: nothing changed; once up: serving: ")
    r = lab.run("dgx", "down", "--profile", lab.profile_path, "--dry-run")
    assert r.returncode == 0, r.stderr
    assert "nothing of linkctl is up" in r.stdout or "down --dry-run" in r.stdout
    assert tree(state) == state_before
    assert [p for p in SYSTEM if p.exists()] == etc_before


def test_up_no_boot_dry_run_uses_runtime_units(lab: LabHandle):
    r = lab.run("dgx", "up", "--profile", lab.profile_path, "--no-boot", "--dry-run", "--json")
    assert r.returncode == 0, r.stderr
    detail = {s["name"]: s for s in json.loads(r.stdout)["stages"]}["services"]["detail"]
    assert "/run/systemd/system/linkctl-serve.service" in detail
    assert "systemctl start --no-block" in detail and "enable" not in detail
