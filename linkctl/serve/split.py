"""The layer split the head serves: --split / serve.split resolved into -ts weights
(llama.cpp device order), with what the estimate predicts for it.

"recommended" needs the estimate (the model header, the saved probe report, the
calibrations): when serve.split is only the default and the estimate cannot be made,
serve falls back to llama.cpp's own split and says why; asked for explicitly, it refuses
(exit 2).
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from linkctl.core.errors import InputError
from linkctl.core.profile import Profile, parse_split_spec
from linkctl.estimate.notes import NoteKind
from linkctl.llama.invocation import split_text

SplitMode = Literal["recommended", "llama", "weights"]


def legacy_tensor_split(profile: Profile) -> list[float] | None:
    """serve.tensor_split (one weight per host, profile order) in llama.cpp device order."""
    s = profile.serve
    if not s.tensor_split:
        return None
    by_name = {h.name: w for h, w in zip(profile.hosts, s.tensor_split, strict=True)}
    return [by_name[h.name] for h in profile.rpc_hosts] + [by_name[profile.head.name]]


@dataclass
class SplitChoice:
    """The layer split the head runs, where it came from, and what it predicts."""

    mode: SplitMode
    source: str  # "--split", "serve.split in the profile", "serve.tensor_split", "default"
    tensor_split: list[float] | None  # -ts weights, llama.cpp order; None: llama.cpp's own
    order: list[str]  # host of each split device, llama.cpp order
    predicted_decode_tok_s: float | None = None
    predicted_prefill_tok_s: float | None = None
    recommendation: str | None = None
    estimate_source: str | None = None  # link figures and calibrations used
    notes: list[str] = field(default_factory=list)

    def summary(self) -> str:
        ts = split_text(self.tensor_split) if self.tensor_split else None
        what = {
            "recommended": f"recommended -ts {ts}",
            "llama": "llama.cpp's default, by free memory, no -ts",
            "weights": f"-ts {ts}",
        }[self.mode]
        line = f"split: {what} (from {self.source}"
        if self.order:
            line += f"; order {', '.join(self.order)}"
        line += ")"
        if self.predicted_decode_tok_s is not None:
            line += (
                f"; predicted decode {self.predicted_decode_tok_s:.1f} tok/s, prefill "
                f"{self.predicted_prefill_tok_s or 0:.0f} tok/s"
            )
            if self.recommendation:
                line += f"; estimate says: {self.recommendation}"
        return line

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def choose_split(
    profile: Profile,
    model: str | None,
    split: str | None = None,
    *,
    calibration: list[Path] | None = None,
) -> SplitChoice:
    """Resolve --split / serve.split into -ts weights, with the estimate's prediction.

    "recommended" needs the estimate (the model header, the saved probe report, the
    calibrations): when serve.split is only the default and the estimate cannot be
    made, serve falls back to llama.cpp's split and says why; asked for explicitly,
    it refuses (exit 2)."""
    s = profile.serve
    # field: the flag or profile field the split came from, named in errors
    if split is not None:
        field_, source, text = "--split", "--split", split
    elif s.tensor_split:
        field_, source, text = "serve.tensor_split", "serve.tensor_split in the profile", None
    elif s.split is not None:
        field_, source, text = "serve.split", "serve.split in the profile", s.split
    else:
        field_, source, text = "serve.split", "default", "recommended"
    if text is None:
        spec: str | list[float] = legacy_tensor_split(profile) or []
    else:
        try:
            spec = parse_split_spec(text)
        except ValueError as e:
            raise InputError(f"{field_} {text!r}: {e}") from None
    order = [h.name for h in profile.rpc_hosts]
    if isinstance(spec, list):
        n_rpc = len(profile.rpc_hosts)
        if len(spec) not in (n_rpc, n_rpc + 1):
            raise InputError(
                f"{field_} {text or spec}: {len(spec)} weights, the split has "
                f"{n_rpc} rpc host(s) ({', '.join(order)}) and maybe the head's GPU",
                f"give {n_rpc} or {n_rpc + 1} weights in llama.cpp order: rpc hosts in --rpc "
                "order, then the head",
            )
        choice = SplitChoice(
            "weights", source, spec, order + [profile.head.name][: len(spec) - n_rpc]
        )
    else:
        choice = SplitChoice("llama" if spec == "llama" else "recommended", source, None, order)
    try:
        est = _estimate_for(profile, model, choice, calibration)
    except InputError as e:
        if choice.mode != "recommended":
            choice.notes.append(f"no prediction: {e.line()}")
            return choice
        if source != "default":
            raise InputError(
                f"--split recommended needs the estimate: {e.message}",
                e.fix or "run `linkctl probe` and `linkctl calibrate`, or use --split llama",
            ) from None
        choice.mode = "llama"
        choice.notes.append(
            f"recommended split unavailable ({e.line()}): serving llama.cpp's default split"
        )
        return choice
    sc = est.recommended if choice.mode == "recommended" else est.split
    if sc is None:  # no rpc device in the split: cannot happen with a valid profile
        return choice
    order = list(est.model.get("split_order", order))
    if choice.mode == "recommended":
        choice.tensor_split = [float(c) for c in sc.tensor_split]
        choice.order = order
        choice.recommendation = est.recommendation.value
        from linkctl.estimate.advice import Recommendation

        if est.recommendation is Recommendation.RUN_LOCALLY:
            from linkctl.estimate.report import reason

            choice.notes.append(f"the estimate says run locally: {reason(est.advice)}")
    elif choice.mode == "llama":
        choice.order = order
        choice.notes.append(
            "llama.cpp splits by the free memory each device reports when it loads; "
            "predicted with the profile's memory figures"
        )
    choice.predicted_decode_tok_s = sc.decode_tok_s
    choice.predicted_prefill_tok_s = sc.prefill_tok_s
    choice.estimate_source = est.link.source if est.link else None
    choice.notes += [w.text for w in est.warnings if w.kind is NoteKind.CALIBRATION]
    return choice


def _estimate_for(
    profile: Profile, model: str | None, choice: SplitChoice, calibration: list[Path] | None
):
    from linkctl.estimate.run import run_estimate

    if not model or not os.path.isfile(model):
        raise InputError(
            f"model {model or '(none)'} is not a readable file here",
            "set serve.model or pass --model PATH",
        )
    ts = choice.tensor_split if choice.mode == "weights" else None
    return run_estimate(profile, Path(model), split=ts, calibration=calibration)
