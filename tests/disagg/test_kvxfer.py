"""The link transfer (linkctl/disagg/kvxfer.py) on loopback: sealed and checksummed
copies, a byte changed on the wire, resume, refusals."""

from __future__ import annotations

import contextlib
import hashlib
import ipaddress
import os
import socket
import threading
import time

import pytest

from linkctl.core.errors import InputError
from linkctl.disagg import kvagent, kvxfer
from linkctl.disagg.fingerprint import fingerprint
from linkctl.trust import session
from linkctl.trust.secret import PairSecret

LO = ipaddress.IPv4Network("127.0.0.0/8")
KEY = PairSecret(os.urandom(32), "test")


@pytest.fixture
def areas(tmp_path):
    d = {"kv": tmp_path / "kv", "models": tmp_path / "models"}
    for p in d.values():
        p.mkdir()
    return d


def test_fetch_sealed_and_deleted(areas, tmp_path):
    data = os.urandom(3 * kvxfer.CHUNK + 123)
    (areas["kv"] / "slot.kv").write_bytes(data)
    seen = []
    with kvagent.Agent("127.0.0.1", 0, areas, LO, KEY) as a:
        res = kvxfer.fetch(
            "127.0.0.1",
            a.port,
            "kv",
            "slot.kv",
            tmp_path / "got.kv",
            delete=True,
            progress=lambda done, total: seen.append((done, total)),
            secret=KEY,
        )
    assert (tmp_path / "got.kv").read_bytes() == data
    assert (tmp_path / "got.kv").stat().st_mode & 0o777 == 0o600  # a user's prompt
    assert res.sha256 is None and res.bytes == len(data)  # checked by its records' tags
    assert not (areas["kv"] / "slot.kv").exists()
    assert seen[-1] == (len(data), len(data))


def test_put_resumes_a_matching_partial_and_restarts_a_foreign_one(areas, tmp_path):
    src = tmp_path / "m.gguf"
    data = os.urandom(2 * kvxfer.CHUNK + 7)
    src.write_bytes(data)
    part = areas["models"] / "m.gguf.part"
    part.write_bytes(data[:1000])
    part.chmod(0o644)  # written before: its mode is made private as it resumes
    with kvagent.Agent("127.0.0.1", 0, areas, LO, KEY) as a:
        res = kvxfer.put("127.0.0.1", a.port, "models", src, secret=KEY)
        assert res.resumed_from == 1000 and res.bytes == len(data) - 1000
        assert (areas["models"] / "m.gguf").read_bytes() == data and not part.exists()
        assert (areas["models"] / "m.gguf").stat().st_mode & 0o777 == 0o600
        # A partial that is not a prefix of this file: start over, still correct.
        (areas["models"] / "m.gguf").unlink()
        part.write_bytes(b"x" * 5000)
        res = kvxfer.put("127.0.0.1", a.port, "models", src, secret=KEY)
        assert res.resumed_from == 0 and (areas["models"] / "m.gguf").read_bytes() == data
        st = kvxfer.stat("127.0.0.1", a.port, "models", "m.gguf", secret=KEY)
        assert st["size"] == len(data) and st["partial"] == 0


def flipping_proxy(target: int, at: int) -> socket.socket:
    """A TCP relay to ``target`` that flips one bit of the agent's reply stream at byte
    ``at``: a tap that changes what crosses."""
    lsn = socket.socket()
    lsn.bind(("127.0.0.1", 0))
    lsn.listen(1)

    def pump(src: socket.socket, dst: socket.socket, flip: int | None) -> None:
        seen = 0
        with contextlib.suppress(OSError):
            while b := src.recv(1 << 16):
                if flip is not None and seen <= flip < seen + len(b):
                    i = flip - seen
                    b = b[:i] + bytes([b[i] ^ 1]) + b[i + 1 :]
                seen += len(b)
                dst.sendall(b)
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)

    def relay() -> None:
        c, _ = lsn.accept()
        up = socket.create_connection(("127.0.0.1", target))
        threading.Thread(target=pump, args=(c, up, None), daemon=True).start()
        pump(up, c, at)

    threading.Thread(target=relay, daemon=True).start()
    return lsn


def test_a_byte_changed_on_the_wire_keeps_nothing(areas, tmp_path):
    """One bit flipped inside the file's records: the fetch fails, no file, no .part,
    and the agent's copy stays."""
    data = os.urandom(3 * kvxfer.CHUNK)
    (areas["kv"] / "slot.kv").write_bytes(data)
    dest = tmp_path / "x.kv"
    with kvagent.Agent("127.0.0.1", 0, areas, LO, KEY) as a:
        lsn = flipping_proxy(a.port, kvxfer.CHUNK + 12345)
        with pytest.raises(session.AuthError, match="fails its tag"):
            kvxfer.fetch("127.0.0.1", lsn.getsockname()[1], "kv", "slot.kv", dest, secret=KEY)
        lsn.close()
        # Untouched, the same copy goes through.
        kvxfer.fetch("127.0.0.1", a.port, "kv", "slot.kv", dest, secret=KEY)
    assert dest.read_bytes() == data
    assert not dest.with_name("x.kv.part").exists()
    assert hashlib.sha256((areas["kv"] / "slot.kv").read_bytes()).digest() == (
        hashlib.sha256(data).digest()
    )


def test_agent_refuses_wildcard_other_peers_and_paths(areas, tmp_path):
    with pytest.raises(InputError, match="wildcard"):
        kvagent.Agent("0.0.0.0", 0, areas, LO, KEY)
    with pytest.raises(InputError, match="not on the link subnet"):
        kvagent.Agent("127.0.0.1", 0, areas, ipaddress.IPv4Network("198.18.100.0/24"), KEY)
    (areas["kv"] / "a.kv").write_bytes(b"1234")
    # Only peers on the link subnet: 127.0.0.1 is not in 127.0.0.2/32.
    only = ipaddress.IPv4Network("127.0.0.2/32")
    with (
        kvagent.Agent("127.0.0.2", 0, areas, only, KEY) as a,
        pytest.raises(kvxfer.TransferError, match="closed"),
    ):
        kvxfer.fetch(
            "127.0.0.2", a.port, "kv", "a.kv", tmp_path / "a", source="127.0.0.1", secret=KEY
        )
    with kvagent.Agent("127.0.0.1", 0, areas, LO, KEY) as a:
        for bad in ("../a.kv", "a/b", ".hidden", "x.part", "a.kv\n"):
            with pytest.raises(InputError, match="not allowed"):
                kvxfer.fetch("127.0.0.1", a.port, "kv", bad, tmp_path / "a", secret=KEY)
        with pytest.raises(kvxfer.TransferError, match="no file"):
            kvxfer.fetch("127.0.0.1", a.port, "kv", "missing.kv", tmp_path / "a", secret=KEY)
    assert (areas["kv"] / "a.kv").read_bytes() == b"1234"


def test_fingerprint_tells_files_apart(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    a.write_bytes(b"\0" * 100)
    b.write_bytes(b"\0" * 99 + b"\1")
    fa, fb = fingerprint(a), fingerprint(b)
    assert fa.size == fb.size and fa.sha256 != fb.sha256 and not fa.same_file(fb)
    assert fa.same_file(fingerprint(a)) and fa.diff(fingerprint(a)) == []
    gone = fingerprint(tmp_path / "none")
    assert gone.size is None and gone.error and not gone.same_file(gone)


def test_agent_reports_the_kv_layout_its_server_runs(areas, tmp_path):
    from linkctl.llama.invocation import KvLayout, ServerInvocation

    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    extra = ["-ctk", "q8_0", "--flash-attn", "on"]
    layout = ServerInvocation("llama-server", "m.gguf").with_extra(extra, "serve.extra_args").kv
    assert layout == KvLayout("q8_0", "f16", "on")
    with kvagent.Agent("127.0.0.1", 0, areas, LO, KEY, model=str(model), kv=layout) as a:
        got = kvxfer.remote_model("127.0.0.1", a.port, secret=KEY)
    assert got == fingerprint(model, layout) and got.size == 4


def test_two_puts_to_one_name_never_mix(areas, tmp_path):
    """A second put to a name being written is refused; the file is the first's, whole."""
    first, second = tmp_path / "one.gguf", tmp_path / "two.gguf"
    first.write_bytes(os.urandom(3 * kvxfer.CHUNK))
    second.write_bytes(os.urandom(3 * kvxfer.CHUNK))
    halfway, go = threading.Event(), threading.Event()
    errors: list[Exception] = []

    def slow(done: int, total: int) -> None:
        if done >= kvxfer.CHUNK and not halfway.is_set():
            halfway.set()
            go.wait(30)

    with kvagent.Agent("127.0.0.1", 0, areas, LO, KEY) as a:

        def put_first() -> None:
            try:
                kvxfer.put(
                    "127.0.0.1", a.port, "models", first, name="m.gguf", progress=slow, secret=KEY
                )
            except Exception as e:  # the test reads it below
                errors.append(e)

        t = threading.Thread(target=put_first)
        t.start()
        assert halfway.wait(30)
        with pytest.raises((InputError, kvxfer.TransferError), match="being written by another"):
            kvxfer.put("127.0.0.1", a.port, "models", second, name="m.gguf", secret=KEY)
        go.set()
        t.join(60)
    assert errors == []
    assert (areas["models"] / "m.gguf").read_bytes() == first.read_bytes()


def test_a_file_rewritten_while_it_is_sent_is_not_kept(areas, tmp_path):
    src = areas["models"] / "m.gguf"
    src.write_bytes(os.urandom(8 * kvxfer.CHUNK))
    rewritten = threading.Event()

    def rewrite(done: int, total: int) -> None:
        if not rewritten.is_set():
            rewritten.set()
            with open(src, "r+b") as f:  # the same size, other bytes: a new version
                f.write(os.urandom(kvxfer.CHUNK))

    with (
        kvagent.Agent("127.0.0.1", 0, areas, LO, KEY) as a,
        pytest.raises(kvxfer.TransferError, match="changed while it was sent"),
    ):
        kvxfer.fetch(
            "127.0.0.1", a.port, "models", "m.gguf", tmp_path / "m", progress=rewrite, secret=KEY
        )
    assert rewritten.is_set()
    assert not (tmp_path / "m").exists() and not (tmp_path / "m.part").exists()


def test_partial_files_not_resumed_within_a_day_are_removed(areas):
    old, fresh = areas["kv"] / "old.kv.part", areas["kv"] / "fresh.kv.part"
    for p in (old, fresh):
        p.write_bytes(b"x")
    day_ago = time.time() - kvxfer.PART_KEEP_S - 60
    os.utime(old, (day_ago, day_ago))
    with kvagent.Agent("127.0.0.1", 0, areas, LO, KEY):
        pass
    assert not old.exists() and fresh.exists()


def test_a_source_cut_short_while_it_is_put_keeps_nothing(areas, tmp_path):
    """The file shrinks under the reader (ReadAhead): the put fails naming it, and the
    agent has nothing under the name."""
    src = tmp_path / "m.gguf"
    src.write_bytes(os.urandom(8 * kvxfer.CHUNK))

    def cut(done: int, total: int) -> None:
        os.truncate(src, kvxfer.CHUNK)

    with (
        kvagent.Agent("127.0.0.1", 0, areas, LO, KEY) as a,
        pytest.raises(kvxfer.TransferError, match="shrank while it was sent"),
    ):
        kvxfer.put("127.0.0.1", a.port, "models", src, progress=cut, secret=KEY)
    assert not (areas["models"] / "m.gguf").exists()
