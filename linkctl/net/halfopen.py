"""Ending a connection the peer still holds after this host's side of it is gone.

rpc-server serves one client at a time and waits on it with no keepalive
(ggml/src/ggml-rpc/ggml-rpc.cpp: accept, then a blocking recv per command). When the
head's llama-server closes its connection while the cable is out and the outage outlasts
the head kernel's FIN retries (net.ipv4.tcp_orphan_retries), the rpc host never learns it:
its rpc-server keeps waiting on that connection and every new client waits behind it.

A SYN from the same local end (address and port) reaches that connection: the peer's
kernel answers a SYN on an established connection with a challenge ACK (RFC 5961 4.2);
this kernel, in SYN-SENT, answers an ACK of something it never sent with a reset
carrying the ACK's number (RFC 793 3.9, SYN-SENT; RFC 9293 3.10.7.3), exactly in the
peer's window: the peer drops the connection (the half-open recovery of RFC 793 3.4,
figure 10), and rpc-server goes on to the next client. Where the peer holds no such
connection, the SYN opens a new one, closed unused with a reset before any byte. The end
must be free here: a socket of this host still on it (a live connection, or one still
closing) makes the bind fail, and nothing is sent.
"""

from __future__ import annotations

import errno
import select
import socket
import struct


def split_end(end: str) -> tuple[str, int]:
    host, port = end.rsplit(":", 1)
    return host, int(port)


def reset_from(local: str, remote: str, wait_s: float = 0.3) -> str:
    """One SYN from ``local`` to ``remote`` ("ip:port" each), then the socket reset.
    Returns what came of it:
      "in use"   ``local`` is taken here (or its address is gone): nothing sent;
      "lost"     it could not leave or was reported unreachable: tried again later;
      "answered" the peer's listener answered or refused: it holds nothing from that end
                 now (between two Linux kernels in the lab, already so for the SYN that
                 reset a held connection: tests/net/test_halfopen.py);
      "sent"     no answer within ``wait_s``: a held connection reset, the SYN itself
                 answered only at its retransmission."""
    try:
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    except OSError:  # out of descriptors: nothing sent, tried again later
        return "lost"
    try:
        try:
            s.bind(split_end(local))
        # In use, the address gone, or not an "ip:port" at all (a hand-edited status):
        # not ours to touch now.
        except (OSError, ValueError, OverflowError):
            return "in use"
        # Closed with a reset, not a FIN: nothing of it lingers on either side.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        s.setblocking(False)
        if s.connect_ex(split_end(remote)) not in (errno.EINPROGRESS, errno.EWOULDBLOCK):
            return "lost"  # no route now
        # The challenge ACK and the reset take one round trip; an answer ends the wait.
        p = select.poll()  # not select(): any descriptor number
        p.register(s, select.POLLOUT)
        if not p.poll(wait_s * 1000):
            return "sent"
        err = s.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
        return "answered" if err in (0, errno.ECONNREFUSED) else "lost"
    except OSError:
        return "lost"
    finally:
        s.close()
