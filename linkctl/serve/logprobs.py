"""The comparison verify makes, pure: two placements' greedy steps, position by position.

Per generated position the chosen token and the top-k log-probabilities come from
llama-server's /completion with ``n_probs`` (tools/server/server-task.cpp,
probs_vector_to_json: the response has ``completion_probabilities``, a list of {id,
token, logprob, top_logprobs: [{id, token, logprob}]}; pre-sampling probabilities are
the softmax of the full logits, server-context.cpp populate_token_probs). Positions
are compared up to and including the first divergent token (after it the two continue
from different text).

Tolerances (``Tolerance``): identical backends must agree on every token and within
a tight log-probability bound; unlike backends (Metal vs CUDA) may differ by a stated
numerical noise, never by a token in the first ``strict_positions`` positions.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from linkctl.core.checks import Verdict
from linkctl.core.errors import CheckFailed

N_PREDICT = 24
N_PROBS = 8  # top-k log-probabilities compared per position


@dataclass(frozen=True)
class Tolerance:
    name: str
    logprob_warn: float  # nats: above this a position is WARN
    logprob_fail: float  # nats: above this a position is FAIL
    strict_positions: int  # a token disagreement before this position is FAIL
    why: str

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


TOLERANCES = {
    # The same kernels on the same data give the same floats: any difference is an error.
    # The bound only absorbs the printing of log(p) as a JSON float.
    "same": Tolerance(
        "same",
        1e-6,
        1e-4,
        N_PREDICT,
        "identical backends: every token equal, |Δ logprob| <= 1e-4 nats",
    ),
    # Metal vs CUDA: other kernels, other accumulation orders, F16 intermediates. The
    # bound is an assumption (not measured here: no GPU on this machine), chosen well
    # above float rounding and well below what one flipped exponent bit does.
    "mixed": Tolerance(
        "mixed",
        0.02,
        0.1,
        16,
        "unlike backends: |Δ logprob| <= 0.1 nats (WARN above 0.02), no token "
        "disagreement in the first 16 positions",
    ),
}


LIVE_WARN = 0.05


def live(tol: Tolerance) -> Tolerance:
    """The canary's tolerance on a server that serves others at the same time: its
    prompt is batched with theirs, and llama.cpp's results depend on the batch (other
    matrix shapes, other accumulation orders), so even identical backends differ. In
    the lab, on one CPU build, concurrent requests moved a canary position by up to
    0.021 nats (tests/test_watch.py); the bound stays the unlike backends' 0.1 nats,
    below what corruption does (non-finite values, other tokens), and no token may
    differ. Unlike backends under load are not measured (no GPU here)."""
    mixed = TOLERANCES["mixed"]
    return Tolerance(
        f"{tol.name}, live",
        max(tol.logprob_warn, LIVE_WARN),
        max(tol.logprob_fail, mixed.logprob_fail),
        max(tol.strict_positions, N_PREDICT),
        f"{tol.name} backends on a server batching other requests: |Δ logprob| <= "
        f"{max(tol.logprob_fail, mixed.logprob_fail):g} nats, every token equal",
    )


@dataclass
class Step:
    """One generated position: the chosen token and the top-k {token id: logprob}."""

    token: int
    logprob: float
    top: dict[int, float]
    text: str = ""
    # False: llama-server sent no probabilities for this token (its text is incomplete
    # UTF-8, see greedy_steps); only the token is compared there.
    has_probs: bool = True


def step_to_json(s: Step) -> dict[str, Any]:
    """A step as JSON holds it (the canary's fingerprint): JSON has no NaN or inf, so
    None stands for NaN and "-inf" for log 0."""
    d = asdict(s)
    d["logprob"] = _num_out(s.logprob)
    d["top"] = {str(k): _num_out(v) for k, v in s.top.items()}
    return d


def step_from_json(d: dict[str, Any]) -> Step:
    return Step(
        token=int(d["token"]),
        logprob=_num_in(d["logprob"]),
        top={int(k): _num_in(v) for k, v in d["top"].items()},
        text=str(d.get("text", "")),
        has_probs=bool(d.get("has_probs", True)),
    )


def _num_out(v: float) -> float | str | None:
    return None if math.isnan(v) else ("-inf" if v == -math.inf else v)


def _num_in(v: float | str | None) -> float:
    return math.nan if v is None else float(v)


def parse_probs(body: dict[str, Any]) -> list[Step]:
    """llama-server /completion answer -> steps. A null log-probability (the JSON
    library writes NaN and inf as null) becomes NaN."""
    probs = body.get("completion_probabilities")
    if not isinstance(probs, list):
        raise CheckFailed(
            f"llama-server answered without completion_probabilities (keys: {sorted(body)})",
            "this llama.cpp build does not return n_probs; rebuild with scripts/build-llama.sh",
        )

    def num(v: Any) -> float:
        if not isinstance(v, int | float):
            return math.nan
        # log(0) is sent as the lowest float (completion_token_output::logarithm)
        return -math.inf if v <= -1e37 else float(v)

    out = []
    for p in probs:
        top = {int(t["id"]): num(t.get("logprob")) for t in p.get("top_logprobs") or []}
        out.append(Step(int(p["id"]), num(p.get("logprob")), top, str(p.get("token", ""))))
    return out


def position_diff(a: Step, b: Step) -> float:
    """Largest |Δ logprob| over the union of both top-k lists. A token in one list but
    not the other is at most the other's k-th logprob there, so the difference is at
    least (its logprob - that k-th logprob)."""
    if not (a.has_probs and b.has_probs):
        return 0.0
    vals = [a.logprob, b.logprob, *a.top.values(), *b.top.values()]
    if not all(math.isfinite(v) for v in vals):
        return math.inf
    worst = abs(a.logprob - b.logprob) if a.token == b.token else 0.0
    for x, y in ((a, b), (b, a)):
        floor = min(y.top.values()) if y.top else -math.inf
        for tok, lp in x.top.items():
            d = abs(lp - y.top[tok]) if tok in y.top else max(0.0, lp - floor)
            worst = max(worst, d)
    return worst


@dataclass
class PromptResult:
    prompt: str
    positions: int  # generated positions in the reference
    compared: int  # positions compared (up to and including the first divergence)
    agreed: int  # positions where both chose the same token
    first_divergence: int | None  # position index, None if all agree
    max_logprob_diff: float
    max_diff_position: int | None
    verdict: Verdict
    detail: str
    reference_text: str = ""
    split_text: str = ""

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        if not math.isfinite(self.max_logprob_diff):
            d["max_logprob_diff"] = None  # JSON has no inf; detail says non-finite
        return d


def compare(prompt: str, ref: list[Step], got: list[Step], tol: Tolerance) -> PromptResult:
    n = len(ref)
    first = None
    worst, worst_at = 0.0, None
    compared = 0
    for i, r in enumerate(ref):
        if i >= len(got):
            first = i if first is None else first
            break
        g = got[i]
        d = position_diff(r, g)
        compared += 1
        if worst_at is None or d > worst:
            worst, worst_at = d, i
        if r.token != g.token:
            first = i
            break
    agreed = sum(r.token == g.token for r, g in zip(ref, got, strict=False))
    no_probs = sum(not (r.has_probs and g.has_probs) for r, g in zip(ref, got, strict=False))

    def result(verdict: Verdict, detail: str) -> PromptResult:
        return PromptResult(
            prompt=prompt,
            positions=n,
            compared=compared,
            agreed=agreed,
            first_divergence=first,
            max_logprob_diff=worst,
            max_diff_position=worst_at,
            verdict=verdict,
            detail=detail,
            reference_text="".join(s.text for s in ref),
            split_text="".join(s.text for s in got),
        )

    diff = (
        f"max |Δ logprob| {worst:.2g} nats at position {worst_at}" if worst_at is not None else ""
    )
    if no_probs:
        diff += f" ({no_probs} positions without probabilities: tokens only)"
    if math.isinf(worst):
        return result(
            Verdict.FAIL,
            f"non-finite log-probabilities at position {worst_at} (NaN/inf logits)",
        )
    if len(got) < n and first == len(got):
        return result(Verdict.FAIL, f"split generated {len(got)} of {n} tokens")
    if first is not None:
        r, g = ref[first], got[first]
        what = (
            f"first divergent position {first}: reference token {r.token} {r.text!r}, "
            f"split token {g.token} {g.text!r}; {agreed}/{n} positions agree; {diff}"
        )
        if first < tol.strict_positions:
            return result(Verdict.FAIL, what)
        if worst > tol.logprob_fail:
            return result(Verdict.FAIL, what)
        return result(Verdict.WARN, what + f" (after the first {tol.strict_positions})")
    what = f"{n}/{n} tokens agree, {diff}"
    if worst > tol.logprob_fail:
        return result(Verdict.FAIL, f"{what} > bound {tol.logprob_fail:g}")
    if worst > tol.logprob_warn:
        return result(
            Verdict.WARN,
            f"{what} > {tol.logprob_warn:g} (bound {tol.logprob_fail:g})",
        )
    return result(Verdict.PASS, f"{what} (bound {tol.logprob_fail:g})")
