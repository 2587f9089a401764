"""The records one stage hands to the next, and the one place they are stored.

The records, each a pydantic model with a ``schema_version``:

- ``ProbeRecord``  written by ``linkctl probe``: state_dir()/probe/<profile>--<host>--<peer>.json
  and, for the last peer probed, state_dir()/probe/latest.json;
- ``CalibrationFile`` (one ``CalibrationRecord`` per host) written by ``linkctl calibrate``:
  state_dir()/calibration.json;
- ``ServeStatus`` written by the supervisor of ``linkctl serve``: state_dir()/serve/<role>.json,
  with its ``WatchRecord`` (``RouteStatus`` for route, which has no supervisor of its own:
  serve/route.json);
- ``Fingerprint`` (verify's reference run, the canary's yardstick):
  serve/fingerprint-<profile>-<key>.json, and ``CanaryRecord`` (the last canary):
  serve/canary.json.

Readers (estimate, serve, doctor, the demo) load them here and use attributes; a file
that is not JSON, has another ``schema_version`` or the wrong shape is an InputError
(exit 2) naming the file, never a traceback. A file without ``schema_version`` is
read as version 1: the format is the one written before the field existed.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from linkctl.core.checks import Check, Verdict, failed_text
from linkctl.core.errors import InputError
from linkctl.core.paths import state_dir, write_atomic

SCHEMA_VERSION = 1


class _Part(BaseModel):
    # Parts keep every figure the stage measured, named here or not, so `--json`
    # output and the file on disk keep what they held before these models.
    model_config = ConfigDict(extra="allow")


class Record(_Part):
    schema_version: int = SCHEMA_VERSION

    @model_validator(mode="after")
    def _always_written(self) -> Record:
        # dump() leaves out what was never set; the version is always written.
        self.model_fields_set.add("schema_version")
        return self


R = TypeVar("R", bound=Record)


# ---- probe -----------------------------------------------------------------------


# The probe's parts, each built by its step (linkctl/probe/) and handed on as is.
# Fields are declared in the order the steps fill them, so a part's JSON reads in that
# order both in `probe --json` and in the saved file.


class NicPart(_Part):
    """Step 1: linkctl.net.netstate.LinkFacts of the interface, plus psutil's counters."""

    ifname: str | None = None
    up: bool | None = None
    carrier: bool | None = None
    mtu: int | None = None
    mac: str | None = None
    addresses: list[str] = Field(default_factory=list)
    speed_mbps: int | None = None
    duplex: str | None = None
    min_mtu: int | None = None
    max_mtu: int | None = None
    owner: str | None = None
    owner_detail: str | None = None
    media: str | None = None
    counters: dict[str, int] | None = None


class ArpPart(_Part):
    """Step 2: who answered ARP for the peer (``error`` instead when ARP could not run)."""

    mac: str | None = None
    macs: list[str] = Field(default_factory=list)
    pinned: str | None = None
    elapsed_ms: float | None = None
    error: str | None = None


class MtuPart(_Part):
    """Step 3: the don't-fragment echo at ``payload`` bytes (``mtu`` - IP and ICMP headers)."""

    mtu: int | None = None
    payload: int | None = None
    df_ok: bool | None = None
    df_over_blocked: bool | None = None
    detail: str = ""
    path_mtu_at_least: int | None = None


class RttStats(_Part):
    """linkctl.probe.latency.stats_us: one payload size's round trips, nearest-rank."""

    min_us: float | None = None
    p50_us: float | None = None
    p90_us: float | None = None
    p99_us: float | None = None
    max_us: float | None = None
    stddev_us: float | None = None
    samples: int | None = None


class WeightRate(_Part):
    """A quantized ggml type's read rate `linkctl calibrate` measured on a given model:
    GB/s, and as a factor of the record's bandwidth (the estimate's bw_gbs then)."""

    factor: float
    gbs: float
    model: str
    together: list[str] = Field(default_factory=list)  # the types the model read together


class CalibrationRecord(_Part):
    """The terms `linkctl calibrate` measured on one host (plus the raw runs)."""

    host: str | None = None
    device: str | None = None
    measured_at: str | None = None
    model_name: str | None = None
    # The llama-server build measured (its --version line): `linkctl up` calibrates
    # again when the host's build is another one.
    build: str | None = None
    layer_us: float | None = None
    effective_bandwidth_gbs: float | None = None
    effective_tflops: float | None = None
    rpc_effective_bandwidth_gbs: float | None = None
    rpc_overhead_us: float | None = None
    # The quantized types of the given model(s), by ggml type name (linkctl.calibrate.solve);
    # None when no given model was quantized (and then absent from the terms).
    weight_rates: dict[str, WeightRate] | None = None

    def terms(self) -> CalibrationRecord:
        """The record without its raw runs: what the responder hands the peer (the
        estimate reads only the terms)."""
        return CalibrationRecord.model_validate(
            self.model_dump(include=set(CalibrationRecord.model_fields), exclude_none=True)
        )


class ResponderInfo(_Part):
    """The banner the peer's `linkctl responder` sends on connect (probe.responder.info),
    with the peer's own calibration when it has one: how a calibration reaches the other
    host of the pair (the probe stores it, see probe.report.save)."""

    service: str | None = None
    protocol: int | None = None
    address: str | None = None
    port: int | None = None
    iperf_port: int | None = None
    iperf_running: bool = False
    iperf_pid: int | None = None
    iperf_restarts: int | None = None
    host: str | None = None
    calibration: CalibrationRecord | None = None


class IcmpStats(_Part):
    """linkctl.net.ping.PingSummary of the ICMP cross-check."""

    sent: int = 0
    received: int = 0
    min_us: float | None = None
    avg_us: float | None = None
    max_us: float | None = None
    stddev_us: float | None = None


class LatencyPart(_Part):
    """Step 4. By payload size in bytes, as the JSON keys are: {"1": {...}, "32768": {...}}."""

    tcp: dict[str, RttStats] = Field(default_factory=dict)
    udp: dict[str, RttStats] = Field(default_factory=dict)
    responder: ResponderInfo | None = None
    icmp: IcmpStats | None = None

    def smallest(self) -> tuple[float, str] | None:
        """The p50 RTT of the smallest payload measured (TCP before UDP) and its label."""
        for kind in ("tcp", "udp"):
            sizes = sorted(
                (int(k), v) for k, v in getattr(self, kind).items() if k.isdigit() and v.p50_us
            )
            if sizes:
                size, v = sizes[0]
                return float(v.p50_us or 0.0), f"{kind} {size}-byte p50"
        return None


class ThroughputRun(_Part):
    """Step 5: one iperf3 run (linkctl.probe.throughput.run_iperf)."""

    gbps: float | None = None
    retransmits: int | None = None
    direction: str | None = None
    streams: int | None = None
    # iperf3's own seconds, else the whole seconds asked for (-t takes an integer).
    seconds: float | int | None = None
    bytes: int | None = None
    sender_gbps: float | None = None


class RpcDevice(_Part):
    free: int
    total: int


class RpcPart(_Part):
    """Step 6: the peer's rpc-server (linkctl.llama.rpc.RpcInfo), or why it could not answer."""

    endpoint: str | None = None
    busy: bool | None = None
    error: str | None = None
    host: str | None = None
    port: int | None = None
    version: str | None = None
    hello_format: str | None = None
    devices: list[RpcDevice] = Field(default_factory=list)
    elapsed_ms: float | None = None


class ProbeRecord(Record):
    # Who and when may be absent: `linkctl estimate --probe FILE` takes a report that
    # holds only latency and throughput figures; the serve gate skips a record without
    # a time.
    profile: str = ""
    host: str = ""
    peer: str = ""
    peer_address: str = ""
    time: str = ""
    ok: bool = False
    exit_code: int = 0
    stopped: str | None = None
    elapsed_s: float = 0.0
    checks: list[Check] = Field(default_factory=list)
    nic: NicPart = Field(default_factory=NicPart)
    arp: ArpPart = Field(default_factory=ArpPart)
    mtu: MtuPart = Field(default_factory=MtuPart)
    latency: LatencyPart = Field(default_factory=LatencyPart)
    # By run name (fwd_p1, rev_p1, fwd_p4, ...); a run that could not be measured
    # holds its reason instead of figures.
    throughput: dict[str, ThroughputRun | Any] = Field(default_factory=dict)
    rpc: RpcPart | None = None

    @property
    def timestamp(self) -> float | None:
        return parse_time(self.time)

    @property
    def failed(self) -> list[str]:
        return [c.name for c in self.checks if c.verdict is Verdict.FAIL]

    def why_not(self) -> str:
        """Why it did not pass, in one line: the stop reason, else the failed checks with
        their figures and limits ("" when it passed)."""
        return self.stopped or failed_text(self.checks)

    def runs(self) -> dict[str, ThroughputRun]:
        return {k: v for k, v in self.throughput.items() if isinstance(v, ThroughputRun)}

    def first_throughput(self) -> tuple[float, str] | None:
        """The single-stream forward figure, else reverse, else any measured run."""
        runs = self.runs()
        for key in ("fwd_p1", "rev_p1", *runs):
            v = runs.get(key)
            if v is not None and v.gbps:
                return float(v.gbps), key
        return None


def parse_time(v: Any) -> float | None:
    """Unix time of an ISO-8601 string (naive means UTC) or a number; None if neither."""
    if isinstance(v, int | float):
        return float(v)
    if isinstance(v, str):
        try:
            dt = datetime.fromisoformat(v.replace("Z", "+00:00"))
        except ValueError:
            return None
        if dt.tzinfo is None:
            dt = dt.replace(tzinfo=UTC)
        return dt.timestamp()
    return None


def probe_dir() -> Path:
    return state_dir() / "probe"


def probe_path(profile: str, host: str, peer: str) -> Path:
    return probe_dir() / f"{profile}--{host}--{peer}.json"


def latest_probe_path() -> Path:
    return probe_dir() / "latest.json"


def save_probe(record: ProbeRecord) -> Path:
    """Write the per-peer file and latest.json; returns the per-peer path."""
    text = dump(record)
    path = probe_path(record.profile, record.host, record.peer)
    try:
        write_atomic(path, text)
        write_atomic(latest_probe_path(), text)
    except OSError as e:
        raise InputError(
            f"cannot save the probe report under {probe_dir()}: {e}",
            "run as the user owning the state directory or set LINKCTL_STATE_DIR",
        ) from None
    return path


def load_probe(path: Path) -> ProbeRecord:
    return load(ProbeRecord, path, "probe report", "run `linkctl probe` again")


def probe_records(directory: Path | None = None) -> list[tuple[Path, ProbeRecord]]:
    """Every readable probe record in the directory; files that are not one are skipped
    (a directory scan looks for the newest usable report, it does not judge the rest)."""
    d = directory or probe_dir()
    out = []
    if d.is_dir():
        for p in sorted(d.glob("*.json")):
            try:
                out.append((p, load_probe(p)))
            except InputError:
                continue
    return out


def latest_probe(
    profile: str,
    peer: str,
    peer_address: str | None = None,
    directory: Path | None = None,
) -> tuple[float, Path, ProbeRecord] | None:
    """The newest report for ``profile`` whose peer is ``peer`` (or, when given, whose
    peer address is ``peer_address``): (unix time, path, record), or None."""
    mine = []
    for path, r in probe_records(directory):
        if r.profile != profile:
            continue
        if r.peer != peer and (peer_address is None or r.peer_address != peer_address):
            continue
        t = r.timestamp
        if t is not None:
            mine.append((t, path, r))
    return max(mine, key=lambda x: x[0]) if mine else None


# ---- calibration -----------------------------------------------------------------


class CalibrationFile(Record):
    hosts: dict[str, CalibrationRecord] = Field(default_factory=dict)


def calibration_path() -> Path:
    return state_dir() / "calibration.json"


def _move_aside(path: Path) -> str:
    return f"move it aside (mv {path} {path}.old) and re-run `linkctl calibrate`"


def load_calibration_file(path: Path) -> CalibrationFile:
    return load(CalibrationFile, path, "calibration file", _move_aside(path))


def load_calibrations(extra: list[Path] | None = None) -> dict[str, CalibrationRecord]:
    """{host name: calibration record}, from this host's state dir plus any extra
    files (a calibration copied over from the other host); later files win."""
    out: dict[str, CalibrationRecord] = {}
    for p in [calibration_path(), *(extra or [])]:
        if not p.is_file():
            if p in (extra or []):
                raise InputError(f"--calibration {p}: no such file", "give a calibration.json")
            continue
        out.update(load_calibration_file(p).hosts)
    return out


def calibration_of(host: str) -> CalibrationRecord | None:
    """``host``'s record in this host's calibration file (None: no file, or no record)."""
    path = calibration_path()
    return load_calibration_file(path).hosts.get(host) if path.is_file() else None


def kept_calibrations() -> dict[str, CalibrationRecord]:
    """The other hosts' records that saving one keeps. A file that exists but is not a
    calibration file this linkctl reads (not JSON, another schema_version, another
    shape) is an InputError: replacing it would lose what it holds."""
    path = calibration_path()
    if not path.exists():
        return {}
    try:
        return load_calibration_file(path).hosts
    except InputError as e:
        raise InputError(f"{e.message}; calibrate will not replace it", e.fix) from None


def save_calibration(host: str, record: CalibrationRecord) -> Path:
    """Set ``host``'s record in this host's calibration file, keeping the others'.
    Refuses (InputError, nothing written) a file it cannot read: see kept_calibrations."""
    path = calibration_path()
    text = dump(CalibrationFile(hosts={**kept_calibrations(), host: record}))
    try:
        write_atomic(path, text)
    except OSError as e:
        raise InputError(
            f"cannot save the calibration to {path}: {e}",
            "run as the user owning the state directory or set LINKCTL_STATE_DIR",
        ) from None
    return path


# ---- serve status ----------------------------------------------------------------


class ServeStatus(Record):
    """What a supervisor (`linkctl serve`) last wrote about its child."""

    name: str
    pid: int
    argv: list[str]
    state: str = "starting"  # starting, waiting, ready, backoff, stopped, gave-up
    child_pid: int | None = None
    starts: int = 0
    last_exit: int | None = None
    last_reason: str | None = None
    started_at: str | None = None
    ready_at: str | None = None
    ready_after_s: float | None = None
    events: list[dict[str, Any]] = Field(default_factory=list)
    watch: WatchRecord | None = None  # the watch while it serves (linkctl/serve/watch.py)
    # Head: the local ends of llama-server's RPC connections by endpoint, kept across
    # restarts of serve (linkctl/serve/leftends.py).
    rpc_ends: dict[str, list[str]] = Field(default_factory=dict)


class WatchFinding(_Part):
    check: str  # carrier, speed, rtt, retransmits, rpc, stall, decode, canary, ping
    verdict: Verdict
    detail: str


class CanaryRecord(Record):
    """One canary run (linkctl/serve/canary.py): the served split's short greedy run
    against the fingerprint verify recorded. serve/canary.json holds the last one."""

    time: str
    verdict: Verdict
    detail: str
    why: str  # start, schedule, demand
    wall_s: float
    model: str


class WatchRecord(_Part):
    """The watch's verdict: the worst finding, since when, and the figures behind it."""

    verdict: Verdict = Verdict.PASS
    since: str
    reasons: list[str] = Field(default_factory=list)
    findings: list[WatchFinding] = Field(default_factory=list)
    figures: dict[str, float | int | str | None] = Field(default_factory=dict)
    mode: str = "split"  # split, alone (serve.on_fail = "fallback"), stopped
    mode_since: str | None = None
    mode_reason: str | None = None
    on_fail: str = "stop"
    interval_s: float
    checked_at: str
    ticks: int = 0
    link_held_s: float = 0.0  # how long the link has passed without a break
    canary: CanaryRecord | None = None


class Fingerprint(Record):
    """What the canary compares with: verify's reference run of the fixed prompts
    (token ids and top-k log-probabilities per position) for one model and profile."""

    profile: str
    model: str
    model_bytes: int
    model_mtime_ns: int
    recorded_at: str
    tolerance: dict[str, Any]  # linkctl.serve.logprobs.Tolerance, as_dict()
    logit_bias: list[list[int | bool]] = Field(default_factory=list)
    prompts: list[str]
    steps: list[list[dict[str, Any]]]  # per prompt, per position: a Step as a dict


def fingerprint_path(profile: str, model: str) -> Path:
    """One per profile and model path (the canary of the model serve runs, whatever
    else was verified since)."""
    import hashlib

    key = hashlib.sha256(model.encode()).hexdigest()[:12]
    return state_dir() / "serve" / f"fingerprint-{profile}-{key}.json"


def canary_path(root: Path | None = None) -> Path:
    return (root or state_dir()) / "serve" / "canary.json"


def save_record(record: Record, path: Path) -> Path:
    write_atomic(path, dump(record, exclude_unset=False))
    return path


def load_fingerprint(path: Path) -> Fingerprint:
    return load(Fingerprint, path, "canary fingerprint", "run `sudo linkctl verify` again")


def load_canary(path: Path) -> CanaryRecord:
    return load(CanaryRecord, path, "canary result", "run `sudo linkctl verify --canary`")


def status_path(role: str, root: Path | None = None) -> Path:
    """Where the supervisor of ``role`` (rpc, head, prefill, route) writes its status;
    ``root`` is another host's state dir (the lab's hosts)."""
    return (root or state_dir()) / "serve" / f"{role}.json"


def load_status(path: Path) -> ServeStatus:
    return load(ServeStatus, path, "serve status", "restart `linkctl serve`")


class RouteStatus(Record):
    """What disaggregated `linkctl serve` on the decode host writes once route listens
    (status_path("route")); removed when it starts again."""

    state: str = "ready"
    listen: str
    threshold_tokens: int
    threshold_source: str
    # By the decode server's model: restores that took, no-ops, in a row, and whether
    # route stopped transferring for it (linkctl.disagg.router.RestoreHealth).
    restores: dict[str, dict[str, Any]] = Field(default_factory=dict)


def load_route_status(path: Path) -> RouteStatus:
    return load(RouteStatus, path, "route status", "restart `linkctl serve`")


# ---- reading and writing -----------------------------------------------------------


def dump(record: BaseModel, exclude_unset: bool = True) -> str:
    """JSON text of ``record``. By default only what was set: a file holds the figures
    its stage gave, not a null for every field the model could name."""
    # fallback=str: a check's value may be any object (as json.dumps(default=str) did).
    return record.model_dump_json(indent=2, exclude_unset=exclude_unset, fallback=str) + "\n"


def parse(cls: type[R], data: Any, where: str, what: str, fix: str) -> R:
    """``data`` (parsed JSON) as ``cls``; InputError naming ``where`` if it is not one."""
    if not isinstance(data, dict):
        raise InputError(f"{what} {where}: not a linkctl {what} (not a JSON object)", fix)
    version = data.get("schema_version", SCHEMA_VERSION)
    if version != SCHEMA_VERSION:
        raise InputError(
            f"{what} {where}: schema_version {version!r}, this linkctl reads {SCHEMA_VERSION}",
            fix,
        )
    try:
        return cls.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        field = ".".join(map(str, err["loc"])) or "(top)"
        raise InputError(
            f"{what} {where}: not a linkctl {what} ({field}: {err['msg']})", fix
        ) from None


def load(cls: type[R], path: Path, what: str, fix: str) -> R:
    if not path.is_file():
        raise InputError(f"no {what} at {path}", fix)
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise InputError(f"{what} {path} is unreadable: {e}", fix) from None
    return parse(cls, data, str(path), what, fix)
