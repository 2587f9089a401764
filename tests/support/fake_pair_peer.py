"""A hostile or odd `linkctl pair` peer, run inside a lab namespace:

    python -m support.fake_pair_peer IFNAME MODE EXTRA_JSON SECONDS

MODE: hello (an announcement, EXTRA_JSON's fields over a valid one's; "clock_s" shifts
its send time), oversized
(a valid announcement padded past the limit), garbage (not JSON). It announces to
ff02::1 on IFNAME every 0.3 s for SECONDS."""

from __future__ import annotations

import contextlib
import json
import socket
import sys
import time

from linkctl import __version__
from linkctl.pair.wire import GROUP, PORT


def main() -> int:
    ifname, mode, extra, seconds = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), sys.argv[4]
    ann = {
        "protocol": 1, "linkctl": __version__, "nonce": "f" * 32, "key_share": "e" * 64,
        "host": "fake", "os": "linux",
        "interface": ifname, "mac": "02:00:00:00:00:99", "accelerator": "", "memory_gb": 512.0,
        "usable_gb": 500.0, "max_mtu": 9000, "networks": [],
    }  # fmt: skip
    sent = time.time() + extra.pop("clock_s", 0.0)  # a clock that far off
    ann.update(extra)
    msg = {"linkctl_pair": "hello", "sent": sent, "ann": ann}
    if mode == "oversized":
        msg["pad"] = "x" * 6000
    data = b"\x00garbage" if mode == "garbage" else json.dumps(msg).encode()
    s = socket.socket(socket.AF_INET6, socket.SOCK_DGRAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_BINDTODEVICE, ifname.encode())
    idx = socket.if_nametoindex(ifname)
    s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_MULTICAST_IF, idx)
    end = time.monotonic() + float(seconds)
    while time.monotonic() < end:
        with contextlib.suppress(OSError):  # DAD not done yet: the next round
            s.sendto(data, (GROUP, PORT, 0, idx))
        time.sleep(0.3)
    return 0


if __name__ == "__main__":
    sys.exit(main())
