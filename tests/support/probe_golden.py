"""Probe reports built by the real probe steps (``linkctl.probe.run_probe``) from fixed
answers, so their serialisation can be compared byte for byte across a change of the
report builder: what ``probe --json`` prints and what the state file holds.

The answers stand in for what the OS and the peer said (a fake backend whose runner
answers ping and iperf3 with their real output formats, ARP, the responder's banner
and echo times, psutil's counters, the rpc-server's HELLO); every step, check and figure in
between is the probe's own code. tests/fixtures/probe/ holds the texts the builder
wrote before its parts became typed (commit 5e3fbb1); ``PYTHONPATH=tests python -m
support.probe_golden DIR`` writes them again. LinkFacts.kind, added since, was put into
each nic block by hand ("wired"), the rest left as the builder wrote it then.
"""

from __future__ import annotations

import io
import json
import sys
from contextlib import ExitStack, redirect_stdout
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

from linkctl.core.profile import load_profile
from linkctl.core.runner import Result
from linkctl.net.netstate import LinkFacts
from linkctl.probe import run_probe
from linkctl.probe.report import ProbeReport
from support.paths import FIXTURES as TEST_FIXTURES

FIXTURES = TEST_FIXTURES / "probe"
TIME = "2026-12-03T18:00:00+00:00"
MAC_DGX = "aa:bb:cc:dd:ee:02"

_PING_OK = (
    "PING {ip} ({ip}) {size}({total}) bytes of data.\n"
    "{lines}\n"
    "--- {ip} ping statistics ---\n"
    "{n} packets transmitted, {n} received, 0% packet loss, time 19ms\n"
    "rtt min/avg/max/mdev = 0.051/0.074/0.132/0.017 ms\n"
)
_PING_TOO_LONG = (
    "PING {ip} ({ip}) {size}({total}) bytes of data.\n"
    "ping: local error: message too long, mtu=9000\n\n"
    "--- {ip} ping statistics ---\n"
    "1 packets transmitted, 0 received, +1 errors, 100% packet loss, time 0ms\n"
)
_PING_LOST = (
    "PING {ip} ({ip}) {size}({total}) bytes of data.\n\n"
    "--- {ip} ping statistics ---\n"
    "1 packets transmitted, 0 received, 100% packet loss, time 0ms\n"
)


class _Runner:
    """ping and iperf3 as iputils and iperf3 -J answer them; ``path_mtu``: the largest
    DF packet the path carries."""

    def __init__(self, path_mtu: int = 9000, iperf_error: str | None = None):
        self.path_mtu, self.iperf_error = path_mtu, iperf_error

    def which(self, name: str) -> str:
        return f"/usr/bin/{name}"

    def run(self, argv, timeout=None, check=True, **_kw) -> Result:
        argv = [str(a) for a in argv]
        if argv[0] == "ping":
            return self._ping(argv)
        if argv[0] == "iperf3":
            return self._iperf(argv)
        raise AssertionError(f"unexpected command {argv}")

    def _ping(self, argv: list[str]) -> Result:
        ip = argv[-1]
        size = int(argv[argv.index("-s") + 1]) if "-s" in argv else 56
        n = int(argv[argv.index("-c") + 1])
        fmt = dict(ip=ip, size=size, total=size + 28, n=n)
        if size + 28 > 9000:
            return Result(tuple(argv), 1, _PING_TOO_LONG.format(**fmt), "")
        if size + 28 > self.path_mtu:
            return Result(tuple(argv), 1, _PING_LOST.format(**fmt), "")
        lines = "\n".join(
            f"{size + 8} bytes from {ip}: icmp_seq={i} ttl=64 time=0.0{50 + i} ms"
            for i in range(1, n + 1)
        )
        return Result(tuple(argv), 0, _PING_OK.format(lines=lines + "\n", **fmt), "")

    def _iperf(self, argv: list[str]) -> Result:
        if self.iperf_error:
            return Result(tuple(argv), 1, json.dumps({"error": self.iperf_error}), "")
        streams = int(argv[argv.index("-P") + 1])
        rev = "-R" in argv
        bps = 9.41e9 if streams == 4 else (9.1234e9 if rev else 8.7654e9)
        recv = {"bits_per_second": bps, "bytes": int(bps / 8), "seconds": 1.000123}
        if rev:
            del recv["seconds"]  # the report falls back to the whole seconds asked for
        sent = {"bits_per_second": bps * 1.001, "retransmits": 7 * streams}
        return Result(
            tuple(argv), 0, json.dumps({"end": {"sum_received": recv, "sum_sent": sent}}), ""
        )


class _Backend:
    def __init__(self, runner: _Runner, facts: LinkFacts):
        self.runner, self.facts = runner, facts

    def link_facts(self, ifname: str) -> LinkFacts:
        return self.facts

    def ping_argv(self, address: str, **kw):
        from linkctl.net.ping import linux_ping_argv

        return linux_ping_argv(address, **kw)


def _facts(host) -> LinkFacts:
    return LinkFacts(
        ifname=host.interface,
        up=True,
        carrier=True,
        mtu=9000,
        mac="aa:bb:cc:dd:ee:01",
        addresses=(str(host.address),),
        speed_mbps=10000,
        duplex="full",
        min_mtu=68,
        max_mtu=9216,
        owner="networkmanager",
        owner_detail="linkctl-en0",
        kind="wired",
    )


def _banner(peer_ip: str) -> dict:
    return {
        "service": "linkctl-responder",
        "protocol": 1,
        "address": peer_ip,
        "port": 50051,
        "iperf_port": 5201,
        "iperf_running": True,
        "iperf_pid": 4242,
        "iperf_restarts": 0,
    }


class _Echo:
    """Stands in for latency.EchoClient: the responder's banner, and per size the
    round-trip times (ns) the echoes took."""

    def __init__(self, peer_ip: str, *a, **kw):
        self.banner = _banner(peer_ip)

    def measure(self, size: int, samples: int, warmup: int) -> list[int]:
        return [40_000 + 97 * i + size // 8 for i in range(samples)][::-1]

    def close(self) -> None:
        pass


def build(name: str) -> ProbeReport:
    """One scenario's report, built by run_probe."""
    from linkctl.llama import rpc
    from linkctl.trust.secret import PairSecret

    prof, _ = load_profile("dgx-mac")
    host, peer = prof.host("mac"), prof.host("dgx")
    path_mtu = 1500 if name == "mtu-mismatch" else 9000
    iperf_error = (
        "the server is busy running a test. try again later" if name == "iperf-busy" else None
    )
    runner = _Runner(path_mtu, iperf_error)
    macs = {"address-conflict": [MAC_DGX, "aa:bb:cc:dd:ee:09"]}.get(name, [MAC_DGX])

    def who_has(*a, **kw):
        if name == "arp-permission":
            from linkctl.core.errors import PermissionDenied

            raise PermissionDenied(
                "no permission for raw sockets (ARP)", "run as root or grant CAP_NET_RAW"
            )
        return macs

    class _Sock:
        def __enter__(self):
            return self

        def __exit__(self, *a):
            return False

    def connect(*a, **kw):
        if name == "rpc-none":
            raise ConnectionRefusedError(111, "Connection refused")
        return _Sock()

    def query(addr, port, timeout=3.0):
        if name == "rpc-busy":
            raise rpc.RpcBusy(
                f"rpc endpoint {addr}:{port} accepted but did not answer HELLO",
                endpoint=f"{addr}:{port}",
            )
        return rpc.RpcInfo(
            addr,
            port,
            (3, 0, 0),
            "empty",
            [rpc.DeviceMemory(free=120 * 2**30, total=128 * 2**30)],
            elapsed_ms=1.7,
        )

    with ExitStack() as st:
        st.enter_context(mock.patch("linkctl.net.arp.who_has", who_has))
        clock = iter([100.0, 100.0123])  # the ARP step's start and end: 12.3 ms
        st.enter_context(
            mock.patch("linkctl.probe.peer.time", SimpleNamespace(perf_counter=lambda: next(clock)))
        )
        st.enter_context(
            mock.patch(
                "linkctl.probe.nic.counters",
                lambda ifname: {"errin": 0, "errout": 0, "dropin": 3, "dropout": 0},
            )
        )
        st.enter_context(mock.patch("linkctl.probe.latency.EchoClient", _Echo))
        # _Echo stands in for the authenticated responder, so no secret is proved.
        secret = PairSecret(bytes(32), "golden")
        st.enter_context(mock.patch("linkctl.trust.secret.load", lambda _profile: secret))
        st.enter_context(mock.patch("linkctl.probe.socket.create_connection", connect))
        st.enter_context(mock.patch("linkctl.llama.rpc.query", query))
        st.enter_context(mock.patch("linkctl.probe.throughput.busy_wait_s", lambda: 0.0))
        report = run_probe(
            prof,
            host,
            peer,
            _Backend(runner, _facts(host)),
            duration_s=1.0,
            samples=1000,
            throughput=name != "no-throughput",
        )
    report.time, report.elapsed_s = TIME, 4.2
    return report


SCENARIOS = (
    "clean",
    "mtu-mismatch",
    "arp-permission",
    "address-conflict",
    "no-throughput",
    "iperf-busy",
    "rpc-none",
    "rpc-busy",
)


def texts(name: str) -> tuple[str, str]:
    """(what `probe --json` prints, what the state file holds) for one scenario."""
    from linkctl.core.output import print_json
    from linkctl.core.records import dump

    report = build(name)
    out = io.StringIO()
    with redirect_stdout(out):
        print_json(report.to_json())  # as `linkctl probe --json` prints one report
    return out.getvalue(), dump(report.to_record())


def main(out: str) -> None:
    d = Path(out)
    d.mkdir(parents=True, exist_ok=True)
    for name in SCENARIOS:
        printed, saved = texts(name)
        (d / f"{name}.json").write_text(printed)
        (d / f"{name}.saved.json").write_text(saved)


if __name__ == "__main__":
    main(sys.argv[1])
