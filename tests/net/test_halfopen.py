"""linkctl.net.halfopen on real kernels: a connection the peer still holds after this
side forgot it (its reset lost while the link was down) is ended by one SYN from the
same local end, and an end still in use here is left alone.

The peer is a server like rpc-server: one client at a time, a blocking recv, no
keepalive (it logs each accept and how each connection ended)."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

pytestmark = pytest.mark.netns

PORT = 50052
SERVER = """
import json, socket, sys, time
srv = socket.socket()
srv.bind((sys.argv[1], int(sys.argv[2])))
srv.listen(1)
print(json.dumps({"listening": True}), flush=True)
while True:
    c, a = srv.accept()
    who = "%s:%d" % a
    print(json.dumps({"accepted": who, "t": time.monotonic()}), flush=True)
    try:
        while c.recv(4096):
            pass
        how = "eof"
    except OSError as e:
        how = e.strerror
    print(json.dumps({"ended": who, "how": how, "t": time.monotonic()}), flush=True)
    c.close()
"""
CLIENT = """
import json, socket, struct, subprocess, sys, time
from linkctl.net.halfopen import reset_from
peer, port, iface = sys.argv[1], int(sys.argv[2]), sys.argv[3]
remote = f"{peer}:{port}"
out = {}
def say(**kw):
    print(json.dumps(kw), flush=True)

# 1. A client connects, then forgets the connection while the link drops every packet
#    it sends (a tbf whose burst is smaller than any packet): its reset (SO_LINGER 0)
#    goes nowhere, and the server still holds the connection.
c = socket.create_connection((peer, port), timeout=5)
ghost = "%s:%d" % c.getsockname()
time.sleep(0.3)
tbf = ["tc", "qdisc", "add", "dev", iface, "root", "tbf", "rate", "8bit", "burst", "10",
       "limit", "1"]
subprocess.run(tbf, check=True)
c.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
c.close()
time.sleep(0.3)
subprocess.run(["tc", "qdisc", "del", "dev", iface, "root"], check=True)
# 2. A newcomer waits behind it (connected by the kernel, not accepted).
n = socket.create_connection((peer, port), timeout=5)
time.sleep(1.0)
n.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
n.close()
say(ghost=ghost, before_reset=time.monotonic())
# 3. A live connection's end is in use here: nothing is sent from it.
live = socket.create_connection((peer, port), timeout=5)
say(live="%s:%d" % live.getsockname())
say(live_end=reset_from("%s:%d" % live.getsockname(), remote))
# 4. The SYN from the forgotten end, then again once the server let it go.
say(first=reset_from(ghost, remote))
time.sleep(1.5)
say(second=reset_from(ghost, remote))
time.sleep(0.5)
live.sendall(b"still here")
say(live_sent=True)
live.close()
"""


def lines(text: str) -> list[dict]:
    return [json.loads(ln) for ln in text.splitlines() if ln.strip()]


def test_a_forgotten_connection_is_ended_by_a_syn_from_its_end(lab):
    for host in ("dgx", "mac"):
        assert lab.run(host, "setup").returncode == 0
    peer = lab.host("dgx")["address"].split("/")[0]
    iface = lab.host("mac")["interface"]
    server = subprocess.Popen(
        ["ip", "netns", "exec", lab.netns("dgx"), sys.executable, "-c", SERVER, peer, str(PORT)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert json.loads(server.stdout.readline()) == {"listening": True}
        r = subprocess.run(
            ["ip", "netns", "exec", lab.netns("mac"), sys.executable, "-c", CLIENT, peer,
             str(PORT), iface],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert r.returncode == 0, r.stderr
        time.sleep(0.5)
    finally:
        server.terminate()
        served, _ = server.communicate(timeout=10)
    got = {k: v for d in lines(r.stdout) for k, v in d.items()}
    log = lines(served)
    ghost = got["ghost"]
    # Before the SYN: the server still waited on the forgotten connection.
    ended = [d for d in log if d.get("ended") == ghost]
    assert ended and ended[0]["t"] > got["before_reset"], (got, log)
    assert not [d for d in log if d.get("accepted") not in (None, ghost)
                and d["t"] < got["before_reset"]], log  # fmt: skip
    assert got["live_end"] == "in use", got
    # The first SYN: the peer's challenge ACK, this kernel's reset, the held connection
    # gone; the SYN itself answered at once by the listener (Linux), or at its
    # retransmission after a second, past the wait ("sent").
    assert got["first"] in ("answered", "sent"), got
    assert ended[0]["how"] == "Connection reset by peer", log
    # Then the listener answers a SYN from that end: nothing is held there any more.
    assert got["second"] == "answered", got
    # The server went on to the waiting clients, the live one among them, untouched.
    assert got["live_sent"] is True
    live = [d for d in log if d.get("ended") == got["live"]]
    assert live and live[0]["how"] == "eof", log  # served, then closed by its client
