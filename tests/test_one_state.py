"""One state, whoever runs the command: `probe` as root (with a hardened umask 077) and
then `estimate`, `doctor` and `serve --dry-run` as an unprivileged user all read the same
probe report. In the lab, with root and the user pointed at one state directory made as
/var/lib/linkctl is (root's, 0755), never the real one."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from linkctl.core.records import load_probe
from linkctl.trust import secret
from support.cli import linkctl, linkctl_as_nobody, need_tool
from support.lab import responder
from support.llama_util import need_llama
from support.service_kit import tree

pytestmark = [pytest.mark.netns, pytest.mark.llama]


def mode(p: Path) -> int:
    return stat.S_IMODE(p.stat().st_mode)


def test_probe_as_root_then_estimate_doctor_and_serve_as_a_user_read_one_report(lab, system_state):
    need_llama()
    need_tool("iperf3")
    for h in ("dgx", "mac"):
        assert lab.run(h, "setup").returncode == 0
    # What the user reads beside the state: the profile and the model, 0644 in a 0755 dir.
    conf = Path(tempfile.mkdtemp(prefix="linkctl-conf-"))
    try:
        os.chmod(conf, 0o755)
        profile = conf / "lab.toml"
        shutil.copy(lab.profile_path, profile)
        model = json.loads(linkctl("model", "write-tiny", str(conf / "tiny.gguf"), "--json").stdout)
        env = {
            **os.environ,
            "LINKCTL_STATE_DIR": str(system_state),
            "LINKCTL_PROFILE": str(profile),
            "LINKCTL_HOST": "mac",
        }
        netns = lab.netns("mac")
        # mac's copy of the pair secret, in the one state (as `linkctl pair` leaves it).
        mac_state = Path(lab.info["root"]) / "hosts" / "mac"
        key = secret.load("dgx-mac-lab", mac_state).key
        secret.store("dgx-mac-lab", key, system_state)

        with responder(lab, "dgx"):
            umask_077 = ["sh", "-c", 'umask 077 && exec "$@"', "sh"]
            cli = [sys.executable, "-m", "linkctl", "probe", "--peer", "dgx", "--json"]
            r = subprocess.run(
                ["ip", "netns", "exec", netns, *umask_077, *cli],
                capture_output=True,
                text=True,
                timeout=120,
                env=env,
            )
        assert r.returncode == 0, r.stdout + r.stderr
        probe_dir = system_state / "probe"
        report = probe_dir / "dgx-mac-lab--mac--dgx.json"
        latest = probe_dir / "latest.json"
        # Root's umask does not hide the records from users.
        assert mode(system_state) == mode(probe_dir) == 0o755
        assert mode(report) == mode(latest) == 0o644
        rec = load_probe(latest)
        rtt, _ = rec.latency.smallest() or (None, None)
        gbps, _ = rec.first_throughput() or (None, None)
        assert rtt and gbps

        state = tree(system_state)
        r = linkctl_as_nobody("estimate", "--model", model["path"], "--json", env=env, netns=netns)
        assert r.returncode == 0, r.stderr
        link = json.loads(r.stdout)["link"]
        assert (link["rtt_us"], link["throughput_gbps"]) == (rtt, gbps)
        assert f"from {latest} " in link["source"], link

        r = linkctl_as_nobody("doctor", "--json", "--peer-timeout", "1", env=env, netns=netns)
        assert r.returncode in (0, 1), r.stderr
        by = {c["check"]: c for c in json.loads(r.stdout)["checks"]}
        assert by["probe report"]["verdict"] == "PASS", by["probe report"]
        assert f"probe report {report.name} for dgx: ok" in by["probe report"]["detail"]
        assert by["peer dgx"]["verdict"] == "WARN"  # its ARP check alone needs root

        args = ["serve", "--dry-run", "--json", "--model", model["path"], "--split", "recommended"]
        r = linkctl_as_nobody(*args, env=env, netns=netns)
        assert r.returncode == 0, r.stderr
        split = json.loads(r.stdout)["split"]
        assert split["mode"] == "recommended" and link["source"] in split["estimate_source"]

        # The user read, and wrote nothing (doctor's RPC protocol cache included).
        assert tree(system_state) == state
    finally:
        shutil.rmtree(conf, ignore_errors=True)
