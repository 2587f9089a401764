"""The greedy run verify and the canary make: one position per request, with its top-k
log-probabilities (linkctl.serve.logprobs compares them)."""

from __future__ import annotations

import math

from linkctl.core.errors import CheckFailed
from linkctl.llama.client import LlamaServer
from linkctl.serve.logprobs import Step, parse_probs


def greedy_steps(
    server: LlamaServer,
    prompt: str,
    n_predict: int,
    n_probs: int,
    logit_bias: list[list[int | bool]],
) -> list[Step]:
    """Greedy decoding one token per request, each request the prompt's token ids plus
    the tokens chosen so far (the prefix stays in llama-server's prompt cache). One
    /completion of n tokens is not enough: llama-server holds back the probabilities of
    a token whose text is incomplete UTF-8 and sends one merged entry once the text is
    whole (server-context.cpp process_token), so a byte-level model's positions
    would be lost. Even one token alone gets no entry when its text is an incomplete
    UTF-8 sequence; then ``return_tokens`` still names it and only the token is compared
    there. For linkctl's tiny byte-level model, ``logit_bias`` keeps the greedy choice off
    the bytes 0x80-0xFF so that every position has its probabilities (the bias acts in
    the sampler, after the logits the probabilities are computed from)."""
    ids = server.tokenize(prompt)
    if not ids:
        raise CheckFailed(f"llama-server tokenized the prompt {prompt[:30]!r} to nothing")
    steps: list[Step] = []
    for _ in range(n_predict):
        body = {
            "prompt": ids + [st.token for st in steps],
            "n_predict": 1,
            "n_probs": n_probs,
            "temperature": 0,
            "ignore_eos": True,
            "cache_prompt": True,
            "seed": 0,
            "return_tokens": True,
            "logit_bias": logit_bias,
        }
        r = server.call("POST", "/completion", body, timeout=300)
        toks = r.get("tokens") or []
        if not r.get("completion_probabilities") and len(toks) == 1:
            got = [Step(int(toks[0]), math.nan, {}, "", has_probs=False)]
        else:
            got = parse_probs(r)
        if len(got) != 1:
            raise CheckFailed(f"llama-server answered {len(got)} positions for one token")
        steps.append(got[0])
    return steps
