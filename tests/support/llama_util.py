"""Helpers for the tests that use llama.cpp: binaries, fake rpc servers, the tiny model."""

from __future__ import annotations

import socket
import subprocess
import sys
import time

import pytest

from linkctl.core.runner import stop_process
from support.cli import IN_CI
from support.paths import SUPPORT


def need_llama():
    """The real ggml-rpc-server and llama-server (scripts/build-llama.sh); fail under CI."""
    from linkctl.llama.bins import find_bins

    bins = find_bins()
    if bins.rpc_server is None or bins.llama_server is None:
        msg = "llama.cpp binaries not built; run scripts/build-llama.sh"
        if IN_CI:
            pytest.fail(msg)
        pytest.skip(msg)
    return bins


def wait_listening(host: str, port: int, timeout: float = 10.0) -> None:
    """Wait until something listens, without speaking to it (a connect, then an RST-free close
    before any byte: the servers read nothing and move on)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with socket.socket() as s:
            s.settimeout(0.5)
            if s.connect_ex((host, port)) == 0:
                return
        time.sleep(0.05)
    raise TimeoutError(f"nothing listens on {host}:{port}")


def start_fake(
    mode: str,
    port: int,
    host: str = "127.0.0.1",
    version: str | None = None,
    prefix: list[str] | None = None,
) -> subprocess.Popen:
    argv = [
        *(prefix or []),
        sys.executable,
        str(SUPPORT / "fake_rpc.py"),
        "--host",
        host,
        "--port",
        str(port),
        "--mode",
        mode,
    ]
    if version:
        argv += ["--version", version]
    p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    line = p.stdout.readline() if p.stdout else ""
    if "fake rpc-server" not in line:
        p.kill()
        raise RuntimeError(f"fake rpc server did not start: {line}")
    return p


def stop(p: subprocess.Popen) -> None:
    stop_process(p, 5)
