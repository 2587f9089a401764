"""Errors by cause: each raised at its OS/tool/peer boundary, each with its exit code,
and no caller deciding by an error's message text.

Network traffic: 127.0.0.1 only (a closed port, tests/fake_rpc.py); the macOS cases
replay recorded networksetup output (tests/fixtures/macos/).
"""

from __future__ import annotations

import ipaddress
import re
import subprocess
import sys

import pytest

from linkctl.core import errors
from linkctl.core.errors import (
    CommandNotFound,
    ConnectionRefused,
    InputError,
    LinkctlError,
    NeedsRoot,
    PermissionDenied,
    RpcProtocolMismatch,
    Timeout,
)
from linkctl.core.runner import Runner
from linkctl.llama import rpc
from linkctl.llama.bins import free_port
from support.cli import need_root_netns
from support.llama_util import start_fake, stop
from support.paths import REPO


@pytest.mark.parametrize(
    ("cls", "code"),
    [
        (errors.InputError, 2),
        (errors.CheckFailed, 1),
        (errors.ApplyError, 1),
        (CommandNotFound, 2),
        (Timeout, 2),
        (ConnectionRefused, 2),
        (PermissionDenied, 2),
        (NeedsRoot, 2),
        (RpcProtocolMismatch, 2),
    ],
)
def test_exit_code_is_a_class_attribute(cls, code):
    assert issubclass(cls, LinkctlError)
    assert cls.__dict__["exit_code"] == code  # declared on the class itself, not inherited


def test_cause_classes_keep_the_one_line_message():
    e = RpcProtocolMismatch("speaks 3.0.0", "rebuild", local=(7, 0, 0), remote=(3, 0, 0))
    assert (e.local, e.remote, e.line()) == ((7, 0, 0), (3, 0, 0), "speaks 3.0.0 (fix: rebuild)")
    assert str(ConnectionRefused("refused", host="127.0.0.1", port=1)) == "refused"
    assert issubclass(NeedsRoot, PermissionDenied)


# ---- runner: the command boundary ------------------------------------------------------


def test_runner_missing_command_is_command_not_found():
    with pytest.raises(CommandNotFound) as e:
        Runner().run(["linkctl-no-such-command-xyz"])
    assert e.value.command == "linkctl-no-such-command-xyz"
    assert e.value.line() == (
        "command not found: linkctl-no-such-command-xyz "
        "(fix: install linkctl-no-such-command-xyz or put it on PATH)"
    )
    assert e.value.exit_code == 2


def test_runner_spawn_missing_command_is_command_not_found():
    with pytest.raises(CommandNotFound):
        Runner().spawn(["linkctl-no-such-command-xyz"])


def test_runner_deadline_is_timeout():
    with pytest.raises(Timeout) as e:
        Runner().run([sys.executable, "-c", "import time; time.sleep(30)"], timeout=0.3)
    assert e.value.seconds == 0.3
    assert "did not finish within 0.3 s" in e.value.message
    assert e.value.exit_code == 2


# ---- rpc: the peer boundary --------------------------------------------------------------


def test_rpc_closed_port_is_connection_refused():
    port = free_port()  # bound then released: nothing listens on it
    with pytest.raises(ConnectionRefused) as e:
        rpc.hello("127.0.0.1", port, timeout=2)
    assert (e.value.host, e.value.port, e.value.exit_code) == ("127.0.0.1", port, 2)
    assert e.value.message == (
        f"rpc endpoint 127.0.0.1:{port}: connection refused (nothing listens there)"
    )
    assert not isinstance(e.value, rpc.RpcError)  # not busy, not "no HELLO"


def _loopback_profile(port: int):
    """The shipped profile with its rpc host on 127.0.0.1:port (built without the
    profile's link-address rule, which a real profile must pass)."""
    from linkctl.core.profile import load_profile

    prof, _ = load_profile("dgx-mac")
    hosts = [
        h.model_copy(
            update={
                "address": ipaddress.IPv4Interface("127.0.0.1/8"),
                "rpc": h.rpc.model_copy(update={"port": port}),
            }
        )
        if h.role == "rpc"
        else h
        for h in prof.hosts
    ]
    return prof.model_copy(update={"hosts": hosts})


def test_protocol_mismatch_carries_both_versions():
    from linkctl.serve import run

    port = free_port()
    fake = start_fake("v3", port, version="3.0.0")
    try:
        prof = _loopback_profile(port)
        with pytest.raises(RpcProtocolMismatch) as e:
            run.check_endpoints(prof, (7, 0, 0), "test build")
        assert (e.value.local, e.value.remote, e.value.exit_code) == ((7, 0, 0), (3, 0, 0), 2)
        assert re.search(
            r"speaks RPC protocol 3\.0\.0 .*this head's build speaks 7\.0\.0", str(e.value)
        )
        # The same endpoint, a compatible local build: no error.
        infos = run.check_endpoints(prof, (3, 0, 0), "test build")
        assert [(n, i.version_str) for n, i in infos.items()] == [("dgx", "3.0.0")]
    finally:
        stop(fake)


def test_serve_wait_refuses_a_mismatch_at_once_and_waits_out_refused():
    """serve's first-contact loop: a closed port is waited for (until the deadline), a
    protocol mismatch is raised at once; decided by type."""
    import time

    from linkctl.serve import run

    port = free_port()
    prof = _loopback_profile(port)
    lines: list[str] = []
    t0 = time.monotonic()
    with pytest.raises(ConnectionRefused):
        run.wait_endpoints(prof, (7, 0, 0), "test build", wait_s=1.0, say=lines.append)
    assert time.monotonic() - t0 >= 1.0
    assert lines and lines[0].startswith("waiting for rpc endpoints: rpc endpoint 127.0.0.1:")

    fake = start_fake("v3", port, version="3.0.0")
    try:
        t0 = time.monotonic()
        with pytest.raises(RpcProtocolMismatch):
            run.wait_endpoints(prof, (7, 0, 0), "test build", wait_s=30.0, say=lines.append)
        assert time.monotonic() - t0 < 10.0
    finally:
        stop(fake)


# ---- arp: raw sockets --------------------------------------------------------------


def test_arp_without_raw_socket_permission_is_permission_denied():
    """As user nobody a raw socket is refused before any packet is sent (loopback)."""
    need_root_netns()
    code = (
        "from linkctl.net.arp import who_has\n"
        "from linkctl.core.errors import PermissionDenied\n"
        "try:\n"
        "    who_has('lo', '127.0.0.1', timeout=0.1, tries=1)\n"
        "except PermissionDenied as e:\n"
        "    print('PermissionDenied', e.exit_code, e.line())\n"
    )
    nobody = ["setpriv", "--reuid", "65534", "--regid", "65534", "--clear-groups"]
    r = subprocess.run(
        [*nobody, sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
        cwd="/",
    )
    assert r.stdout.strip() == (
        "PermissionDenied 2 no permission for raw sockets (ARP) "
        "(fix: run as root or grant CAP_NET_RAW)"
    ), r.stderr


# ---- no caller decides by message text -------------------------------------------------------

# `"text" in e.message`, `... not in str(exc)`, `re.search(..., e.detail)`,
# `x.message.startswith(...)`: an error's words read to decide what to do.
_TEXT_TEST = re.compile(
    r"""(?x)
    (["'][^"']*["']|\b_?[A-Z][A-Z0-9_]+)\s+(not\s+)?in\s+   # "text" in, CONST not in
    [\w.()\[\]-]*(\.message|\.detail|\.fix|\.stopped|\.line\(\))\b
    | (["'][^"']*["']|\b_?[A-Z][A-Z0-9_]+)\s+(not\s+)?in\s+str\(\s*(e|exc|err|error|ex)\s*\)
    | \.(message|detail|fix)\.(startswith|endswith|find|count|lower|index)\(
    | str\(\s*(e|exc|err|error|ex)\s*\)\.(startswith|endswith|find|lower)\(
    | re\.(search|match|fullmatch|findall)\([^)]*(\.message|\.detail|str\(\s*(e|exc|err)\s*\))
    | \b(note|why|warning|reason|msg)\.(startswith|endswith|find)\(     # our own sentences
    | ["'][^"']*["']\s+(not\s+)?in\s+(note|why|w|warning|reason|msg)\b(?!\s*[(.\[])
    """
)


def test_the_pattern_catches_the_old_forms():
    for line in (
        'if "permission" in e.message:',
        'if "admin privileges" in e.message:',
        'elif "permission" in c.detail:',
        'if "speaks RPC protocol" in e.message or late:',
        'if "refused" not in str(exc):',
        "if e.message.startswith('rpc'):",
        'if re.search("refused", e.message):',
        "if _NEEDS_ADMIN in e.value.message:",
        'if "x" in scratch.checks[-1].detail:',
        'if why is not None and why.startswith("could not run"):',
        'choice.notes += [w for w in est.warnings if "calibrat" in w]',
        'if note.startswith("disaggregated:"):',
    ):
        assert _TEXT_TEST.search(line), line
    for line in (
        'say(f"waiting: {e.message}")',
        "if e.message != last:",
        "x = e.message",
        'argv = [str(a) for a in change.args["argv"]]',
    ):
        assert not _TEXT_TEST.search(line), line


def test_no_caller_decides_by_error_message_text():
    """The package and its callers in the repo (benchmarks, scripts); tests are exempt:
    they assert the words the user reads."""
    hits = []
    files = [p for d in ("linkctl", "bench", "scripts") for p in (REPO / d).rglob("*.py")]
    assert len(files) > 50, files  # the scan really read the tree
    for path in sorted(files):
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if _TEXT_TEST.search(line):
                hits.append(f"{path.relative_to(REPO)}:{n}: {line.strip()}")
    assert hits == [], "decide by the error's type (linkctl/core/errors.py), not its words:\n" + (
        "\n".join(hits)
    )


def test_input_error_still_catches_every_cause():
    """Callers that catch InputError (exit 2) keep catching every cause."""
    for cls in (CommandNotFound, Timeout, ConnectionRefused, PermissionDenied, NeedsRoot):
        assert issubclass(cls, InputError)
    assert issubclass(RpcProtocolMismatch, InputError)
