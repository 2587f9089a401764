"""A stand-in llama.cpp rpc-server speaking an older (or no) RPC protocol.

The real 7.x server is tested as built; older servers cannot be built here in
test time, so this speaks their wire format as ggml-rpc.cpp of those versions
defines it: 1.x-3.x HELLO takes an empty request and answers 3 bytes; 3.x adds
DEVICE_COUNT and a u32 device index in GET_DEVICE_MEMORY. Like the real one it
serves one client at a time and hangs up on a HELLO of the wrong shape.

    python tests/fake_rpc.py --host H --port P --mode v3 --version 3.0.0
    modes: v7 (caps HELLO), v3 (empty HELLO, DEVICE_COUNT), v2 (empty HELLO,
           no device index), nohello (hangs up on anything), silent (never answers)
"""

from __future__ import annotations

import argparse
import socket
import struct
import sys
import time

from linkctl.llama.rpc import RpcCmd

FREE, TOTAL = 3 * 2**30, 4 * 2**30


def recv_exact(c: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = c.recv(n - len(buf))
        if not chunk:
            raise EOFError
        buf += chunk
    return buf


def send_msg(c: socket.socket, payload: bytes) -> None:
    c.sendall(struct.pack("<Q", len(payload)) + payload)


def serve_client(c: socket.socket, mode: str, version: tuple[int, int, int], devices: int) -> None:
    if mode == "silent":
        time.sleep(3600)
        return
    cmd, size = struct.unpack("<BQ", recv_exact(c, 9))
    if mode == "nohello" or cmd != RpcCmd.HELLO:
        return
    want = 24 if mode == "v7" else 0
    if size != want:
        return  # the real servers hang up on the other HELLO shape
    recv_exact(c, size)
    if mode == "v7":
        send_msg(c, bytes(version) + b"\0" + bytes(24))
    else:
        send_msg(c, bytes(version))
    while True:
        cmd, size = struct.unpack("<BQ", recv_exact(c, 9))
        payload = recv_exact(c, size)
        if cmd == RpcCmd.DEVICE_COUNT and mode in ("v3", "v7"):
            send_msg(c, struct.pack("<I", devices))
        elif cmd == RpcCmd.GET_DEVICE_MEMORY:
            if mode in ("v3", "v7") and len(payload) != 4:
                return
            if mode == "v2" and payload:
                return
            send_msg(c, struct.pack("<QQ", FREE, TOTAL))
        else:
            return


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--mode", choices=["v7", "v3", "v2", "nohello", "silent"], required=True)
    ap.add_argument("--version", default=None)
    ap.add_argument("--devices", type=int, default=1)
    a = ap.parse_args()
    default = {"v7": "7.0.0", "v3": "3.0.0", "v2": "2.0.0"}.get(a.mode, "0.0.0")
    version = tuple(int(x) for x in (a.version or default).split("."))
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((a.host, a.port))
    s.listen(1)
    print(
        f"fake rpc-server {a.mode} {'.'.join(map(str, version))} on {a.host}:{a.port}", flush=True
    )
    while True:
        c, _ = s.accept()
        try:
            serve_client(c, a.mode, version, a.devices)  # type: ignore[arg-type]
        except (EOFError, OSError):
            pass
        finally:
            c.close()


if __name__ == "__main__":
    sys.exit(main())
