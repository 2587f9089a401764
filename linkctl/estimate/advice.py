"""What the estimate advises (run locally, split faster, split needed) and the figures
that decided it; linkctl.estimate.report makes the sentence."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from enum import StrEnum
from typing import Any


class Recommendation(StrEnum):
    """What the model advises; the values are `estimate --json`'s "recommendation"."""

    SPLIT_NEEDED = "split needed"
    SPLIT_FASTER = "split faster"
    RUN_LOCALLY = "run locally"


class Because(StrEnum):
    """Why: which comparison decided the recommendation."""

    NO_RPC_HOST = "no_rpc_host"
    HEAD_TOO_SMALL = "head_too_small"
    SPLIT_FASTER = "split_faster"  # the best split decodes >= 5 % faster than local
    LOCAL_NOT_SLOWER = "local_not_slower"


# The best split must beat local decode by this factor to be advised: within 5 % the
# prediction's own error decides, and local has no link to fail.
SPLIT_MARGIN = 0.95


@dataclass(frozen=True)
class Advice:
    """The recommendation with the figures that decided it; the sentence is made from
    it by linkctl.estimate.report.reason."""

    recommendation: Recommendation
    because: Because
    need_bytes: int  # the model (weights + KV cache at ctx) on one device
    head_free_bytes: float  # the head's free memory (fractional: GiB x usable share)
    local_decode_tok_s: float
    split_decode_tok_s: float | None  # the recommended split; None without RPC hosts

    def as_dict(self) -> dict[str, Any]:
        return asdict(self) | {
            "recommendation": self.recommendation.value,
            "because": self.because.value,
        }


def advise(
    local_fits: bool,
    local: tuple[float, float],
    recommended: tuple[float, float] | None,
    need_bytes: int,
    head_free: float,
) -> Advice:
    """From the local and the recommended split's (decode µs per token, decode tok/s);
    ``recommended`` None: no rpc host."""
    if recommended is None:
        rec, why = Recommendation.RUN_LOCALLY, Because.NO_RPC_HOST
    elif not local_fits:
        rec, why = Recommendation.SPLIT_NEEDED, Because.HEAD_TOO_SMALL
    elif recommended[0] < local[0] * SPLIT_MARGIN:
        rec, why = Recommendation.SPLIT_FASTER, Because.SPLIT_FASTER
    else:
        rec, why = Recommendation.RUN_LOCALLY, Because.LOCAL_NOT_SLOWER
    return Advice(
        rec, why, need_bytes, head_free, local[1], recommended[1] if recommended else None
    )
