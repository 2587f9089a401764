"""The words of `linkctl estimate`: the models (linkctl.estimate.cost, linkctl.estimate.ttft)
return figures and a typed Advice; every sentence about them is made here, for the
terminal and for the text fields of --json."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from linkctl.core.output import console
from linkctl.estimate.advice import Advice, Because
from linkctl.estimate.cost import GIB, Estimate
from linkctl.estimate.notes import NoteKind
from linkctl.estimate.serving import ServedDecode
from linkctl.estimate.ttft import DisaggEstimate


def reason(v: Advice) -> str:
    """One sentence: why the estimate recommends what it does."""
    split = v.split_decode_tok_s
    match v.because:
        case Because.NO_RPC_HOST:
            return "no RPC host in the profile"
        case Because.HEAD_TOO_SMALL:
            return (
                f"the model needs {v.need_bytes / GIB:.1f} GiB and the head holds "
                f"{v.head_free_bytes / GIB:.1f} GiB"
            )
        case Because.SPLIT_FASTER:
            return f"split decode {split:.1f} tok/s vs local {v.local_decode_tok_s:.1f} tok/s"
        case Because.LOCAL_NOT_SLOWER:
            return (
                f"local decode {v.local_decode_tok_s:.1f} tok/s vs best split {split:.1f} "
                "tok/s: the link and the slower device cost more than they save"
            )


def as_json(est: Estimate, serving: DisaggEstimate | None) -> dict[str, Any]:
    """`estimate --json`: the model's figures, the reason sentence, the serving plans."""
    return est.as_dict() | {
        "reason": reason(est.advice),
        "serving": serving.as_dict() if serving else None,
    }


def _gib(b: float) -> str:
    return f"{b / GIB:.1f} GiB"


def render(est: Estimate) -> None:
    m = est.model
    moe = (
        f", MoE {m['expert_used_count']}/{m['expert_count']} experts per token"
        if m["expert_count"]
        else ""
    )
    console.print(
        f"[bold]{m['name'] or Path(m['path']).name}[/] ({m['architecture']}, "
        f"{m['block_count']} layers, {_gib(m['total_bytes'])} weights{moe})"
    )
    if est.link:
        console.print(
            f"link: RTT {est.link.rtt_us:.0f} µs, {est.link.throughput_gbps:.2f} Gbit/s "
            f"[dim]({est.link.source})[/]"
        )
    fits = "[green]yes[/]" if est.fits_head_alone else "[red]no[/]"
    local = est.local
    assert local is not None
    console.print(
        f"fits on the head alone at ctx {est.ctx}: {fits} "
        f"(needs {_gib(local.devices[0].need_bytes)}, has "
        f"{_gib(local.devices[0].free_bytes)})"
    )
    console.print()
    console.print(
        f"{'':22}{'decode tok/s (range)':>24}{'prefill tok/s (range)':>26}  split (layers+output)"
    )
    rows = [("local only", local)]
    if est.split:
        rows.append(("split (llama.cpp)", est.split))
    if est.recommended:
        rows.append(("split (recommended)", est.recommended))
    for label, sc in rows:
        note = "" if sc.fits else "  [red]does not fit[/]"
        split = ",".join(map(str, sc.tensor_split)) if sc.name != "local" else "-"
        dec = _ranged(sc.decode_tok_s, sc.decode_tok_s_low, sc.decode_tok_s_high, 1)
        pre = _ranged(sc.prefill_tok_s, sc.prefill_tok_s_low, sc.prefill_tok_s_high, 0)
        console.print(f"{label:22}{dec:>24}{pre:>26}  {split}{note}")
    console.print(
        f"[dim]decode at context position {est.depth} (--depth; default: right after the "
        f"--prompt); prefill of the --prompt tokens[/]"
    )
    console.print(
        "[dim](range): each device's time widened by how far the catalog was from published "
        f"figures it had not seen, four in five inside: {_range_basis(est)}[/]"
    )
    if est.split_gain:
        g, lo, hi = est.split_gain
        console.print(f"split gain (recommended / local decode): {g:.2f}x ({lo:.2f}-{hi:.2f})")
    full = f"at {est.ctx} (full)"
    console.print(f"{'decode tok/s by depth':22}{'at 0':>14}{full:>18}")
    for label, sc in rows:
        console.print(f"{label:22}{sc.decode_tok_s_depth0:>14.1f}{sc.decode_tok_s_full_ctx:>18.1f}")
    if est.split:
        s, link = est.split, est.link
        assert link is not None  # run_estimate passes link figures when there is an rpc host
        console.print()
        console.print(
            f"network per token: {s.network_us:.0f} µs = {s.round_trips_per_token} round trip(s) "
            f"x {link.rtt_us:.0f} µs + {s.bytes_crossing_per_token / 1024:.1f} KiB transfer "
            f"({s.network_transfer_us:.0f} µs)"
            + (f" + RPC overhead {s.network_overhead_us:.0f} µs" if s.network_overhead_us else "")
        )
        console.print(
            f"network per layer: {est.network_per_layer_us:.1f} µs; one layer decodes in "
            f"{est.layer_us:.0f} µs, so the link costs as much as {est.link_equiv_layers:.2f} "
            "layers per token"
        )
        console.print(f"[dim]{est.per_layer_derivation}[/]")
        console.print(
            f"dominant term (split): {s.dominant} "
            f"({s.terms_us[s.dominant]:.0f} µs of {s.decode_us:.0f} µs per token)"
        )
    if est.recommended:
        order = est.model.get("split_order", [])
        console.print(
            f"recommended --split {','.join(map(str, est.recommended.tensor_split))}"
            f" [dim](order: {', '.join(order)})[/]"
        )
    console.print()
    console.print(f"[bold]recommendation: {est.recommendation}[/] — {reason(est.advice)}")
    for w in est.warnings:
        console.print(f"[yellow]note:[/] {w.text}")


def _ranged(v: float, lo: float, hi: float, digits: int) -> str:
    return f"{v:.{digits}f} ({lo:.{digits}f}-{hi:.{digits}f})"


def _range_basis(est: Estimate) -> str:
    """Whose residuals each device's range comes from (linkctl.estimate.ranges)."""
    sc = est.recommended or est.split or est.local
    assert sc is not None
    return "; ".join(
        f"{d.host} {kind} ±{g['err']:.0%} ({g['pool']}, {g['n']} rows)"
        for d in sc.devices
        if d.slots
        for kind, g in d.ranges.items()
    )


def render_serving(de: DisaggEstimate) -> None:
    console.print(
        f"\nServing one request: {de.prompt_tokens} prompt tokens, {de.output_tokens} output "
        f"tokens (prefill on {de.prefill_host}, decode on {de.decode_host} when disaggregated)",
        markup=False,
    )
    console.print(
        f"  {'plan':14s} {'TTFT s (range)':>23s} {'total s':>9s} {'prefill s':>9s} "
        f"{'KV move s':>9s} {'decode tok/s':>12s}",
        markup=False,
    )
    for p in de.plans:
        flag = "" if p.fits else "  (does not fit)"
        console.print(
            f"  {p.name:14s} {_ranged(p.ttft_s, p.ttft_s_low, p.ttft_s_high, 3):>23s} "
            f"{p.total_s:9.3f} {p.prefill_s:9.3f} "
            f"{p.transfer_s:9.3f} {p.decode_tok_s:12.1f}{flag}",
            markup=False,
        )
    for note in de.notes:
        if note.kind is NoteKind.DISAGGREGATED:
            console.print(f"  {note.text}", markup=False)
    kv = next((p.kv_bytes for p in de.plans if p.name == "disaggregated"), 0)
    console.print(
        f"  KV cache moved: {kv / 2**20:.1f} MiB at {de.link_gbps:g} Gbit/s. "
        f"Fastest first token: {de.winner_ttft}; fastest whole request: {de.winner_total}.",
        markup=False,
    )
    t = de.threshold_tokens
    console.print(
        "  Disaggregation wins the first token from "
        + (f"{t} prompt tokens on." if t else "no prompt length (off)."),
        markup=False,
    )


SCENARIO_LABELS = {
    "local": "local only",
    "split": "split (llama.cpp)",
    "recommended": "split (recommended)",
}


def render_served(sv: ServedDecode) -> None:
    """llama-server's decode beside llama-bench's (linkctl.estimate.serving)."""
    o = sv.overhead
    console.print()
    console.print(
        "[bold]what llama-server delivers[/] (its timings.predicted_per_second; the table "
        "above is llama-bench's tg)"
    )
    console.print(f"{'decode tok/s':22}{'llama-bench':>14}{'llama-server':>15}")
    for r in sv.rows:
        console.print(
            f"{SCENARIO_LABELS.get(r.scenario, r.scenario):22}{r.bench_tok_s:>14.1f}"
            f"{r.server_tok_s:>15.1f}  [dim]({r.server_tok_s_low:.1f}-{r.server_tok_s_high:.1f})[/]"
        )
    s = o.settings
    part = (
        f"{o.fixed_us / 1000:.2f} ms per token + {o.vocab_us / 1000:.2f} ms for the "
        f"{o.n_vocab:,}-token vocabulary"
    )
    if sv.head_calibrated:
        part += (
            f", less the {o.plain_fixed_us / 1000:.2f} ms a plain request's fixed part "
            "(the head's calibration, through llama-server, holds it)"
        )
    console.print(
        f"serving overhead {sv.added_us / 1000:.2f} ms/token: {part}; sampler chain at "
        f"llama-server's defaults (top_k {s.top_k}, top_p {s.top_p:g}, min_p {s.min_p:g}, "
        f"temp {s.temp:g}{', penalties on' if s.penalties else ', penalties off'}), -c {o.ctx}, "
        f"{'streamed (SSE)' if o.stream else 'not streamed'}"
    )
    console.print(f"[dim]{o.source}[/]")
    for u in o.unpriced:
        console.print(f"[yellow]note:[/] serving overhead does not price {u}")
