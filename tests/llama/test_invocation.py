"""The one typed llama.cpp invocation: argv rendered once, extra arguments taken in at
the edge (owned options into their fields, decisions linkctl makes refused)."""

from __future__ import annotations

import os
import tomllib

import pytest
import tomli_w

from linkctl.core.errors import InputError
from linkctl.llama.invocation import KvLayout, RpcServerInvocation, ServerInvocation
from support.cli import error_lines, linkctl
from support.paths import PROFILES

BASE = ServerInvocation("llama-server", "m.gguf", "127.0.0.1", 8080)


def extra(*args: str) -> ServerInvocation:
    return BASE.with_extra(args, "serve.extra_args")


def test_owned_options_land_in_their_fields_and_the_last_one_wins():
    inv = extra("-c", "2048", "--ctx-size=8192", "-ctk", "q8_0", "--flash-attn", "on", "-np", "2")
    assert (inv.ctx, inv.slots) == (8192, 2)
    assert inv.kv == KvLayout("q8_0", "f16", "on")
    assert inv.extra_args == ()  # nothing left to pass on unread
    # Each option appears once, where the invocation renders it.
    argv = inv.argv()
    assert argv.count("-c") == 1 and argv[argv.index("-c") + 1] == "8192"
    assert "--ctx-size=8192" not in argv


def test_unknown_options_pass_through_in_order_after_the_typed_ones():
    inv = extra("--no-mmap", "-ub", "256", "--mlock")
    assert inv.ubatch == 256 and inv.extra_args == ("--no-mmap", "--mlock")
    assert inv.argv()[-2:] == ["--no-mmap", "--mlock"]


def test_defaults_are_not_rendered():
    assert BASE.argv() == ["llama-server", "-m", "m.gguf", "--host", "127.0.0.1", "--port", "8080"]
    assert extra("-ctk", "f16").argv() == BASE.argv()  # llama-server's default, said again


def test_a_split_renders_with_fit_off():
    inv = BASE.changed(rpc=("h:1", "h:2"), tensor_split=(3.0, 1.0, 0.5), ngl=99)
    argv = inv.argv()
    assert argv[argv.index("--rpc") + 1] == "h:1,h:2"
    assert argv[argv.index("-ts") + 1 :][:3] == ["3,1,0.5", "-fit", "off"]
    assert inv.list_devices_argv() == ["llama-server", "--rpc", "h:1,h:2", "--list-devices"]


@pytest.mark.parametrize(
    "args, field",
    [
        (["--host", "0.0.0.0"], "serve.host"),
        (["--port=80"], "serve.host and serve.port"),
        (["--rpc", "10.0.0.9:50052"], "rpc hosts"),
        (["-m", "/other.gguf"], "serve.model"),
        (["--api-key", "secret"], "serve.api_key_file"),
        (["-ts", "1,1"], "serve.split"),
    ],
)
def test_decisions_linkctl_makes_are_refused(args, field):
    with pytest.raises(InputError, match="which linkctl decides") as e:
        extra(*args)
    assert field in (e.value.fix or "")


@pytest.mark.parametrize(
    "args, why",
    [
        (["-c"], "needs a value"),
        (["-c", "x"], "not a whole number"),
        (["-fa", "--no-mmap"], "needs a value"),
    ],
)
def test_a_malformed_owned_option_is_refused(args, why):
    with pytest.raises(InputError, match=why):
        extra(*args)


def test_rpc_server_never_listens_where_extra_args_say():
    inv = RpcServerInvocation("ggml-rpc-server", "192.168.100.2", 50052)
    for args in (["-H", "0.0.0.0"], ["--host", "10.0.0.1"], ["-p", "1"]):
        with pytest.raises(InputError, match="which linkctl decides"):
            inv.with_extra(args, "hosts.dgx.rpc.extra_args")
    taken = inv.with_extra(["-t", "8", "-d", "CUDA0", "-c"], "hosts.dgx.rpc.extra_args")
    assert (taken.threads, taken.device, taken.extra_args) == (8, "CUDA0", ("-c",))
    assert taken.argv() == [
        "ggml-rpc-server", "-H", "192.168.100.2", "-p", "50052", "-t", "8", "-d", "CUDA0", "-c"
    ]  # fmt: skip


def test_serve_refuses_a_profile_whose_extra_args_move_the_api(tmp_path):
    """The CLI edge: one line naming the field and the fix, exit 2, nothing started or
    written (a dry run writes nothing either way; the state dir stays empty)."""
    data = tomllib.loads((PROFILES / "dgx-mac.toml").read_text())
    data["serve"]["extra_args"] = ["--host", "0.0.0.0"]
    prof = tmp_path / "p.toml"
    prof.write_text(tomli_w.dumps(data))
    state = tmp_path / "state"
    env = {"LINKCTL_STATE_DIR": str(state), "PATH": "/usr/bin:/bin"}
    r = linkctl("serve", "--profile", str(prof), "--host", "mac", "--dry-run", env=os.environ | env)
    assert r.returncode == 2, r.stdout + r.stderr
    [err] = error_lines(r.stderr)
    assert "serve.extra_args" in err and "--host" in err, err
    assert not state.exists() or not any(state.rglob("*"))
