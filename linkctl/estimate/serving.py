"""What llama-server costs per generated token beyond llama-bench's tg figure.

llama-bench's tg times llama_decode alone (tools/llama-bench/llama-bench.cpp, test_gen:
one llama_decode and llama_synchronize a token, the next token drawn at random, nothing
sampled). llama-server, per token, also samples, detokenizes and does the slot's work
before the next decode can start (the next token is the sampled one, so none of it
overlaps the device's work):

- the sampler chain at llama-server's defaults (common/common.h, common_params_sampling:
  penalties, dry, top_n_sigma, top_k 40, typical_p 1.0, top_p 0.95, min_p 0.05, xtc,
  temp 0.8, then dist). Two of its steps walk the whole vocabulary: set_logits copies
  every logit into the candidate array (common/sampling.cpp), and top_k's
  std::partial_sort keeps the best 40 of them (src/llama-sampler.cpp,
  llama_token_data_array_partial_sort_inplace); the rest see 40 candidates. Penalties,
  dry, xtc and top_n_sigma are off at the defaults (an empty sampler,
  llama_sampler_init_penalties); a repeat/frequency/presence penalty turns penalties on,
  and it looks every candidate up in its token-count map (llama_sampler_penalties_apply):
  another pass over the vocabulary.
- detokenizing the token, the slot's stop-string and UTF-8 checks and the result sent
  to the HTTP thread (tools/server/server-context.cpp, process_token): per token, not
  per vocabulary entry.

So the overhead is ``fixed_us + vocab_ns x n_vocab`` (+ the penalties' pair of terms
when on; streaming and a -c of 32768 or more add a term per token), measured, not
assumed: bench/serving_overhead.py measures llama-server against llama-bench on the same
tiny model and build at several vocabulary sizes, and its ``--fit`` gives the constants
in linkctl/data/serving_overhead.toml, which names the command, the build and the CPU
they were measured on. The terms are the head's CPU's: sampling runs on the CPU whatever
device decodes.

What is not priced: top_k <= 0 or >= n_vocab (top_p then sorts a share of the
vocabulary that depends on how peaked the logits are, llama_sampler_top_p_apply), n_probs
> 0 (the top n_probs are detokenized per token), grammars and dry. ``SamplerSettings``
reports them as unpriced.
"""

from __future__ import annotations

import tomllib
from dataclasses import asdict, dataclass, field
from functools import cache
from importlib import resources
from typing import Any

# llama-server's defaults (common/common.h, common_params_sampling, at b11434).
DEFAULT_TOP_K = 40
DEFAULT_TOP_P = 0.95
DEFAULT_MIN_P = 0.05
DEFAULT_TEMP = 0.8
DEFAULT_PENALTY_LAST_N = 64


@dataclass(frozen=True)
class SamplerSettings:
    """The request's sampler settings that change the per-token cost; llama-server's
    defaults unless given."""

    top_k: int = DEFAULT_TOP_K
    top_p: float = DEFAULT_TOP_P
    min_p: float = DEFAULT_MIN_P
    temp: float = DEFAULT_TEMP
    repeat_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    penalty_last_n: int = DEFAULT_PENALTY_LAST_N
    n_probs: int = 0

    @property
    def penalties(self) -> bool:
        """Whether the penalties sampler is on (llama_sampler_penalties::is_disabled)."""
        neutral = (
            self.repeat_penalty == 1.0
            and self.frequency_penalty == 0.0
            and self.presence_penalty == 0.0
        )
        return self.penalty_last_n != 0 and not neutral

    def unpriced(self, n_vocab: int) -> list[str]:
        """The settings whose cost the model does not know."""
        out = []
        if self.top_k <= 0 or self.top_k >= n_vocab:
            out.append(
                f"top_k {self.top_k} (no top-k cut: top_p sorts a logit-dependent share "
                "of the vocabulary)"
            )
        if self.n_probs > 0:
            out.append(f"n_probs {self.n_probs}")
        return out


@dataclass(frozen=True)
class ServingTerms:
    """linkctl/data/serving_overhead.toml: the measured constants and where from."""

    fixed_us: float
    vocab_ns: float
    stream_fixed_us: float
    stream_vocab_ns: float
    penalties_fixed_us: float
    penalties_vocab_ns: float
    ctx_32k_fixed_us: float
    ctx_32k_vocab_ns: float
    build: str
    cpu: str
    command: str
    measured: str


@cache
def load_terms() -> ServingTerms:
    path = resources.files("linkctl") / "data" / "serving_overhead.toml"
    d = tomllib.loads(path.read_text())
    return ServingTerms(**{k: d[k] for k in ServingTerms.__dataclass_fields__})


@dataclass(frozen=True)
class ServingOverhead:
    """llama-server's time per generated token beyond llama-bench's, in µs."""

    n_vocab: int
    ctx: int
    stream: bool  # the request streams (SSE): a chunk per token to the HTTP thread
    fixed_us: float  # per token: the server loop, detokenizing, the slot's checks
    vocab_us: float  # the sampler chain's passes over the vocabulary
    # The fixed part of a plain request (not streamed, penalties off): what a head's
    # `linkctl calibrate` already timed, as it reads llama-server's own timings.
    plain_fixed_us: float
    us: float  # the total per token
    settings: SamplerSettings = SamplerSettings()
    unpriced: list[str] = field(default_factory=list)
    source: str = ""

    def server_tok_s(self, bench_tok_s: float) -> float:
        """What llama-server delivers when llama-bench decodes at ``bench_tok_s``."""
        if bench_tok_s <= 0:
            return 0.0
        return 1e6 / (1e6 / bench_tok_s + self.us)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


# -c above this pays the measured large-allocation terms (measured at -c 32768 against
# -c 4096; below, the recipe's -c 4096 is what the main terms were measured at).
BIG_CTX = 32768


def serving_overhead(
    n_vocab: int,
    settings: SamplerSettings | None = None,
    ctx: int = 4096,
    terms: ServingTerms | None = None,
    stream: bool = True,
) -> ServingOverhead:
    """The per-token serving overhead for a model of ``n_vocab`` tokens, at ``settings``
    (default: llama-server's), ``-c ctx``, streamed (as chat clients and llama-server's
    web UI ask) or not."""
    s = settings or SamplerSettings()
    t = terms or load_terms()
    fixed, per = t.fixed_us, t.vocab_ns
    if stream:
        fixed += t.stream_fixed_us
        per += t.stream_vocab_ns
    if s.penalties:
        fixed += t.penalties_fixed_us
        per += t.penalties_vocab_ns
    if ctx >= BIG_CTX:
        fixed += t.ctx_32k_fixed_us
        per += t.ctx_32k_vocab_ns
    vocab_us = max(0.0, per * n_vocab / 1000)
    fixed = max(0.0, fixed)
    return ServingOverhead(
        n_vocab=n_vocab,
        ctx=ctx,
        stream=stream,
        fixed_us=fixed,
        vocab_us=vocab_us,
        plain_fixed_us=max(0.0, t.fixed_us),
        us=fixed + vocab_us,
        settings=s,
        unpriced=s.unpriced(n_vocab),
        source=(f"measured with llama.cpp {t.build} on {t.cpu} ({t.measured}): {t.command}"),
    )


@dataclass(frozen=True)
class ServedRow:
    """One scenario's decode: llama-bench's figure (what the model predicts) and what
    llama-server delivers, each with its interval."""

    scenario: str  # "local", "split", "recommended"
    bench_tok_s: float
    server_tok_s: float
    bench_tok_s_low: float = 0.0
    bench_tok_s_high: float = 0.0
    server_tok_s_low: float = 0.0
    server_tok_s_high: float = 0.0


@dataclass(frozen=True)
class ServedDecode:
    """`estimate`'s llama-server figures: the overhead it adds per token and each
    scenario's decode with and without it."""

    overhead: ServingOverhead
    head_calibrated: bool  # calibrate measured the head with llama-server: fixed part in
    added_us: float  # what is added to each token: the whole overhead, or its vocab part
    rows: list[ServedRow]

    def as_dict(self) -> dict[str, Any]:
        return {
            "predicts": "llama-server timings.predicted_per_second (decode tok/s a client reads)",
            "overhead": self.overhead.as_dict(),
            "head_calibrated": self.head_calibrated,
            "added_us_per_token": self.added_us,
            "rows": [asdict(r) for r in self.rows],
        }


def served(
    scenarios: dict[str, tuple[float, float, float]],
    overhead: ServingOverhead,
    head_calibrated: bool = False,
) -> ServedDecode:
    """llama-server's decode for each scenario's llama-bench (tok/s, low, high). A head
    calibrated by `linkctl calibrate` was timed through llama-server (plain requests, on
    models of 259 tokens), so its figures hold a plain request's fixed part already:
    the rest (the vocabulary's passes, streaming, penalties) is added then."""
    added = overhead.us - overhead.plain_fixed_us if head_calibrated else overhead.us

    def srv(tok_s: float) -> float:
        return 1e6 / (1e6 / tok_s + added) if tok_s > 0 else 0.0

    rows = [
        ServedRow(name, tps, srv(tps), lo, hi, srv(lo), srv(hi))
        for name, (tps, lo, hi) in scenarios.items()
    ]
    return ServedDecode(overhead, head_calibrated, added, rows)
