"""The correctness canary: verify's fixed prompts, greedy, on the llama-server that
serves, compared with the fingerprint verify recorded.

verify proves the split once, before serving. A split can start computing garbage later
(llama.cpp's RPC cache served truncated files as complete, giving Inf/NaN activations:
ggml-org/llama.cpp #28789; a corrupted transfer): the canary repeats a short part of
that proof on the live server, after every start, on a schedule and on demand. The
fingerprint is the reference placement's run (token ids and top-k log-probabilities per
position), kept per profile with the model's size and mtime: another file at that path
needs a new verify. The comparison and its tolerance are verify's own
(linkctl.serve.logprobs).
"""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING

from linkctl.core.checks import Verdict, worst
from linkctl.core.errors import CheckFailed, InputError
from linkctl.core.log import stamp
from linkctl.core.records import (
    CanaryRecord,
    Fingerprint,
    fingerprint_path,
    load_fingerprint,
)
from linkctl.serve.logprobs import N_PROBS, Tolerance, compare, live, step_from_json

if TYPE_CHECKING:
    from linkctl.llama.client import LlamaServer


def _model_id(model: str) -> tuple[int, int]:
    st = os.stat(model)
    return st.st_size, st.st_mtime_ns


def fingerprint_for(profile: str, model: str) -> Fingerprint:
    """The profile's fingerprint, if it is of ``model`` as it is on disk now; InputError
    saying how to record one otherwise."""
    path = fingerprint_path(profile, model)
    if not path.is_file():
        raise InputError(
            f"no canary fingerprint for profile {profile!r} ({path})",
            "run `sudo linkctl verify --model MODEL` or serve with --verify: it records one",
        )
    fp = load_fingerprint(path)
    if not os.path.isfile(model):
        raise InputError(f"model {model} does not exist", "set serve.model or pass --model")
    if (fp.model, fp.model_bytes, fp.model_mtime_ns) != (model, *_model_id(model)):
        raise InputError(
            f"the canary fingerprint {path} is of {fp.model} ({fp.model_bytes} bytes, recorded "
            f"{fp.recorded_at}), not of {model} as it is now",
            "run `sudo linkctl verify --model MODEL` again: it records a new one",
        )
    return fp


def run_canary(server: LlamaServer, fp: Fingerprint, tokens: int, why: str) -> CanaryRecord:
    """The first ``tokens`` greedy positions of every fingerprint prompt, on ``server``.
    FAIL: a position verify's tolerance refuses (another token, a log-probability past
    the bound, non-finite values). WARN: the canary could not run (the server did not
    answer): that is the watch's to judge, not a wrong answer."""
    from linkctl.serve.greedy import greedy_steps

    tol = live(Tolerance(**fp.tolerance))
    t0 = time.monotonic()
    results = []
    try:
        for prompt, ref in zip(fp.prompts, fp.steps, strict=True):
            got = greedy_steps(server, prompt, tokens, N_PROBS, fp.logit_bias)
            results.append(compare(prompt, [step_from_json(d) for d in ref[:tokens]], got, tol))
    except CheckFailed as e:
        return CanaryRecord(
            time=stamp(),
            verdict=Verdict.WARN,
            detail=f"the canary could not run: {e.message}",
            why=why,
            wall_s=round(time.monotonic() - t0, 3),
            model=fp.model,
        )
    verdict = worst(r.verdict for r in results)
    bad = [f"prompt {i}: {r.detail}" for i, r in enumerate(results, 1) if r.verdict is verdict]
    n = sum(r.compared for r in results)
    detail = (
        f"{n} positions of {len(results)} prompts as recorded ({tol.name} backends)"
        if verdict is Verdict.PASS
        else "; ".join(bad)
    )
    return CanaryRecord(
        time=stamp(),
        verdict=verdict,
        detail=detail,
        why=why,
        wall_s=round(time.monotonic() - t0, 3),
        model=fp.model,
    )
