"""The probe report: checks with verdicts plus every raw figure; JSON, Prometheus, on disk.

Each probe step builds its typed part (``linkctl.core.records``: NicPart, ArpPart, MtuPart,
LatencyPart, ThroughputRun, RpcPart) and sets it here; ``to_record`` puts those same
parts into the ``ProbeRecord`` that `probe --json` prints and ``estimate``, ``serve`` and
``doctor`` read back, stored where ``linkctl.core.records`` says.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from linkctl.core.checks import Check, Verdict
from linkctl.core.errors import InputError
from linkctl.core.paths import write_atomic
from linkctl.core.records import (
    ArpPart,
    LatencyPart,
    MtuPart,
    NicPart,
    ProbeRecord,
    RpcPart,
    ThroughputRun,
)


@dataclass
class ProbeReport:
    profile: str
    host: str
    peer: str
    peer_address: str
    time: str = field(default_factory=lambda: datetime.now(UTC).isoformat(timespec="seconds"))
    checks: list[Check] = field(default_factory=list)
    nic: NicPart = field(default_factory=NicPart)
    arp: ArpPart = field(default_factory=ArpPart)
    mtu: MtuPart = field(default_factory=MtuPart)
    latency: LatencyPart = field(default_factory=LatencyPart)
    throughput: dict[str, ThroughputRun] = field(default_factory=dict)  # by run name
    rpc: RpcPart | None = None
    # Why the probe stopped early (empty when it ran every step) and the exit code
    # that stop implies: 1 a check failed, 2 a step could not run.
    stopped: str = ""
    stop_code: int = 0
    elapsed_s: float = 0.0

    def add(
        self,
        name: str,
        verdict: Verdict,
        value: Any = None,
        threshold: Any = None,
        detail: str = "",
    ) -> Check:
        c = Check(name, verdict, value, threshold, detail)
        self.checks.append(c)
        return c

    def stop(self, reason: str, code: int) -> None:
        self.stopped, self.stop_code = reason, code

    @property
    def exit_code(self) -> int:
        if self.stop_code == 2:
            return 2
        if self.stop_code == 1 or any(c.verdict is Verdict.FAIL for c in self.checks):
            return 1
        return 0

    @property
    def ok(self) -> bool:
        return self.exit_code == 0

    def why_not(self) -> str:
        """Why the probe did not pass, in one line: the stop reason, else each failed
        check with its figure and limit ("" when it passed)."""
        return self.to_record().why_not()

    def to_record(self) -> ProbeRecord:
        """The parts as they are (not copied, not re-validated) in the record."""
        return ProbeRecord(
            profile=self.profile,
            host=self.host,
            peer=self.peer,
            peer_address=self.peer_address,
            time=self.time,
            ok=self.ok,
            exit_code=self.exit_code,
            stopped=self.stopped or None,
            elapsed_s=round(self.elapsed_s, 3),
            checks=list(self.checks),
            nic=self.nic,
            arp=self.arp,
            mtu=self.mtu,
            latency=self.latency,
            throughput=dict(self.throughput),
            rpc=self.rpc,
        )

    def to_json(self) -> dict[str, Any]:
        """What `probe --json` prints: the record, each part with what its step set."""
        return self.to_record().model_dump(exclude_unset=True)


# ---- on disk (linkctl.core.records owns where and how) ---------------------------------


def save(report: ProbeReport) -> Path:
    """Write the per-peer file and latest.json, and keep the peer's calibration its
    responder offered; returns the per-peer path."""
    from linkctl.core.log import speaker
    from linkctl.core.records import save_probe

    path = save_probe(report.to_record())
    say = speaker("probe")
    try:
        done = carry_calibration(report)
    except InputError as e:  # the report is saved; the calibration is a courtesy
        done = f"warning: the peer's calibration not stored: {e.line()}"
    if done:
        say(done)
    return path


def carry_calibration(report: ProbeReport) -> str | None:
    """Store the calibration the peer's responder sent as the peer's record in this
    host's calibration file, so serve, verify and route here use both hosts' terms.
    Only a banner that names the peer this probe meant counts; a record equal to the
    one kept changes nothing. Returns what it did, for the log (None: nothing)."""
    from linkctl.core.records import calibration_of, save_calibration

    banner = report.latency.responder
    if banner is None or banner.calibration is None or banner.host != report.peer:
        return None
    got = banner.calibration
    kept = calibration_of(report.peer)
    if kept is not None and kept.terms() == got:
        return None
    save_calibration(report.peer, got)
    return f"calibration of {report.peer} (measured {got.measured_at}) stored"


# ---- Prometheus textfile ------------------------------------------------------------


def _labels(d: dict[str, Any]) -> str:
    def esc(v: Any) -> str:
        return str(v).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")

    return "{" + ",".join(f'{k}="{esc(v)}"' for k, v in d.items()) + "}"


_METRICS: dict[str, tuple[str, str]] = {
    "linkctl_probe_ok": ("gauge", "1 when every probe check passed"),
    "linkctl_probe_exit_code": (
        "gauge",
        "probe exit code: 0 pass, 1 a check failed, 2 could not run",
    ),
    "linkctl_probe_timestamp_seconds": ("gauge", "when the probe ran (unix time)"),
    "linkctl_probe_duration_seconds": ("gauge", "wall time of the probe"),
    "linkctl_probe_check_ok": ("gauge", "1 when the check passed or warned, 0 on FAIL, -1 skipped"),
    "linkctl_probe_link_speed_mbps": ("gauge", "negotiated link speed"),
    "linkctl_probe_mtu_bytes": ("gauge", "local interface MTU"),
    "linkctl_probe_path_mtu_ok": ("gauge", "1 when a DF echo at MTU-28 bytes got through"),
    "linkctl_probe_tcp_rtt_microseconds": ("gauge", "TCP request/response round trip"),
    "linkctl_probe_icmp_rtt_microseconds": ("gauge", "ICMP echo round trip"),
    "linkctl_probe_throughput_gbps": ("gauge", "iperf3 received throughput"),
    "linkctl_probe_retransmits": ("gauge", "iperf3 sender TCP retransmits"),
    "linkctl_probe_rpc_device_free_bytes": ("gauge", "llama.cpp rpc-server device free memory"),
    "linkctl_probe_rpc_device_total_bytes": ("gauge", "llama.cpp rpc-server device total memory"),
}


def _number(value: float | int) -> str:
    """A sample's value exactly as the report has it: integers as integers (byte counts
    past 2**53, the timestamp), floats at repr precision (round-trips), never ``%g``'s
    six digits (a timestamp as 1.79641e+09 is up to ~5000 s off)."""
    if isinstance(value, int):  # bool included
        return str(int(value))
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value))


def to_prometheus(reports: list[ProbeReport]) -> str:
    """Every figure of every report, in the text exposition format (HELP/TYPE once)."""
    samples: dict[str, list[str]] = {k: [] for k in _METRICS}

    def put(name: str, labels: dict[str, Any], value: float | int | None) -> None:
        if value is None:
            return
        samples[name].append(f"{name}{_labels(labels)} {_number(value)}")

    for r in reports:
        base = {"profile": r.profile, "host": r.host, "peer": r.peer}
        put("linkctl_probe_ok", base, int(r.ok))
        put("linkctl_probe_exit_code", base, r.exit_code)
        # The report's time is to the second: so is the sample, as an integer.
        ts = round(datetime.fromisoformat(r.time).timestamp())
        put("linkctl_probe_timestamp_seconds", base, ts)
        put("linkctl_probe_duration_seconds", base, round(r.elapsed_s, 3))
        for c in r.checks:
            v = {Verdict.PASS: 1, Verdict.WARN: 1, Verdict.FAIL: 0, Verdict.SKIP: -1}[c.verdict]
            put("linkctl_probe_check_ok", {**base, "check": c.name, "verdict": c.verdict}, v)
        put("linkctl_probe_link_speed_mbps", base, r.nic.speed_mbps)
        put("linkctl_probe_mtu_bytes", base, r.nic.mtu)
        if r.mtu.df_ok is not None:
            put("linkctl_probe_path_mtu_ok", base, int(r.mtu.df_ok))
        for size, st in r.latency.tcp.items():
            for q, key in (
                ("0", "min_us"),
                ("0.5", "p50_us"),
                ("0.9", "p90_us"),
                ("0.99", "p99_us"),
                ("1", "max_us"),
            ):
                put(
                    "linkctl_probe_tcp_rtt_microseconds",
                    {**base, "size_bytes": size, "quantile": q},
                    getattr(st, key),
                )
        if r.latency.icmp is not None:
            for stat in ("min", "avg", "max"):
                put(
                    "linkctl_probe_icmp_rtt_microseconds",
                    {**base, "stat": stat},
                    getattr(r.latency.icmp, f"{stat}_us"),
                )
        for t in r.throughput.values():
            lab = {**base, "direction": t.direction, "streams": t.streams}
            put("linkctl_probe_throughput_gbps", lab, t.gbps)
            put("linkctl_probe_retransmits", lab, t.retransmits)
        for i, d in enumerate(r.rpc.devices if r.rpc else []):
            lab = {**base, "device": i}
            put("linkctl_probe_rpc_device_free_bytes", lab, d.free)
            put("linkctl_probe_rpc_device_total_bytes", lab, d.total)
    out = []
    for name, (kind, help_) in _METRICS.items():
        if samples[name]:
            out += [f"# HELP {name} {help_}", f"# TYPE {name} {kind}", *samples[name]]
    return "\n".join(out) + "\n"


def write_prometheus(path: str | Path, reports: list[ProbeReport]) -> Path:
    """Write atomically (node_exporter's textfile collector may read at any moment)."""
    p = Path(path)
    if not p.parent.is_dir():
        raise InputError(
            f"--prom {path}: directory {p.parent} does not exist",
            "create it or point --prom at node_exporter's textfile directory",
        )
    try:
        write_atomic(p, to_prometheus(reports))
    except OSError as e:
        raise InputError(
            f"--prom {path}: cannot write: {e}", "check the path's permissions"
        ) from None
    return p
