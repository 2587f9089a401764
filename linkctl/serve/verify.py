"""`linkctl verify`: prove the split computes what one machine computes, before serving.

A split over RPC can be fast and wrong (a bad transfer, a stale build on one end,
mismatched backends): llama-server answers with fluent nonsense or slightly wrong
logits and nothing in the pair notices. verify runs the same fixed prompts, greedy,
through two placements of the same model (linkctl.serve.placement: the split serve
runs and a reference) and compares them position by position (linkctl.serve.logprobs).

Each placement is one llama-server on 127.0.0.1 (a free port), run one after the
other (rpc-server serves one client at a time).
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from linkctl.core.checks import Check, Verdict, worst
from linkctl.core.errors import CheckFailed, InputError
from linkctl.core.log import Say, quiet
from linkctl.core.profile import Profile
from linkctl.core.runner import Children, Runner, default_runner
from linkctl.gguf.info import ModelInfo
from linkctl.gguf.tiny import TinySpec
from linkctl.llama.bins import LlamaBins
from linkctl.llama.client import LlamaServer
from linkctl.llama.invocation import split_text
from linkctl.serve.greedy import greedy_steps
from linkctl.serve.logprobs import (
    N_PREDICT,
    N_PROBS,
    PromptResult,
    Step,
    Tolerance,
    compare,
    step_to_json,
)
from linkctl.serve.placement import (
    CTX,
    Device,
    Placement,
    another_split,
    backend_class,
    head_fits,
    model_buffers,
    parse_list_devices,
    predicted_devices,
)
from linkctl.serve.split import SplitChoice

# Fixed prompts: plain text that any tokenizer splits into a few dozen tokens.
PROMPTS = (
    "The cable between two machines carries the activations of every token. ",
    "Once upon a time, in a small village by the sea, there lived",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
)


# The default model: small enough to load and run in a second, big enough to split.
TINY = TinySpec(n_layer=6, n_embd=128, n_head=4, n_ff=384, n_ctx=512)


@dataclass
class VerifyOptions:
    model: str | None = None  # None: the default tiny model
    reference: str = "auto"  # auto / head / split
    backends: str = "auto"  # auto / same / mixed
    prompts: tuple[str, ...] = PROMPTS
    n_predict: int = N_PREDICT
    n_probs: int = N_PROBS
    load_timeout_s: float = 300.0
    logit_bias: list[list[int | bool]] = field(default_factory=list)
    split: SplitChoice | None = None  # None: chosen as `linkctl serve` chooses it
    split_spec: str | None = None  # --split, as serve's
    calibration: list[Path] | None = None  # --calibration: more than this host's state holds

    def check(self) -> None:
        if self.reference not in ("auto", "head", "split"):
            raise InputError(f"--reference {self.reference!r}", "use auto, head or split")
        if self.backends not in ("auto", "same", "mixed"):
            raise InputError(f"--backends {self.backends!r}", "use auto, same or mixed")
        if not 1 <= self.n_predict <= 256:
            raise InputError(f"--tokens {self.n_predict} is outside 1..256", "e.g. --tokens 24")


@dataclass
class VerifyReport:
    profile: str
    model: str
    model_source: str
    tolerance: Tolerance
    backends_why: str
    reference: Placement
    split: Placement
    reference_why: str
    prompt_texts: list[str] = field(default_factory=list)
    n_predict: int = N_PREDICT
    n_probs: int = N_PROBS
    prompts: list[PromptResult] = field(default_factory=list)
    lines: list[Check] = field(default_factory=list)
    elapsed_s: float = 0.0
    dry_run: bool = False
    timings: dict[str, float] = field(default_factory=dict)
    # The reference run itself: the canary's fingerprint (linkctl.serve.canary).
    reference_steps: list[list[Step]] = field(default_factory=list)
    logit_bias: list[list[int | bool]] = field(default_factory=list)
    fingerprint: Path | None = None  # where the reference run was kept for the canary

    @property
    def verdict(self) -> Verdict:
        return worst(ln.verdict for ln in self.lines)

    @property
    def exit_code(self) -> int:
        return 1 if self.verdict is Verdict.FAIL else 0

    def add(self, check: str, verdict: Verdict, detail: str, fix: str | None = None) -> None:
        self.lines.append(Check(check, verdict, detail=detail, fix=fix))

    def summary(self) -> str:
        """The one line the demo and serve print."""
        if self.dry_run:
            return "verify: dry run, nothing started"
        n = sum(p.positions for p in self.prompts)
        agreed = sum(p.agreed for p in self.prompts)
        finite = [p.max_logprob_diff for p in self.prompts]
        worst = max(finite, default=0.0)
        firsts = [p.first_divergence for p in self.prompts if p.first_divergence is not None]
        where = f"first divergence at position {min(firsts)}" if firsts else "no divergence"
        worst_s = "non-finite" if math.isinf(worst) else f"{worst:.2g} nats"
        return (
            f"verify {self.verdict}: top-1 agreement {agreed}/{n}, {where}, max |Δ logprob| "
            f"{worst_s} ({self.tolerance.name} backends, bound {self.tolerance.logprob_fail:g}); "
            f"reference: {self.reference.kind}; {self.elapsed_s:.1f} s"
        )

    def as_dict(self) -> dict[str, Any]:
        return {
            "verdict": self.verdict,
            "ok": self.exit_code == 0,
            "summary": self.summary(),
            "profile": self.profile,
            "model": self.model,
            "model_source": self.model_source,
            "tolerance": self.tolerance.as_dict(),
            "backends_why": self.backends_why,
            "reference_why": self.reference_why,
            "reference": self.reference.as_dict(),
            "split": self.split.as_dict(),
            "n_predict": self.n_predict,
            "n_probs": self.n_probs,
            "prompt_texts": self.prompt_texts,
            "prompts": [p.as_dict() for p in self.prompts],
            "lines": [
                {"check": c.name, "verdict": c.verdict, "detail": c.detail, "fix": c.fix}
                for c in self.lines
            ],
            "timings_s": self.timings,
            "fingerprint": str(self.fingerprint) if self.fingerprint else None,
            "elapsed_s": round(self.elapsed_s, 2),
            "dry_run": self.dry_run,
        }


DEFAULT_SOURCE = f"default: tiny random-weight llama written by linkctl ({TINY.n_layer} layers)"


def default_model_path() -> Path:
    """Where the default model lives: written once to the state dir (same bytes every time)."""
    from linkctl.core.paths import state_dir

    s = TINY
    return state_dir() / "verify" / f"tiny-{s.n_layer}L-{s.n_embd}d-seed{s.seed}.gguf"


def default_model() -> tuple[str, str]:
    """The tiny random-weight GGUF, written to the state dir if it is not there yet."""
    from linkctl.gguf.tiny import write_tiny_llama

    path = default_model_path()
    if not path.is_file():
        write_tiny_llama(path, TINY)
    return str(path), DEFAULT_SOURCE


def plan_unwritten(
    prof: Profile, opts: VerifyOptions, bins: LlamaBins, say: Say, runner: Runner
) -> VerifyReport:
    """A dry run's plan when the default model is not written yet. A dry run writes
    nothing to the state dir: the plan is made on a copy in a temporary directory
    (removed before this returns) and names the path the first real run writes."""
    import tempfile
    from dataclasses import replace

    from linkctl.gguf.tiny import write_tiny_llama

    final = default_model_path()
    with tempfile.TemporaryDirectory(prefix="linkctl-verify-") as tmp:
        copy = Path(tmp) / final.name
        write_tiny_llama(copy, TINY)
        rep = plan(prof, replace(opts, model=str(copy)), bins, say, runner, dry_run=True)
    rep.model = str(final)
    rep.model_source = f"{DEFAULT_SOURCE}; not written yet: the first run that is not dry writes it"
    for pl in (rep.reference, rep.split):
        pl.invocation = pl.invocation.changed(model=str(final))
    return rep


def run_prompts(
    pl: Placement, opts: VerifyOptions, log_dir: Path, say: Say, runner: Runner
) -> tuple[list[list[Step]], dict[str, float]]:
    t0 = time.monotonic()
    log = log_dir / f"{pl.role}.log"
    server = LlamaServer.serving(pl.invocation)
    with Children(runner, stop_timeout=15) as kids:
        proc = kids.spawn(pl.invocation.argv(), log)
        say(f"{pl.role} ({pl.kind}): loading the model in llama-server ...")
        server.wait_healthy(proc, opts.load_timeout_s, log)
        t_load = time.monotonic() - t0
        say(f"{pl.role}: ready in {t_load:.1f} s")
        out = []
        for i, prompt in enumerate(opts.prompts, 1):
            steps = greedy_steps(server, prompt, opts.n_predict, opts.n_probs, opts.logit_bias)
            say(f"{pl.role}: prompt {i}/{len(opts.prompts)}: {len(steps)} tokens")
            out.append(steps)
    pl.buffers_mib = model_buffers(log.read_text(errors="replace"))
    return out, {f"{pl.role}_load_s": t_load, f"{pl.role}_total_s": time.monotonic() - t0}


def resolve_model(opts: VerifyOptions) -> tuple[str, str, ModelInfo]:
    """(path, where it came from, ModelInfo); the default tiny model is written here."""
    from linkctl.gguf.info import read_model

    if opts.model:
        if not os.path.isfile(opts.model):
            raise InputError(f"--model {opts.model}: no such file", "give a .gguf file")
        model, source = opts.model, "--model"
    else:
        model, source = default_model()
    info = read_model(model)
    if not info.data_present:
        raise InputError(f"{model}: header only, tensor data absent", "verify needs a real model")
    return model, source, info


def plan(
    prof: Profile,
    opts: VerifyOptions,
    bins: LlamaBins,
    say: Say,
    runner: Runner | None = None,
    dry_run: bool = False,
) -> VerifyReport:
    """Both placements and the tolerance. Contacts nothing but, for the another-split
    reference (and not in a dry run), `llama-server --list-devices`, which asks each
    rpc-server for its devices."""
    from linkctl.llama.bins import free_port
    from linkctl.serve.plan import head_invocation
    from linkctl.serve.split import choose_split

    opts.check()
    runner = runner or default_runner()
    model, source, info = resolve_model(opts)
    if (info.name or "").startswith("linkctl-tiny-llama"):
        from linkctl.gguf.tiny import N_SPECIAL

        opts.logit_bias = [[N_SPECIAL + b, False] for b in range(0x80, 0x100)]
    server = bins.need("llama-server").path
    choice = (
        opts.split
        if opts.split is not None
        else choose_split(prof, model, opts.split_spec, calibration=opts.calibration)
    )
    for note in choice.notes:
        say(f"serve's split: {note}")
    # The head's invocation on loopback, one slot, a small context; -lv 4: llama-server's
    # info log names each device's model buffer (where the weights really went); it
    # changes no computation.
    split = head_invocation(prof, server, model, choice).changed(
        host="127.0.0.1", port=free_port(), ctx=CTX, slots=1, verbosity=4
    )
    rpc_hosts = [h.name for h in prof.rpc_hosts]
    head = prof.head.name
    if opts.reference == "auto":
        try:
            fits, why = head_fits(prof, model)
        except InputError as e:
            raise InputError(
                f"cannot tell whether the model fits the head: {e.message}",
                "set hosts[].device (and memory_gb) in the profile, or pass --reference head|split",
            ) from None
        ref_kind = "head alone" if fits else "split"
        why = f"model {'fits' if fits else 'does not fit'} the head alone: {why}"
    else:
        ref_kind = "head alone" if opts.reference == "head" else "split"
        why = f"--reference {opts.reference}"
    devices: list[Device] = []
    if ref_kind == "split":
        if dry_run:
            devices = predicted_devices(prof)
        else:
            say("asking llama-server for the split's devices (--list-devices) ...")
            r = runner.run(split.list_devices_argv(), timeout=60, check=False)
            devices = parse_list_devices(r.stdout)
        ref, ref_assign, split_assign = another_split(split, info.block_count, devices)
        ref_hosts = [*rpc_hosts, head]
    else:
        ref = split.changed(rpc=(), tensor_split=None)
        ngl = "llama.cpp's default" if split.ngl is None else split.ngl
        ref_assign = f"every layer on the head (-ngl {ngl}, no --rpc)"
        split_assign = f"-ngl {ngl} over --rpc {','.join(split.rpc)}"
        if split.tensor_split:
            split_assign += f", -ts {split_text(split.tensor_split)}"
        ref_hosts = [head]
    # Its own port: the reference's server has just stopped when the split's starts, and
    # its port may not be free again yet.
    ref = ref.changed(port=free_port())
    tol, tol_why = backend_class(prof, sorted({*ref_hosts, *rpc_hosts, head}), opts.backends)
    return VerifyReport(
        profile=prof.name,
        model=model,
        model_source=source,
        tolerance=tol,
        backends_why=tol_why,
        reference=Placement("reference", ref_kind, ref, ref_hosts, ref_assign),
        split=Placement("split", "split", split, [*rpc_hosts, head], split_assign),
        reference_why=why,
        prompt_texts=list(opts.prompts),
        n_predict=opts.n_predict,
        n_probs=opts.n_probs,
    )


def record_fingerprint(rep: VerifyReport) -> Path | None:
    """Keep the reference run of a verify that did not FAIL as the canary's fingerprint
    for this profile and model (linkctl.serve.canary); None when there is nothing to
    keep (a dry run, a FAIL)."""
    from linkctl.core.log import stamp
    from linkctl.core.records import Fingerprint, fingerprint_path, save_record

    if rep.dry_run or rep.verdict is Verdict.FAIL or not rep.reference_steps:
        return None
    st = os.stat(rep.model)
    fp = Fingerprint(
        profile=rep.profile,
        model=rep.model,
        model_bytes=st.st_size,
        model_mtime_ns=st.st_mtime_ns,
        recorded_at=stamp(),
        tolerance=rep.tolerance.as_dict(),
        logit_bias=rep.logit_bias,
        prompts=rep.prompt_texts,
        steps=[[step_to_json(s) for s in steps] for steps in rep.reference_steps],
    )
    return save_record(fp, fingerprint_path(rep.profile, rep.model))


def verify(
    prof: Profile,
    opts: VerifyOptions,
    bins: LlamaBins,
    *,
    say: Say = quiet,
    dry_run: bool = False,
    runner: Runner | None = None,
    check_endpoints: bool = True,
) -> VerifyReport:
    from linkctl.core.paths import make_dirs, state_dir

    t0 = time.monotonic()
    runner = runner or default_runner()
    opts.check()
    unwritten = dry_run and not opts.model and not default_model_path().is_file()
    if not unwritten:
        resolve_model(opts)  # bad input is refused before anything is contacted
    bins.need("llama-server")
    if check_endpoints and not dry_run:
        # A busy rpc-server (the head's llama-server holds it) would hang our split.
        from linkctl.llama.bins import local_rpc_protocol
        from linkctl.serve.run import check_endpoints as hello_all

        local = local_rpc_protocol(bins) if bins.rpc_server else None
        for name, e in hello_all(prof, local, bins.build(), timeout=5.0).items():
            say(f"rpc endpoint {name} {e.host}:{e.port}: protocol {e.version_str}")
    if unwritten:
        rep = plan_unwritten(prof, opts, bins, say, runner)
    else:
        rep = plan(prof, opts, bins, say, runner, dry_run=dry_run)
    rep.dry_run = dry_run
    if dry_run:
        rep.elapsed_s = time.monotonic() - t0
        return rep
    log_dir = make_dirs(state_dir() / "verify")
    results: dict[str, list[list[Step]]] = {}
    for pl in (rep.reference, rep.split):
        try:
            results[pl.role], t = run_prompts(pl, opts, log_dir, say, runner)
            rep.timings.update({k: round(v, 2) for k, v in t.items()})
        except CheckFailed as e:
            log = log_dir / f"{pl.role}.log"
            rep.add(pl.role, Verdict.FAIL, f"{pl.kind}: {e.message}", f"see {log}")
            rep.elapsed_s = time.monotonic() - t0
            return rep
        bufs = ", ".join(f"{k} {v:.1f} MiB" for k, v in pl.buffers_mib.items())
        weights = f"; weights: {bufs}" if bufs else ""
        rep.add(pl.role, Verdict.PASS, f"{pl.kind}: {pl.assignment}{weights}")
    rep.reference_steps, rep.logit_bias = results["reference"], opts.logit_bias
    for i, (prompt, ref, got) in enumerate(
        zip(opts.prompts, results["reference"], results["split"], strict=True), 1
    ):
        pr = compare(prompt, ref, got, rep.tolerance)
        rep.prompts.append(pr)
        rep.add(f"prompt {i}", pr.verdict, pr.detail)
    rep.elapsed_s = time.monotonic() - t0
    return rep
