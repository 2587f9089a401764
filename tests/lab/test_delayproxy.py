"""The userspace delay proxy: RPC framing parser, and real delay/order/counters between
lab namespaces."""

from __future__ import annotations

import collections
import json
import struct
import subprocess
import sys
import time

import pytest

from linkctl.core.runner import stop_process
from linkctl.lab.delayproxy import main
from linkctl.lab.rpcstream import _RpcParser
from linkctl.llama.rpc import RpcCmd

ECHO = r"""
import socket, sys, threading
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], int(sys.argv[2]))); s.listen(4)
def serve(c):
    c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    while True:
        d = c.recv(65536)
        if not d: break
        c.sendall(d)
while True:
    c, _ = s.accept(); threading.Thread(target=serve, args=(c,), daemon=True).start()
"""

CLIENT = r"""
import json, random, socket, statistics, sys, time
host, port, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
for _ in range(100):
    try:
        s = socket.create_connection((host, port), timeout=5); break
    except OSError:
        time.sleep(0.1)
s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
rtts = []
for i in range(n):
    t = time.perf_counter(); s.sendall(b"p" * 32); got = 0
    while got < 32: got += len(s.recv(65536))
    rtts.append((time.perf_counter() - t) * 1e6)
# Order: a numbered stream sent in random-sized pieces comes back intact and in order.
import struct
data = b"".join(struct.pack("<I", i) for i in range(20000))
pos = 0
while pos < len(data):
    k = random.randint(1, 3000); s.sendall(data[pos:pos + k]); pos += k
back = b""
while len(back) < len(data):
    back += s.recv(65536)
print(json.dumps({"rtts": rtts, "in_order": back == data}))
"""


def test_rpc_parser_counts_commands_across_chunk_boundaries():
    stream = b""
    expect = collections.Counter()
    for cmd, size in ((14, 24), (6, 5000), (6, 16), (10, 300), (8, 40), (16, 8)):
        stream += struct.pack("<BQ", cmd, size) + bytes(size)
        expect[RpcCmd(cmd).name] += 1
    for step in (1, 7, 4096, len(stream)):
        p, got = _RpcParser(), collections.Counter()
        for i in range(0, len(stream), step):
            p.feed(stream[i : i + step], got)
        assert got == expect, step


def test_rpc_parser_stops_on_non_rpc_bytes():
    p, got = _RpcParser(), collections.Counter()
    p.feed(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", got)
    assert not p.ok and not got


def test_cli_bad_addresses_exit_2(capsys):
    assert main(["--listen", "nonsense", "--target", "198.18.100.2:1"]) == 2
    assert "--listen 'nonsense': not ADDR:PORT" in capsys.readouterr().err
    assert main(["--listen", "198.18.100.2:1", "--target", "x:1", "--delay-ms", "-1"]) == 2


@pytest.mark.netns
def test_delay_order_and_turns_between_namespaces(make_lab, tmp_path):
    lab = make_lab("dgx-mac")
    for h in ("dgx", "mac"):
        assert lab.run(h, "setup").returncode == 0
    ip = lab.host("dgx")["address"].split("/")[0]
    ns = lab.netns("dgx")
    procs = [subprocess.Popen(["ip", "netns", "exec", ns, sys.executable, "-c", ECHO, ip, "7000"])]
    results = {}
    try:
        for delay in (0.0, 2.0):
            stats = tmp_path / f"stats-{delay}.json"
            proxy = subprocess.Popen(
                [
                    "ip",
                    "netns",
                    "exec",
                    ns,
                    sys.executable,
                    "-m",
                    "linkctl.lab.delayproxy",
                    "--listen",
                    f"{ip}:7001",
                    "--target",
                    f"{ip}:7000",
                    "--delay-ms",
                    str(delay),
                    "--stats-file",
                    str(stats),
                ],
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                text=True,
            )
            procs.append(proxy)  # killed below if it ever ignores SIGTERM
            r = lab.exec("mac", sys.executable, "-c", CLIENT, ip, "7001", "50")
            assert r.returncode == 0, r.stderr
            results[delay] = json.loads(r.stdout)
            time.sleep(0.5)
            proxy.terminate()
            out, _ = proxy.communicate(timeout=10)
            final = json.loads(out.strip().splitlines()[-1])
            assert final["connections"] == 1
            # 50 pings are 50 request/response turns; the ordered stream adds a few more.
            assert final["turns"] >= 50
            assert final["c2s_bytes"] == 50 * 32 + 20000 * 4 == final["s2c_bytes"]
    finally:
        for p in procs:
            stop_process(p, 10)
    for res in results.values():
        assert res["in_order"]
    slow, fast = results[2.0]["rtts"], results[0.0]["rtts"]
    # Never early: each round trip crosses the proxy twice at 2 ms each way.
    assert min(slow) >= 4000
    med = sorted(slow)[len(slow) // 2] - sorted(fast)[len(fast) // 2]
    assert 3800 < med < 6000, med


# ---- fault injection ------------------------------------------------------------------


def _msg(cmd: int, payload: bytes) -> bytes:
    return struct.pack("<BQ", cmd, len(payload)) + payload


def _set_tensor(data: bytes) -> bytes:
    # | rpc_tensor (296) | cache_flag | offset u64 | data |, header bytes all 0xAB
    from linkctl.lab.rpcstream import SET_TENSOR_HEADER

    return _msg(6, b"\xab" * SET_TENSOR_HEADER + data)


def _feed_all(parser, stream: bytes, step: int) -> bytes:
    return b"".join(parser.feed(stream[i : i + step]) for i in range(0, len(stream), step))


def _diff_bits(a: bytes, b: bytes) -> list[int]:
    return [
        i * 8 + k
        for i, (x, y) in enumerate(zip(a, b, strict=True))
        for k in range(8)
        if (x ^ y) >> k & 1
    ]


def test_corruption_flips_only_tensor_data_at_the_rate_and_chunking_does_not_matter():
    from linkctl.lab.rpcstream import SET_TENSOR_HEADER, Corruption

    data = bytes(200_000)
    stream = _msg(14, bytes(24)) + _set_tensor(data) + _msg(10, b"\xcd" * 500) + _set_tensor(data)
    outs = {}
    for step in (1_000_003, 4096, 997):
        c = Corruption("set_tensor", 1e-4, seed=7)
        out = _feed_all(_RpcParser(c), stream, step)
        outs[step] = out
        assert len(out) == len(stream)
        flipped = _diff_bits(stream, out)
        assert c.bits == len(flipped) and c.messages == 2
        assert c.payload_bytes == 2 * len(data)
        # Every flip is in a SET_TENSOR's data: never framing, tensor header, other commands.
        first = 9 + 24 + 9 + SET_TENSOR_HEADER
        second = first + len(data) + 9 + 500 + 9 + SET_TENSOR_HEADER
        for b in flipped:
            assert (
                first * 8 <= b < (first + len(data)) * 8
                or second * 8 <= b < (second + len(data)) * 8
            )
        # 3.2 M bits at 1e-4: 320 expected; 5 sigma either way
        assert 230 < c.bits < 410, c.bits
    assert outs[1_000_003] == outs[4096] == outs[997]  # same seed, same flips, any chunking


def test_weights_target_stops_at_the_first_graph_compute():
    from linkctl.lab.rpcstream import Corruption

    data = bytes(50_000)
    stream = _set_tensor(data) + _msg(10, bytes(100)) + _set_tensor(data)
    c = Corruption("weights", 1e-3, seed=1)
    out = _RpcParser(c).feed(stream)
    flipped = _diff_bits(stream, out)
    assert flipped and c.messages == 1
    assert max(flipped) < len(_set_tensor(data)) * 8


def test_get_tensor_results_are_corrupted_and_other_responses_are_not():
    from linkctl.lab.rpcstream import Corruption, _ResponseParser

    owed = collections.deque()
    c = Corruption("get_tensor", 1e-2, seed=3)
    req = _RpcParser(c, owed)
    # HELLO (answered), SET_TENSOR (not answered), GET_DEVICE_MEMORY, GET_TENSOR: answered
    up = _msg(14, bytes(24)) + _set_tensor(bytes(64)) + _msg(11, bytes(4)) + _msg(8, bytes(312))
    assert req.feed(up) == up  # requests are left alone for this target
    assert list(owed) == [14, 11, 8]
    hello = struct.pack("<Q", 28) + bytes(28)
    mem = struct.pack("<Q", 16) + bytes(16)
    tensor = struct.pack("<Q", 4096) + bytes(4096)
    down = hello + mem + tensor
    out = _feed_all(_ResponseParser(c, owed), down, 100)
    flipped = _diff_bits(down, out)
    start = (len(hello) + len(mem) + 8) * 8
    assert flipped and all(b >= start for b in flipped), flipped[:5]
    assert not owed


def test_cli_bad_corruption_rate_exit_2(capsys):
    args = ["--listen", "198.18.100.2:1", "--target", "198.18.100.2:2", "--corrupt", "get_tensor"]
    assert main([*args, "--corrupt-rate", "0"]) == 2
    assert "--corrupt-rate 0: must be in (0, 1]" in capsys.readouterr().err


def test_realtime_is_this_process_only():
    """--realtime: SCHED_FIFO for the proxy process (a child here), the caller untouched."""
    import os

    if os.geteuid() != 0 and os.environ.get("CI") != "true":
        pytest.skip("SCHED_FIFO needs root")
    code = (
        "import os; from linkctl.lab.delayproxy import realtime; "
        "print(realtime(), os.sched_getscheduler(0) == os.SCHED_FIFO)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["SCHED_FIFO", "10", "True"]
    assert os.sched_getscheduler(0) == os.SCHED_OTHER


def test_due_chunks_leave_in_one_write_and_none_before_its_release():
    """The writer sends every chunk already due with the one it woke for (one write, as a
    wire delivers back-to-back bytes) and holds a later one until its own release; the
    trace records each chunk's release and write times."""
    import socket

    from linkctl.lab.delayproxy import DelayProxy, _Pipe

    proxy = DelayProxy(("127.0.0.1", 0), ("127.0.0.1", 9), 5.0)
    src, _src_peer = socket.socketpair()
    dst, dst_peer = socket.socketpair()
    pipe = _Pipe(proxy, src, dst, False, {})
    now = time.monotonic()
    recs = [["s2c", now, 1, now + dt, 0.0, ""] for dt in (-0.002, -0.001, 0.005)]
    for rec, data in zip(recs, (b"a", b"b", b"c"), strict=True):
        pipe.q.append((rec[3], data, rec))
    pipe.closed = True
    pipe._write()  # drains the queue in this thread, then shuts dst down
    assert recs[0][4] == recs[1][4] < recs[2][4]
    assert all(rec[4] >= rec[3] for rec in recs)
    got = b""
    while chunk := dst_peer.recv(16):
        got += chunk
    assert got == b"abc"
    assert proxy.stats.late_chunks == 3
    for s in (src, _src_peer, dst, dst_peer):
        s.close()
