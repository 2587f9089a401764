"""Every command that takes --profile says first, on stderr, which profile it uses, the
file it came from and (when it acts as one) this host; its --json names that file as
profile_path. The commands are found by walking the CLI, so a new one must be run here
or named in NOT_RUN with the reason. Run in a lab: the real commands, read-only or dry
runs where they change the machine."""

from __future__ import annotations

import json
import uuid

import pytest

from support.cli import linkctl, need_tool
from support.lab import read_line, responder
from support.llama_util import need_llama
from support.service_kit import LINKCTL, LLAMA, make_target

pytestmark = [pytest.mark.netns, pytest.mark.llama]

NOT_RUN = {
    "lab demo": "the whole path, minutes long (tests/lab/test_demo.py); says it through "
    "commands.common.load as lab up does",
    "lab boot": "containers with systemd as PID 1 (tests/service); commands.common.load as lab up",
}


def profile_commands() -> set[str]:
    """Every command (by its words) with a --profile option."""
    import typer

    from linkctl.cli import app

    out = set()

    def walk(cmd, words: list[str]) -> None:
        for name, sub in getattr(cmd, "commands", {}).items():
            walk(sub, [*words, name])
        if any("--profile" in p.opts for p in cmd.params):
            out.add(" ".join(words))

    walk(typer.main.get_command(app), [])
    return out


def test_every_profile_command_names_the_profile_file_first(make_lab, tmp_path):
    need_llama()
    need_tool("iperf3")
    lab = make_lab("dgx-mac")
    path = lab.profile_path
    said: dict[str, str] = {}  # command -> its first stderr line

    def line(host: str | None) -> str:
        return f"linkctl: profile dgx-mac-lab from {path}" + (f", host {host}" if host else "")

    def run(words: str, host: str, *args: str, said_host: str | None = None) -> dict:
        """`linkctl WORDS --profile PATH --json ARGS` on host; its JSON output."""
        r = lab.run(host, *words.split(), "--profile", path, "--json", *args, timeout=180)
        assert r.returncode in (0, 1), (words, r.stdout, r.stderr)
        said[words] = (r.stderr.splitlines() or ["(nothing on stderr)"])[0]
        assert said[words] == line(said_host), (words, r.stderr)
        out = json.loads(r.stdout)
        if isinstance(out, list):  # probe --json: one report per peer, each naming it
            assert all(o["profile_path"] == path for o in out), words
            out = out[0]
        assert out["profile_path"] == path, words
        return out

    for h in ("dgx", "mac"):
        run("setup", h, said_host=h)
    run("status", "mac", said_host="mac")
    run("teardown", "mac", "--dry-run", said_host="mac")
    with responder(lab, "dgx") as (proc, ready):
        assert ready["profile_path"] == path
        said["responder"] = read_line(proc.stderr, 10).rstrip("\n")
        assert said["responder"] == line("dgx")
        probed = run("probe", "mac", "--peer", "dgx", "--no-throughput", said_host="mac")
    assert probed["peer"] == "dgx"

    model = linkctl("model", "write-tiny", str(tmp_path / "tiny.gguf"), "--json")
    m = json.loads(model.stdout)["path"]
    run("estimate", "mac", "--model", m, "--rtt-us", "50", "--throughput-gbps", "5")
    run("calibrate", "mac", "--dry-run", "--model", m)
    run("serve", "mac", "--dry-run", "--model", m, "--split", "llama", said_host="mac")
    run("serve", "dgx", "--dry-run", said_host="dgx")
    run("verify", "mac", "--dry-run", "--model", m, said_host="mac")
    run("route", "mac", "--dry-run", "--model", m, said_host="mac")
    run("kv-agent", "dgx", "--dry-run", said_host="dgx")
    run("model sync", "mac", "--dry-run", "--model", m, said_host="mac")
    run("doctor", "mac", "--peer-timeout", "1", said_host="mac")
    run("llama find", "mac", "--host", "mac", "--no-protocol")
    shown = run("key show", "mac")
    run("key new", "mac", "--dry-run", "--force")
    r = lab.exec("mac", "linkctl", "key", "set", "--profile", path, "--json", "--dry-run",
                 input=bytes(32).hex() + "\n")  # fmt: skip
    said["key set"] = r.stderr.splitlines()[0]
    assert r.returncode == 0 and said["key set"] == line(None), r.stderr
    assert json.loads(r.stdout)["profile_path"] == path and shown["fingerprint"]
    image = ["--root", str(make_target(tmp_path / "image")), "--linkctl-bin", LINKCTL]
    run("up", "dgx", "--dry-run", said_host="dgx")
    run("down", "dgx", "--dry-run", said_host="dgx")
    run("service install", "dgx", "--dry-run", *image, "--llama-bin-dir", LLAMA, said_host="dgx")

    name = "t" + uuid.uuid4().hex[:8]
    try:
        r = linkctl("lab", "up", "--profile", path, "--name", name, "--json")
        assert r.returncode == 0, r.stderr
        said["lab up"] = r.stderr.splitlines()[0]
        assert said["lab up"] == line(None)
        # lab up's own profile_path: the copy it wrote for the lab (lab exec presets it).
        up = json.loads(r.stdout)
        assert up["profile"] == "dgx-mac-lab" and up["profile_path"].endswith("/profile.toml")
    finally:
        linkctl("lab", "down", "--name", name)

    assert set(said) | set(NOT_RUN) == profile_commands()
