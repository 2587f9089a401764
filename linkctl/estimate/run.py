"""Gather what `linkctl estimate` needs (profile, probe report, calibrations, the
GGUF header) and call the pure model in linkctl.estimate.cost; linkctl.estimate.report
renders the result."""

from __future__ import annotations

from pathlib import Path

from linkctl.core.errors import InputError
from linkctl.core.profile import Profile, parse_split_spec
from linkctl.core.records import (
    ProbeRecord,
    latest_probe_path,
    load_calibrations,
    load_probe,
    parse,
)
from linkctl.estimate.builds import far_notes, local_build
from linkctl.estimate.catalog import apply_calibration, get_device, load_catalog, rpc_role
from linkctl.estimate.cost import GIB, Estimate, LinkFigures, Participant, estimate
from linkctl.estimate.layers import split_devices
from linkctl.estimate.notes import Note, NoteKind
from linkctl.estimate.serving import (
    SamplerSettings,
    ServedDecode,
    served,
    serving_overhead,
)


def probe_arg(path: Path) -> ProbeRecord:
    """--probe FILE: a saved report, or what `probe --json` printed (a list of reports,
    one per peer; the estimate takes one link's)."""
    import json

    fix = "give `linkctl probe --peer NAME --json` output or a saved report (<state dir>/probe/)"
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise InputError(f"--probe {path} is unreadable: {e}", fix) from None
    if isinstance(data, list):
        if len(data) != 1:
            raise InputError(f"--probe {path}: {len(data)} reports, one per peer", fix)
        data = data[0]
    return parse(ProbeRecord, data, str(path), "probe report", fix)


def link_figures(
    probe: Path | None, rtt_us: float | None, throughput_gbps: float | None
) -> LinkFigures:
    """Flags win; else the probe report. No report and no flags: exit 2."""
    for name, v in (("--rtt-us", rtt_us), ("--throughput-gbps", throughput_gbps)):
        if v is not None and v <= 0:
            raise InputError(f"{name} {v:g}: must be > 0", f"give a positive {name}")
    path = probe or latest_probe_path()
    report: ProbeRecord | None = None
    if path.is_file():
        report = probe_arg(path) if probe else load_probe(path)
    elif probe is not None:
        raise InputError(f"--probe {probe}: no such file", "give a `linkctl probe --json` report")
    if report is None and (rtt_us is None or throughput_gbps is None):
        raise InputError(
            f"no probe report at {path} and no --rtt-us/--throughput-gbps",
            "run `linkctl probe` first, or pass --rtt-us and --throughput-gbps",
        )
    src: list[str] = []

    def pick(given: float | None, read, what: str, flag: str) -> float:
        if given is not None:
            src.append(f"{what} from {flag}")
            return given
        got = read(report) if report is not None else None
        if got is None:
            raise InputError(
                f"probe report {path} has no {what} figures",
                f"re-run `linkctl probe` or pass {flag}",
            )
        src.append(f"{what} from {path} ({got[1]})")
        return got[0]

    rtt_us = pick(rtt_us, lambda r: r.latency.smallest(), "RTT", "--rtt-us")
    throughput_gbps = pick(
        throughput_gbps, ProbeRecord.first_throughput, "throughput", "--throughput-gbps"
    )
    return LinkFigures(rtt_us=rtt_us, throughput_gbps=throughput_gbps, source="; ".join(src))


def participants(
    prof: Profile, query_rpc: bool = False, calibration: list[Path] | None = None
) -> tuple[list[Participant], list[Note]]:
    catalog = load_catalog()
    cals = load_calibrations(calibration)
    notes: list[Note] = []
    out = []
    for i, h in enumerate(prof.hosts):
        dev = apply_calibration(get_device(catalog, h.device, f"hosts[{i}]"), cals.get(h.name))
        mem_gb = h.memory_gb or dev.memory_gb
        free = mem_gb * GIB * dev.usable_fraction
        free_src = (
            f"{'profile' if h.memory_gb else 'catalog'} memory_gb {mem_gb:g} x "
            f"usable {dev.usable_fraction:g}"
        )
        if query_rpc and h.role == "rpc":
            from linkctl.llama.rpc import query

            info = query(h.ip, h.rpc.port, timeout=3.0)
            if info.devices:
                free = float(sum(d.free for d in info.devices))
                free_src = f"rpc-server {h.rpc_endpoint} GET_DEVICE_MEMORY free"
        cal = cals.get(h.name)
        overhead = 0.0
        if h.role == "rpc":
            behind_rpc = rpc_role(dev, cal)
            if behind_rpc is not None:
                # Measured behind a loopback RPC boundary: the RPC processing cost is in it.
                dev = behind_rpc
            else:
                notes.append(
                    Note(
                        NoteKind.CALIBRATION,
                        f"{h.name}: not calibrated as an RPC device (run `linkctl calibrate "
                        "--rpc` there): RPC processing cost not counted",
                    )
                )
        if not dev.calibrated:
            built = dev.build or "build not recorded"
            bound = f"; on their physical bound: {', '.join(dev.on_bound)}" if dev.on_bound else ""
            notes.append(
                Note(
                    NoteKind.CALIBRATION,
                    f"{h.name}: catalog terms for {dev.key} "
                    f"({dev.fit.get('summary', 'catalog')}; llama.cpp {built}; not calibrated "
                    f"on this host){bound}",
                )
            )
        out.append(Participant(h.name, h.role, dev, free, free_src, overhead))
    return out, notes


def parse_split(text: str | None) -> str | list[float] | None:
    """--split as `linkctl serve --split` takes it: recommended, llama or weights."""
    if text is None:
        return None
    try:
        return parse_split_spec(text)
    except ValueError as e:
        raise InputError(f"--split {text!r}: {e}") from None


def run_estimate(
    prof: Profile,
    model_path: Path,
    *,
    probe: Path | None = None,
    split: str | list[float] | None = None,
    ctx: int | None = None,
    prompt: int = 512,
    rtt_us: float | None = None,
    throughput_gbps: float | None = None,
    query_rpc: bool = False,
    calibration: list[Path] | None = None,
    depth: int | None = None,
) -> Estimate:
    from linkctl.gguf.info import read_model

    model = read_model(model_path)
    if prompt < 1:
        raise InputError(f"--prompt {prompt}: must be at least 1", "e.g. --prompt 512")
    parts, notes = participants(prof, query_rpc, calibration)
    link = link_figures(probe, rtt_us, throughput_gbps) if prof.rpc_hosts else None
    n_ctx = prof.serve.ctx if ctx is None else ctx

    def predict(weights: list[float] | None) -> Estimate:
        return estimate(
            model, parts, link, n_ctx, weights, ngl=prof.serve.ngl, n_prompt=prompt, depth=depth
        )

    # "llama" is llama.cpp's own split: the estimate's split when no weights are given.
    est = predict(split if isinstance(split, list) else None)
    if split == "recommended":
        # What `serve --split recommended` runs: the recommended split's layer counts
        # as weights, so the split section predicts exactly that placement.
        if est.recommended is None:
            raise InputError(
                "--split recommended: no split to recommend (no rpc host, or no split of "
                f"{model_path.name} fits the devices' memory)",
                "drop --split to see the local prediction",
            )
        est = predict([float(c) for c in est.recommended.tensor_split])
    est.warnings += notes + far_notes(parts, local_build())
    est.model["split_order"] = [p.host for p in split_devices(parts)]
    return est


def served_for(
    prof: Profile, est: Estimate, settings: SamplerSettings | None = None
) -> ServedDecode:
    """What llama-server delivers for each of the estimate's scenarios (linkctl.estimate.
    serving): the per-token serving overhead at the model's vocabulary, the sampler
    settings (llama-server's defaults) and the estimate's -c, added to the predicted
    llama-bench decode."""
    scenarios = (("local", est.local), ("split", est.split), ("recommended", est.recommended))
    rows = {
        name: (sc.decode_tok_s, sc.decode_tok_s_low, sc.decode_tok_s_high)
        for name, sc in scenarios
        if sc is not None
    }
    # The head as the estimate priced it: calibrated or not (every scenario holds it).
    head_calibrated = any(
        d.calibrated for _, sc in scenarios if sc for d in sc.devices if d.host == prof.head.name
    )
    over = serving_overhead(int(est.model.get("vocab_size") or 0), settings, est.ctx)
    return served(rows, over, head_calibrated=head_calibrated)
