"""Fixtures of the boot harness's tests (test_boot, test_up_down): this machine's own
state before any image or lab, the booted hosts' image, and the head's tiny model."""

from __future__ import annotations

import os
import sys
import time

import pytest

from linkctl.gguf.tiny import TinySpec, write_tiny_llama
from linkctl.lab import rootfs
from support import boot_kit as kit
from support.cli import need_root_netns, need_tool
from support.llama_util import need_llama


def say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


@pytest.fixture(scope="module")
def host_before():
    need_root_netns()
    return kit.host_snapshot()


@pytest.fixture(scope="module")
def image(host_before):
    need_tool("mmdebstrap")
    need_tool("systemd-nspawn")
    need_llama()
    t0 = time.monotonic()
    img = rootfs.prepare(log=say)
    say(f"boot figure: prepare (rootfs cached after the first run): {time.monotonic() - t0:.1f} s")
    yield img
    img.discard()


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    d = tmp_path_factory.mktemp("model")
    path = d / "tiny.gguf"
    write_tiny_llama(path, TinySpec(n_layer=4, n_embd=128, n_ff=256))
    # Readable by the serve unit's DynamicUser through the read-only bind.
    os.chmod(d, 0o755)
    os.chmod(path, 0o644)
    return path
