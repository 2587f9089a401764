"""Time to first token and end-to-end time for one prompt: local, layer split and
disaggregated, on top of the estimate's device model (linkctl/estimate/cost.py).

    local          TTFT = prompt / prefill_tok_s(head alone) + t_token(head)
    layer split    TTFT = prompt / prefill_tok_s(split)      + t_token(split)
    disaggregated  TTFT = prompt / prefill_tok_s(prefill host alone)
                        + KV file bytes / link throughput          (the transfer)
                        + 2 x KV file bytes / STATE_IO_GBS          (save + restore)
                        + DISAGG_FIXED_S                           (HTTP calls, round trips)
                        + t_token(head)                            (the last prompt token again)
    every plan     total = TTFT + (output - 1) x t_token(the decoding device(s))

KV file bytes come from the GGUF header: per prompt token, every layer's K and V rows
(head_count_kv x (key_length + value_length) x 2 bytes, f16 cache) plus the token id
and the cell's position/sequence record that llama_state_seq_save_file writes
(src/llama-kv-cache.cpp state_write_meta/state_write_data).

The threshold is the shortest prompt for which disaggregated TTFT beats local TTFT.
Prefill time is prompt / prefill_tok_s, but never less than one decode step of the
same device (a forward pass reads every weight once, however short the prompt).
"""

from __future__ import annotations

import dataclasses
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from linkctl.core.errors import InputError
from linkctl.estimate.notes import Note, NoteKind, texts

if TYPE_CHECKING:
    from linkctl.gguf.info import ModelInfo

# Bytes per cell besides the K/V rows: the token id in the slot's token list (4) and
# the cell's pos + n_seq_id (4 + 4). Plus a fixed header per file.
KV_CELL_EXTRA_BYTES = 12
KV_FILE_HEADER_BYTES = 4096
# Save (write) and restore (read) of the slot file through the page cache: assumption,
# checked by bench/disagg.py (it prints the measured save/restore times).
STATE_IO_GBS = 2.0
# Fixed cost of one disaggregated request besides the transfer: the save, restore and
# the extra HTTP request, each a few round trips: assumption checked by bench/disagg.py.
DISAGG_FIXED_S = 0.010


# GGUF header keys of a recurrent state, "{arch}.<prefix>..." (llama.cpp llama-arch.cpp):
# LLM_KV_SSM_* (mamba, mamba2, and the hybrids: jamba, falcon-h1, granite-hybrid,
# nemotron-h, qwen3next), LLM_KV_WKV_* (the rwkv family), LLM_KV_SHORTCONV_* (lfm2).
RECURRENT_KEY_PREFIXES = ("ssm.", "wkv.", "shortconv.")


@dataclass(frozen=True)
class RestoreRisk:
    """Why llama-server's slot restores are known not to take for a model: the restore
    reports success and the next request prefills the whole prompt again. A slot file
    holds the KV cells and tokens but no context checkpoint, and llama-server reuses a
    sliding-window or recurrent cache only from a checkpoint (llama.cpp #25913, #26676,
    #27813, #28194). route notices it in the decode server's timings and stops
    transferring for the model (linkctl.disagg.router); this says so before serving."""

    architecture: str
    kind: str  # sliding-window, recurrent, hybrid
    evidence: str  # the header key that shows it

    def text(self) -> str:
        return (
            f"{self.architecture} is a {self.kind} model ({self.evidence}): llama-server's "
            "slot restores are known to reuse nothing for it (llama.cpp #25913, #26676, "
            "#27813, #28194), so a disaggregated request pays the transfer and a full "
            "prefill on the decode host; route sees it and stops transferring after "
            "a few in a row"
        )


def restore_risk(model: ModelInfo) -> RestoreRisk | None:
    """The RestoreRisk of a model, from its GGUF header; None for full attention."""
    arch = model.architecture
    prefixes = tuple(f"{arch}.{p}" for p in RECURRENT_KEY_PREFIXES)
    state = sorted(k for k in model.metadata if k.startswith(prefixes))
    if state:
        attends = any(
            t.name.endswith((".attn_q.weight", ".attn_qkv.weight")) for t in model.tensors
        )
        return RestoreRisk(arch, "hybrid" if attends else "recurrent", state[0])
    if model.sliding_window:
        where = f"{arch}.attention.sliding_window = {model.sliding_window}"
        return RestoreRisk(arch, "sliding-window", where)
    return None


def kv_file_bytes(model, n_tokens: int) -> int:
    per_token = model.block_count * model.kv_bytes_per_token_per_layer + KV_CELL_EXTRA_BYTES
    return KV_FILE_HEADER_BYTES + n_tokens * per_token


@dataclass
class PlanTime:
    name: str  # local, split, disaggregated
    ttft_s: float
    total_s: float
    prefill_s: float
    decode_tok_s: float
    transfer_s: float = 0.0
    kv_bytes: int = 0
    fits: bool = True
    terms_s: dict[str, float] = field(default_factory=dict)
    # ttft_s's interval: the prefill and first-token times at the ends of their ranges
    # (linkctl.estimate.ranges), the KV move as predicted.
    ttft_s_low: float = 0.0
    ttft_s_high: float = 0.0


@dataclass
class DisaggEstimate:
    prompt_tokens: int
    output_tokens: int
    plans: list[PlanTime]
    winner_ttft: str
    winner_total: str
    threshold_tokens: int | None  # shortest prompt where disaggregated TTFT wins; None: never
    prefill_host: str
    decode_host: str
    link_gbps: float
    notes: list[Note] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self) | {"notes": texts(self.notes)}


def _prefill_s(sc, n: int) -> float:
    """Prefill time of n tokens; never less than one decode step: a forward pass reads
    every weight at least once, however few the tokens."""
    return max(n / sc.prefill_tok_s, sc.decode_us / 1e6)


def _first_token_span(sc, n: int) -> tuple[float, float]:
    """(short, long) prefill + first-token time of an n-token prompt: the scenario's
    rates at the high and the low end of their ranges."""
    return (
        max(n / sc.prefill_tok_s_high, 1 / sc.decode_tok_s_high) + 1 / sc.decode_tok_s_high,
        max(n / sc.prefill_tok_s_low, 1 / sc.decode_tok_s_low) + 1 / sc.decode_tok_s_low,
    )


def _alone(model, p, ctx: int, ngl: int, n_prompt: int):
    """The estimate's scenario for host ``p`` serving alone; None when the model does
    not fit it (disaggregation needs the whole model on each host)."""
    from linkctl.estimate.cost import estimate

    try:
        sc = estimate(
            model, [dataclasses.replace(p, role="head")], None, ctx, ngl=ngl, n_prompt=n_prompt
        ).local
    except InputError:
        return None
    return sc if sc is not None and sc.fits else None


def predict(
    model,
    parts: list,
    link,
    ctx: int,
    n_prompt: int,
    n_out: int,
    prefill_host: str,
    ngl: int = 99,
) -> DisaggEstimate:
    """Uses linkctl.estimate.cost.estimate() for the head alone, the layer split and the
    prefill host alone; adds the KV transfer."""
    from linkctl.estimate.cost import estimate

    if n_prompt < 1 or n_out < 1:
        raise InputError(
            f"prompt {n_prompt}, output {n_out}: both must be at least 1", "e.g. --prompt 2048"
        )
    if link is None:
        raise InputError("disaggregation needs link figures", "run `linkctl probe` or pass them")
    head = next(p for p in parts if p.role == "head")
    pre = next(p for p in parts if p.host == prefill_host)
    # Decode is costed at the middle of the output (the KV cache it reads grows).
    depth = min(ctx, n_prompt + n_out // 2)
    est = estimate(model, parts, link, ctx, ngl=ngl, n_prompt=n_prompt, depth=depth)
    alone = _alone(model, pre, ctx, ngl, n_prompt)
    plans = []
    for name, sc in (("local", est.local), ("split", est.split)):
        if sc is None:
            continue
        prefill = _prefill_s(sc, n_prompt)
        tok = sc.decode_us / 1e6
        short, long = _first_token_span(sc, n_prompt)
        plans.append(
            PlanTime(
                name,
                prefill + tok,
                prefill + n_out * tok,
                prefill,
                sc.decode_tok_s,
                fits=sc.fits,
                terms_s={"prefill": prefill, "first token": tok, "decode": (n_out - 1) * tok},
                ttft_s_low=short,
                ttft_s_high=long,
            )
        )
    assert est.local is not None
    notes = list(est.warnings)
    risk = restore_risk(model)
    if risk is not None:
        notes.append(Note(NoteKind.DISAGGREGATED, f"disaggregated: {risk.text()}"))
    if alone is None or not est.local.fits:
        notes.append(
            Note(
                NoteKind.DISAGGREGATED,
                "disaggregated: the model does not fit each host alone (both hold all of it)",
            )
        )
    else:
        kv = kv_file_bytes(model, n_prompt)
        wire = kv * 8 / (link.throughput_gbps * 1e9)
        io = 2 * kv / (STATE_IO_GBS * 1e9)
        prefill = _prefill_s(alone, n_prompt)
        tok = est.local.decode_us / 1e6
        transfer = wire + io + DISAGG_FIXED_S
        pre_short, pre_long = _first_token_span(alone, n_prompt)
        # The first token is the head's: its own decode step, not the prefill host's.
        own_tok = 1 / alone.decode_tok_s_high, 1 / alone.decode_tok_s_low
        head_tok = 1 / est.local.decode_tok_s_high, 1 / est.local.decode_tok_s_low
        plans.append(
            PlanTime(
                "disaggregated",
                prefill + transfer + tok,
                prefill + transfer + n_out * tok,
                prefill,
                est.local.decode_tok_s,
                transfer_s=transfer,
                kv_bytes=kv,
                terms_s={
                    f"prefill on {pre.host}": prefill,
                    "KV over the link": wire,
                    "save + restore": io,
                    "fixed": DISAGG_FIXED_S,
                    "first token": tok,
                    "decode": (n_out - 1) * tok,
                },
                ttft_s_low=pre_short - own_tok[0] + transfer + head_tok[0],
                ttft_s_high=pre_long - own_tok[1] + transfer + head_tok[1],
            )
        )
    fitting = [p for p in plans if p.fits] or plans
    return DisaggEstimate(
        prompt_tokens=n_prompt,
        output_tokens=n_out,
        plans=plans,
        winner_ttft=min(fitting, key=lambda p: p.ttft_s).name,
        winner_total=min(fitting, key=lambda p: p.total_s).name,
        threshold_tokens=threshold(model, head, pre, link, ctx, ngl),
        prefill_host=pre.host,
        decode_host=head.host,
        link_gbps=link.throughput_gbps,
        notes=notes,
    )


def _ttft_gain(model, head, pre, link, ctx: int, ngl: int, n: int) -> float:
    """Local TTFT minus disaggregated TTFT for an n-token prompt (> 0: disaggregate)."""
    loc, alone = _alone(model, head, ctx, ngl, n), _alone(model, pre, ctx, ngl, n)
    if loc is None or alone is None:
        return float("-inf")
    kv = kv_file_bytes(model, n)
    transfer = kv * 8 / (link.throughput_gbps * 1e9) + 2 * kv / (STATE_IO_GBS * 1e9)
    return _prefill_s(loc, n) - (_prefill_s(alone, n) + transfer + DISAGG_FIXED_S)


def threshold(model, head, pre, link, ctx: int, ngl: int = 99) -> int | None:
    """The shortest prompt (tokens, up to ctx) where disaggregated TTFT beats local;
    None when it never does (e.g. the prefill host is not faster)."""
    if _ttft_gain(model, head, pre, link, ctx, ngl, ctx) <= 0:
        return None
    lo, hi = 1, ctx  # gain(hi) > 0; find the smallest such n
    while lo < hi:
        mid = (lo + hi) // 2
        if _ttft_gain(model, head, pre, link, ctx, ngl, mid) > 0:
            hi = mid
        else:
            lo = mid + 1
    return lo


@dataclass
class Threshold:
    tokens: int | None
    source: str


def threshold_for_profile(profile, model_path: str | None) -> Threshold:
    """route's threshold from the profile's devices, the probe report's link figures
    and the model header; when any is missing, None with the reason."""
    from linkctl.estimate.run import link_figures, participants
    from linkctl.gguf.info import read_model

    try:
        if not model_path or not Path(model_path).is_file():
            raise InputError(f"model {model_path!r} not found")
        model = read_model(model_path)
        parts, _notes = participants(profile)
        link = link_figures(None, None, None)
        pre = profile.prefill_host.name
        head = next(p for p in parts if p.role == "head")
        prefill = next(p for p in parts if p.host == pre)
        t = threshold(model, head, prefill, link, profile.serve.ctx, profile.serve.ngl)
    except InputError as e:
        return Threshold(None, f"default (no estimate: {e.message})")
    if t is None:
        return Threshold(
            profile.serve.ctx + 1, "estimate: disaggregation never wins for this pair (off)"
        )
    return Threshold(
        t, f"estimate for {pre} -> {profile.head.name} at {link.throughput_gbps:g} Gbit/s"
    )


def predict_for_profile(
    profile,
    model_path: str | Path,
    *,
    prompt: int,
    output: int,
    probe: Path | None = None,
    rtt_us: float | None = None,
    throughput_gbps: float | None = None,
    calibration: list[Path] | None = None,
    ctx: int | None = None,
) -> DisaggEstimate:
    """predict() with the profile's devices (and calibrations) and the link figures
    from the probe report or the what-if flags, as `linkctl estimate` gets them."""
    from linkctl.estimate.run import link_figures, participants
    from linkctl.gguf.info import read_model

    model = read_model(model_path)
    parts, notes = participants(profile, False, calibration)
    link = link_figures(probe, rtt_us, throughput_gbps)
    out = predict(
        model,
        parts,
        link,
        profile.serve.ctx if ctx is None else ctx,
        prompt,
        output,
        profile.prefill_host.name,
        profile.serve.ngl,
    )
    out.notes += notes
    return out
