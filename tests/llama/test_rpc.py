"""linkctl.llama.rpc against the real ggml-rpc-server and stand-ins for older protocols.

All traffic on 127.0.0.1 (loopback only, no interface involved).
"""

from __future__ import annotations

import socket
import struct
import subprocess
import sys
import time

import pytest

from linkctl.core.errors import InputError
from linkctl.llama import rpc
from linkctl.llama.bins import free_port
from support.llama_util import need_llama, start_fake, stop
from support.paths import SUPPORT


@pytest.fixture
def fake():
    procs = []

    def _start(mode: str, version: str | None = None) -> int:
        port = free_port()
        procs.append(start_fake(mode, port, version=version))
        return port

    yield _start
    for p in procs:
        stop(p)


@pytest.mark.parametrize(
    ("mode", "version", "fmt"),
    [("v7", "7.0.0", "caps"), ("v3", "3.0.0", "empty"), ("v2", "2.0.1", "empty")],
)
def test_query_each_hello_shape(fake, mode, version, fmt):
    port = fake(mode, version)
    info = rpc.query("127.0.0.1", port, timeout=3)
    assert info.version == tuple(int(x) for x in version.split("."))
    assert info.hello_format == fmt
    assert len(info.devices) == 1
    assert info.devices[0] == rpc.DeviceMemory(free=3 * 2**30, total=4 * 2**30)
    assert rpc.hello("127.0.0.1", port, timeout=3) == info.version


def test_device_count_is_used():
    port = free_port()
    p = subprocess.Popen(
        [
            sys.executable,
            str(SUPPORT / "fake_rpc.py"),
            "--port",
            str(port),
            "--mode",
            "v3",
            "--devices",
            "3",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        p.stdout.readline()
        info = rpc.query("127.0.0.1", port, timeout=3)
        assert len(info.devices) == 3
    finally:
        stop(p)


def test_no_hello_is_refused_clearly(fake):
    port = fake("nohello")
    with pytest.raises(rpc.RpcNoHello, match="closed the connection on HELLO in both"):
        rpc.query("127.0.0.1", port, timeout=3)


def test_silent_server_is_busy_not_a_hang(fake):
    port = fake("silent")
    t0 = time.monotonic()
    with pytest.raises(rpc.RpcBusy, match=r"did not answer HELLO within 0\.8 s"):
        rpc.hello("127.0.0.1", port, timeout=0.8)
    assert time.monotonic() - t0 < 2.0


def test_nothing_listening_is_input_error_not_busy():
    port = free_port()
    with pytest.raises(InputError, match="connection refused") as e:
        rpc.hello("127.0.0.1", port, timeout=1)
    assert not isinstance(e.value, rpc.RpcBusy)


# ---- the real server --------------------------------------------------------------


@pytest.fixture
def real_rpc_server():
    bins = need_llama()
    port = free_port()
    p = subprocess.Popen(
        [bins.rpc_server.path, "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        rpc.wait_ready("127.0.0.1", port, timeout=20)
        yield p, port
    finally:
        stop(p)


@pytest.mark.llama
def test_real_server_version_and_memory(real_rpc_server):
    _p, port = real_rpc_server
    info = rpc.query("127.0.0.1", port, timeout=3)
    assert info.version[0] >= 7 and info.hello_format == "caps"
    assert info.devices and all(0 < d.free <= d.total for d in info.devices)
    from linkctl.llama.bins import find_bins, local_rpc_protocol

    assert local_rpc_protocol(find_bins()) == info.version


@pytest.mark.llama
def test_real_server_busy_while_held_and_survives(real_rpc_server):
    """A client holding the connection makes a probe report busy within its timeout;
    the server lives on and answers once the holder leaves."""
    p, port = real_rpc_server
    holder = socket.create_connection(("127.0.0.1", port))
    holder.sendall(
        struct.pack("<BQ", rpc.RpcCmd.HELLO, rpc.CONN_CAPS_SIZE) + bytes(rpc.CONN_CAPS_SIZE)
    )
    holder.settimeout(5)
    got = b""
    while len(got) < 8 + 4 + rpc.CONN_CAPS_SIZE:  # size, then version + pad + caps
        chunk = holder.recv(64)
        assert chunk, "server hung up on the holder's HELLO"
        got += chunk
    assert got[8] >= 7
    for _ in range(2):
        t0 = time.monotonic()
        with pytest.raises(rpc.RpcBusy):
            rpc.query("127.0.0.1", port, timeout=0.7)
        assert time.monotonic() - t0 < 1.5
    holder.close()
    # the server drains the two dead probes (reset, so it never writes into them)
    v = rpc.wait_ready("127.0.0.1", port, timeout=10)
    assert v[0] >= 7
    assert p.poll() is None, "rpc-server died after busy probes"
