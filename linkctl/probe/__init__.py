"""`linkctl probe`: verify and measure the link before serving.

Steps, in order, each adding checks to a ProbeReport; a step that makes the
rest meaningless stops the probe with a one-line reason:

1. local NIC facts (probe.nic)       no carrier / no address: stop, exit 1
2. peer ARP + pinned MAC (probe.peer) no reply / wrong MAC: stop, exit 1
3. path MTU, DF echo (probe.mtu)     mismatch: FAIL, continue (TCP adapts)
4. TCP RTT + ICMP RTT (probe.latency) responder unreachable: stop, exit 2
5. iperf3 both ways, P1 and P4 (probe.throughput) cannot run: stop, exit 2
6. llama.cpp RPC HELLO + device memory (linkctl.llama.rpc) nothing listening: SKIP
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from linkctl.core.checks import Verdict
from linkctl.core.errors import InputError, Timeout
from linkctl.core.profile import HostSpec, Profile
from linkctl.core.records import RpcPart
from linkctl.probe.report import ProbeReport

__all__ = ["ProbeReport", "choose_peers", "probe_again", "run_probe"]


def choose_peers(profile: Profile, host: HostSpec, peer: str | None = None) -> list[HostSpec]:
    """--peer NAME; else for the head every rpc host in order, for an rpc host the head."""
    if peer:
        if peer == host.name:
            raise InputError(f"--peer {peer!r} is this host", "name another host of the profile")
        return [profile.host(peer)]
    if host.role == "head":
        return list(profile.rpc_hosts)
    return [profile.head]


def probe_again(
    profile: Profile, host: HostSpec, peer: HostSpec, backend: Any
) -> tuple[ProbeReport, Path]:
    """A full probe of ``peer``, saved as `linkctl probe` saves it: what serve's gate runs
    when the report it would gate on has aged (it needs root, as probe does)."""
    from linkctl.probe.report import save

    report = run_probe(profile, host, peer, backend)
    return report, save(report)


def latency_threshold_us(size: int, max_rtt_p99_us: float, min_gbps: float) -> float:
    """Allowed p99 for a ``size``-byte exchange: the 1-byte limit plus the time the
    bytes take both ways at the profile's minimum throughput."""
    return round(max_rtt_p99_us + 2 * size * 8 / (min_gbps * 1000), 1)


def run_probe(
    profile: Profile,
    host: HostSpec,
    peer: HostSpec,
    backend: Any,
    *,
    duration_s: float | None = None,
    samples: int | None = None,
    throughput: bool = True,
    on_iperf: Callable[[str, int], None] | None = None,
) -> ProbeReport:
    """Probe ``peer`` from ``host``; never raises for a link problem (they become checks)."""
    spec = profile.probe
    report = ProbeReport(profile.name, host.name, peer.name, peer.ip)
    t0 = time.perf_counter()
    try:
        _steps(
            report,
            profile,
            host,
            peer,
            backend,
            duration_s=duration_s or spec.duration_s,
            samples=samples or spec.latency_samples,
            throughput=throughput,
            on_iperf=on_iperf,
        )
    finally:
        report.elapsed_s = time.perf_counter() - t0
    return report


def _steps(
    report: ProbeReport,
    profile: Profile,
    host: HostSpec,
    peer: HostSpec,
    backend: Any,
    *,
    duration_s: float,
    samples: int,
    throughput: bool,
    on_iperf: Callable[[str, int], None] | None,
) -> None:
    from linkctl.probe import latency, mtu, nic
    from linkctl.probe import peer as peer_mod
    from linkctl.probe import throughput as tp
    from linkctl.trust.secret import load as load_secret

    spec = profile.probe
    if not nic.check_nic(report, profile, host, backend):
        return
    if not peer_mod.check_peer(report, host, peer, spec.timeout_s):
        return
    mtu.check_path_mtu(report, backend, peer, profile.link.mtu, spec.timeout_s)

    # ---- latency
    try:
        tcp, banner = latency.measure_rtt(
            peer.ip,
            spec.responder_port,
            host.ip,
            secret=load_secret(profile.name),
            samples=samples,
            timeout_s=spec.timeout_s,
            peer_name=peer.name,
        )
    except InputError as e:  # the responder away or refusing, or no pair secret here
        report.add("tcp rtt", Verdict.SKIP, None, spec.max_rtt_p99_us, e.message)
        report.stop(e.message, e.exit_code)
        return
    report.latency.tcp = tcp
    report.latency.responder = banner
    for size, st in tcp.items():
        n = int(size)
        if n == 1:
            limit, bad = spec.max_rtt_p99_us, Verdict.FAIL
        else:
            limit = latency_threshold_us(n, spec.max_rtt_p99_us, spec.min_throughput_gbps)
            bad = Verdict.WARN
        verdict = Verdict.PASS if st.p99_us is not None and st.p99_us <= limit else bad
        report.add(
            f"tcp rtt {_size(n)}",
            verdict,
            st.p99_us,
            limit,
            f"value is p99 (us); p50 {st.p50_us} us, {st.samples} samples",
        )
    mtu.check_icmp_rtt(report, backend, peer, spec.timeout_s, spec.max_rtt_p99_us)

    # ---- throughput
    if not throughput:
        report.add(
            "throughput", Verdict.SKIP, None, spec.min_throughput_gbps, "skipped (--no-throughput)"
        )
    elif not banner.iperf_running:
        msg = f"the responder on {peer.name} runs no iperf3 server (iperf3 missing on {peer.name}?)"
        report.add("throughput", Verdict.SKIP, None, spec.min_throughput_gbps, msg)
        report.stop(msg, 2)
        return
    else:
        iperf_port = banner.iperf_port or spec.iperf_port
        try:
            report.throughput = tp.measure(
                backend.runner,
                peer.ip,
                host.ip,
                iperf_port,
                duration_s=duration_s,
                timeout_s=spec.timeout_s,
                on_run=on_iperf,
            )
        except tp.IperfError as e:
            report.add("throughput", Verdict.SKIP, None, spec.min_throughput_gbps, e.message)
            report.stop(e.message, e.exit_code)
            return
        for t in report.throughput.values():
            gbps = t.gbps or 0.0
            ok = gbps >= spec.min_throughput_gbps
            arrow = "->" if t.direction == "fwd" else "<-"
            report.add(
                f"throughput {arrow} P{t.streams}",
                Verdict.PASS if ok else Verdict.FAIL,
                t.gbps,
                spec.min_throughput_gbps,
                f"{gbps:.2f} Gbit/s{'' if ok else ' (below the minimum)'}, "
                f"{t.retransmits} retransmits, {t.seconds:g} s",
            )
    _check_rpc(report, peer, spec.timeout_s)


def _check_rpc(report: ProbeReport, peer: HostSpec, timeout_s: float) -> None:
    if peer.role != "rpc":
        report.add(
            "rpc", Verdict.SKIP, None, None, f"{peer.name} is the head: no rpc-server to ask"
        )
        return
    from linkctl.llama import rpc

    addr, port = peer.rpc_bind, peer.rpc.port
    try:
        with socket.create_connection((addr, port), timeout=timeout_s):
            pass
    except TimeoutError:
        # The peer answered the echo just now: a connect left unanswered is rpc-server's
        # full listen queue while one client (the head's llama-server) holds it.
        report.rpc = RpcPart(endpoint=f"{addr}:{port}", busy=True)
        report.add(
            "rpc", Verdict.WARN, None, None, f"{addr}:{port} busy: a client holds rpc-server"
        )
        return
    except OSError:
        report.add(
            "rpc",
            Verdict.SKIP,
            None,
            None,
            f"nothing listens on {addr}:{port} (rpc-server not started)",
        )
        return
    try:
        info = rpc.query(addr, port, timeout=timeout_s)
    except (rpc.RpcBusy, Timeout) as e:
        report.rpc = RpcPart(endpoint=f"{addr}:{port}", busy=True, error=e.message)
        report.add("rpc", Verdict.WARN, None, None, e.message)
        return
    except InputError as e:
        report.rpc = RpcPart(endpoint=f"{addr}:{port}", error=e.message)
        report.add("rpc", Verdict.FAIL, None, None, e.line())
        return
    report.rpc = RpcPart(endpoint=f"{addr}:{port}", **info.as_dict())
    mem = ", ".join(f"{dv.free / 2**30:.1f}/{dv.total / 2**30:.1f} GiB free" for dv in info.devices)
    report.add(
        "rpc",
        Verdict.PASS,
        info.version_str,
        None,
        f"protocol {info.version_str}, {len(info.devices)} device(s): {mem or 'none'}",
    )


def _size(n: int) -> str:
    return f"{n // 1024} KiB" if n >= 1024 else f"{n} B"
