"""Where users have llama.cpp: discovery order (profile, env, PATH, build cache, source
build, Homebrew), and `linkctl llama find` reporting version and RPC protocol of each
(the real ggml-rpc-server, and a stand-in speaking protocol 3.0.0)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from linkctl.llama import bins as llama
from support.cli import linkctl
from support.llama_util import need_llama
from support.paths import SUPPORT


def stub_server(d: Path, version: str) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    f = d / "llama-server"
    f.write_text(f"#!/bin/sh\necho 'version: {version}' >&2\n")
    f.chmod(0o755)
    return f


def fake_rpc(d: Path, mode: str = "v3") -> Path:
    """An rpc-server stand-in taking rpc-server's -H/-p and speaking ``mode``."""
    d.mkdir(parents=True, exist_ok=True)
    f = d / "rpc-server"
    f.write_text(
        f'#!/bin/sh\nexec {sys.executable} {SUPPORT / "fake_rpc.py"} --host "$2" --port "$4" '
        f"--mode {mode}\n"
    )
    f.chmod(0o755)
    return f


@pytest.fixture(scope="session")
def real_bins():
    """The real build, found before ``places`` hides the usual places."""
    return need_llama()


@pytest.fixture
def places(tmp_path, monkeypatch):
    """A home with ~/llama.cpp/build/bin, $LLAMA_CPP_DIR, two Homebrew prefixes and an
    empty build cache, PATH holding none of them."""
    home = tmp_path / "home"
    brew = (tmp_path / "opt-homebrew-bin", tmp_path / "usr-local-bin")
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setattr(Path, "home", classmethod(lambda cls: home))
    monkeypatch.setattr(llama, "HOMEBREW_BINS", brew)
    monkeypatch.setattr(llama, "CACHE_ROOTS", (tmp_path / "cache",))
    monkeypatch.setenv("PATH", str(tmp_path / "empty-path"))
    monkeypatch.delenv("LINKCTL_LLAMA_BIN", raising=False)
    monkeypatch.delenv("LLAMA_CPP_DIR", raising=False)
    monkeypatch.setenv("LINKCTL_STATE_DIR", str(tmp_path / "state"))
    return {
        "home_src": home / "llama.cpp/build/bin",
        "src": tmp_path / "src/build/bin",
        "brew": brew[0],
        "brew_intel": brew[1],
        "root": tmp_path,
    }


def test_search_order_lists_every_place(places, monkeypatch):
    monkeypatch.setenv("LLAMA_CPP_DIR", str(places["root"] / "src"))
    labels = [(label, str(d) if d else None) for label, d in llama.search_dirs("/prof")]
    assert labels == [
        ("profile llama_bin_dir", "/prof"),
        ("PATH", None),
        ("source build", str(places["src"])),
        ("source build", str(places["home_src"])),
        ("Homebrew", str(places["brew"])),
        ("Homebrew", str(places["brew_intel"])),
    ]


def test_source_build_then_homebrew(places):
    stub_server(places["brew"], "8770 (82764d8)")
    b = llama.find_bins(None)
    assert (b.llama_server.found_via, b.llama_server.path) == (
        "Homebrew",
        str(places["brew"] / "llama-server"),
    )
    assert b.llama_server.version == "version: 8770 (82764d8)"
    assert b.rpc_server is None  # Homebrew's build has none: its ggml has no GGML_RPC
    stub_server(places["home_src"], "1 (abc)")
    fake_rpc(places["home_src"])
    b = llama.find_bins(None)
    assert b.llama_server.found_via == "source build" and b.rpc_server.found_via == "source build"
    assert b.rpc_server.path == str(places["home_src"] / "rpc-server")


def test_candidates_report_version_and_protocol_of_each(real_bins, places, monkeypatch):
    bins = real_bins
    real = places["root"] / "path-bin"
    real.mkdir()
    for b in (bins.llama_server, bins.rpc_server):
        (real / Path(b.path).name).symlink_to(b.path)
    monkeypatch.setenv("PATH", f"{real}{os.pathsep}{places['root'] / 'empty-path'}")
    stub_server(places["home_src"], "1 (old)")
    fake_rpc(places["home_src"], "v3")
    stub_server(places["brew"], "8770 (82764d8)")
    found = llama.candidates(None)
    by = {c.found_via: c for c in found}
    assert [c.found_via for c in found] == ["PATH", "source build", "Homebrew"]
    assert by["PATH"].selected == ["llama-server", "rpc-server"]
    assert by["PATH"].rpc_protocol.startswith("7.") and by["PATH"].version.startswith("version:")
    assert by["source build"].rpc_protocol == "3.0.0" and by["source build"].selected == []
    assert by["source build"].version == "version: 1 (old)"
    assert by["Homebrew"].rpc_server is None and by["Homebrew"].rpc_protocol is None
    # No protocol asked: nothing is started.
    assert all(c.rpc_protocol is None for c in llama.candidates(None, protocol=False))


def test_cli_lists_what_serve_runs(tmp_path):
    bins = need_llama()
    env = {**os.environ, "LINKCTL_LLAMA_BIN": str(Path(bins.rpc_server.path).parent)}
    r = linkctl("llama", "find", "--json", env=env)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["profile_path"] is None  # no --host: no profile read
    first = out["builds"][0]
    assert first["found_via"] == "LINKCTL_LLAMA_BIN" and first["rpc_protocol"].startswith("7.")
    assert set(first["selected"]) == {"llama-server", "rpc-server"}
    r = linkctl("llama", "find")
    assert r.returncode == 0 and "RPC protocol 7." in r.stdout and "*" in r.stdout


def test_cli_exits_1_when_nothing_is_found(places):
    from typer.testing import CliRunner

    from linkctl.cli import app

    r = CliRunner().invoke(app, ["llama", "find"])
    assert r.exit_code == 1 and "no llama.cpp binaries found" in r.output


def test_cli_warns_when_builds_speak_different_protocols(real_bins, places, monkeypatch):
    from typer.testing import CliRunner

    from linkctl.cli import app

    monkeypatch.setenv("LINKCTL_LLAMA_BIN", str(Path(real_bins.rpc_server.path).parent))
    fake_rpc(places["home_src"], "v3")
    r = CliRunner().invoke(app, ["llama", "find"])
    assert r.exit_code == 0, r.output
    assert "RPC protocol 3.0.0" in r.output and "different RPC protocols (3.0.0, 7." in r.output
