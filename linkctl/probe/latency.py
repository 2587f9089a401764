"""Step 4: TCP request/response round trip against the peer's responder.

One connection, TCP_NODELAY, source bound to our link address; per size a
warm-up, then ``samples`` timed exchanges of ``size`` bytes out and the same
``size`` bytes back, each timed with time.perf_counter_ns.
"""

from __future__ import annotations

import math
import socket
import statistics
import time
from typing import Any

from pydantic import ValidationError

from linkctl.core.errors import InputError
from linkctl.core.records import ResponderInfo, RttStats
from linkctl.probe.responder import SERVICE
from linkctl.trust import session
from linkctl.trust.secret import PairSecret

SIZES = (1, 32 * 1024, 128 * 1024)
# The banner is one JSON line: a few hundred bytes, with a calibration's terms under 1 KiB.
MAX_BANNER = 16 * 1024


class ResponderUnavailable(InputError):
    """The peer's responder cannot be reached, or something else answers there (exit 2)."""

    def __init__(self, message: str, fix: str | None = None):
        super().__init__(
            message,
            fix
            or "run `linkctl responder` on the peer (its boot service does), on the same "
            "probe.responder_port",
        )


def stats_us(ns: list[int]) -> RttStats:
    """min/p50/p90/p99/max/stddev in microseconds (nearest-rank percentiles)."""
    s = sorted(ns)
    n = len(s)

    def pct(p: float) -> float:
        return s[max(0, math.ceil(p / 100 * n) - 1)] / 1000

    return RttStats(
        min_us=round(s[0] / 1000, 1),
        p50_us=round(pct(50), 1),
        p90_us=round(pct(90), 1),
        p99_us=round(pct(99), 1),
        max_us=round(s[-1] / 1000, 1),
        stddev_us=round(statistics.pstdev(s) / 1000, 1) if n > 1 else 0.0,
        samples=n,
    )


class EchoClient:
    def __init__(
        self,
        peer_ip: str,
        port: int,
        src_ip: str | None,
        timeout_s: float,
        secret: PairSecret,
        peer_name: str = "peer",
    ):
        self.where = f"{peer_name} ({peer_ip}:{port})"
        try:
            sock = socket.create_connection(
                (peer_ip, port), timeout=timeout_s, source_address=(src_ip, 0) if src_ip else None
            )
        except ConnectionRefusedError:
            raise ResponderUnavailable(
                f"responder not running on {self.where}: connection refused; "
                f"start `linkctl responder` on {peer_name}"
            ) from None
        except TimeoutError:
            raise ResponderUnavailable(
                f"responder on {self.where} did not accept within {timeout_s:g} s"
            ) from None
        except OSError as e:
            raise ResponderUnavailable(
                f"cannot reach the responder on {self.where}: {e.strerror or e}"
            ) from None
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.settimeout(timeout_s)
        self.sock = sock
        self.banner = self._banner(secret)

    def _banner(self, secret: PairSecret) -> dict[str, Any]:
        """The banner, after both ends proved the pair secret (unbuffered reads: the
        echo that follows reads the socket itself)."""
        try:
            with self.sock.makefile("rb", buffering=0) as rfile:
                ch = session.connect(self.sock, rfile, secret.key, SERVICE, self.where)
                info = ch.recv()
        except session.AuthError as e:
            self.close()
            raise ResponderUnavailable(
                f"{e.message} (is it a linkctl responder on probe.responder_port?)",
                "both hosts need one pair secret: compare `linkctl key show` on each",
            ) from None
        except OSError as e:
            self.close()
            raise ResponderUnavailable(f"{self.where}: {e.strerror or e}") from None
        if info.get("service") != SERVICE:
            self.close()
            raise ResponderUnavailable(
                f"{self.where} answers but is not a linkctl responder; check probe.responder_port"
            )
        return info

    def measure(self, size: int, samples: int, warmup: int) -> list[int]:
        sock = self.sock
        out = b"x" * size
        buf = bytearray(max(size, 1))
        view = memoryview(buf)
        sendall, recv_into, clock = sock.sendall, sock.recv_into, time.perf_counter_ns
        times: list[int] = []
        try:
            for i in range(warmup + samples):
                t0 = clock()
                sendall(out)
                got = 0
                while got < size:
                    n = recv_into(view[got:])
                    if not n:
                        raise ResponderUnavailable(f"{self.where} closed the connection")
                    got += n
                t1 = clock()
                if i >= warmup:
                    times.append(t1 - t0)
        except TimeoutError:
            raise ResponderUnavailable(
                f"{self.where} stopped echoing ({size}-byte exchange timed out)"
            ) from None
        except OSError as e:
            raise ResponderUnavailable(f"{self.where}: {e.strerror or e}") from None
        return times

    def close(self) -> None:
        self.sock.close()


def measure_rtt(
    peer_ip: str,
    port: int,
    src_ip: str | None,
    *,
    secret: PairSecret,
    samples: int,
    timeout_s: float,
    sizes: tuple[int, ...] = SIZES,
    peer_name: str = "peer",
    warmup: int | None = None,
) -> tuple[dict[str, RttStats], ResponderInfo]:
    """({size: stats}, responder banner). Raises ResponderUnavailable."""
    warm = warmup if warmup is not None else max(50, samples // 10)
    client = EchoClient(peer_ip, port, src_ip, timeout_s, secret, peer_name)
    try:
        res = {str(size): stats_us(client.measure(size, samples, warm)) for size in sizes}
    finally:
        client.close()
    return res, banner_info(client.banner, f"{peer_name} ({peer_ip}:{port})")


def banner_info(banner: dict[str, Any], where: str) -> ResponderInfo:
    """The banner as a record. The peer's calibration is a courtesy: one this linkctl
    cannot read is dropped (the probe still measures), the rest must be a banner."""
    try:
        return ResponderInfo.model_validate(banner)
    except ValidationError:
        pass
    try:
        return ResponderInfo.model_validate({k: v for k, v in banner.items() if k != "calibration"})
    except ValidationError as e:
        raise ResponderUnavailable(
            f"{where} sent a responder banner this linkctl cannot read "
            f"({e.errors()[0]['loc']}: {e.errors()[0]['msg']})",
            "run the same linkctl release on both hosts",
        ) from None
