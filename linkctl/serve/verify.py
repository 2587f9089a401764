"""`linkctl verify`: prove the split computes what one machine computes, before serving.

A split over RPC can be fast and wrong (a bad transfer, a stale build on one end,
mismatched backends): llama-server answers with fluent nonsense or slightly wrong
logits and nothing in the pair notices. verify runs the same fixed prompts, greedy,
through two placements of the same model and compares them position by position:

    reference  the head alone, when the model fits it (estimate's memory model, or
               --reference head); else another split of the same model: the same
               devices with the layers placed differently (a different -ts over the
               split devices, or a different -ngl when the head has no split device).
               Both compute the same function, so a device or a transfer that
               computes wrong makes the two disagree.
    split      exactly the llama-server placement `linkctl serve` runs (serve.head_argv:
               --rpc, -ngl, -ts, threads, extra args), with a small context.

Each placement is one llama-server on 127.0.0.1 (a free port), run one after the
other (rpc-server serves one client at a time). Per generated position the chosen
token and the top-k log-probabilities come from llama-server's /completion with
``n_probs`` (tools/server/server-task.cpp, probs_vector_to_json: the response has
``completion_probabilities``, a list of {id, token, logprob, top_logprobs: [{id,
token, logprob}]}; pre-sampling probabilities are the softmax of the full logits,
server-context.cpp populate_token_probs). Positions are compared up to and including
the first divergent token (after it the two continue from different text).

Tolerances (``Tolerance``): identical backends must agree on every token and within
a tight log-probability bound; unlike backends (Metal vs CUDA) may differ by a stated
numerical noise, never by a token in the first ``strict_positions`` positions.
"""

from __future__ import annotations

import itertools
import math
import os
import subprocess
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from linkctl.core.errors import CheckFailed, InputError
from linkctl.core.profile import Profile
from linkctl.core.runner import stop_process

# Fixed prompts: plain text that any tokenizer splits into a few dozen tokens.
PROMPTS = (
    "The cable between two machines carries the activations of every token. ",
    "Once upon a time, in a small village by the sea, there lived",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
)
N_PREDICT = 24
N_PROBS = 8  # top-k log-probabilities compared per position
CTX = 512  # both placements; the prompts and their continuations fit easily
# The default model: small enough to load and run in a second, big enough to split.
TINY = {"n_layer": 6, "n_embd": 128, "n_head": 4, "n_ff": 384, "n_ctx": 512}


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


# The ggml backend llama.cpp computes on for each catalog device family.
BACKEND_OF_FAMILY = {"apple": "metal", "nvidia": "cuda", "cpu": "cpu"}


# ---- the comparison (pure) ---------------------------------------------------------------


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
    verdict: str
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
    vals = dict(
        prompt=prompt,
        positions=n,
        compared=compared,
        agreed=agreed,
        first_divergence=first,
        max_logprob_diff=worst,
        max_diff_position=worst_at,
        reference_text="".join(s.text for s in ref),
        split_text="".join(s.text for s in got),
    )
    diff = (
        f"max |Δ logprob| {worst:.2g} nats at position {worst_at}" if worst_at is not None else ""
    )
    if no_probs:
        diff += f" ({no_probs} positions without probabilities: tokens only)"
    if math.isinf(worst):
        return PromptResult(
            **vals,
            verdict="FAIL",
            detail=f"non-finite log-probabilities at position {worst_at} (NaN/inf logits)",
        )
    if len(got) < n and first == len(got):
        return PromptResult(
            **vals, verdict="FAIL", detail=f"split generated {len(got)} of {n} tokens"
        )
    if first is not None:
        r, g = ref[first], got[first]
        what = (
            f"first divergent position {first}: reference token {r.token} {r.text!r}, "
            f"split token {g.token} {g.text!r}; {agreed}/{n} positions agree; {diff}"
        )
        if first < tol.strict_positions:
            return PromptResult(**vals, verdict="FAIL", detail=what)
        if worst > tol.logprob_fail:
            return PromptResult(**vals, verdict="FAIL", detail=what)
        return PromptResult(
            **vals, verdict="WARN", detail=what + f" (after the first {tol.strict_positions})"
        )
    what = f"{n}/{n} tokens agree, {diff}"
    if worst > tol.logprob_fail:
        return PromptResult(**vals, verdict="FAIL", detail=f"{what} > bound {tol.logprob_fail:g}")
    if worst > tol.logprob_warn:
        return PromptResult(
            **vals,
            verdict="WARN",
            detail=f"{what} > {tol.logprob_warn:g} (bound {tol.logprob_fail:g})",
        )
    return PromptResult(**vals, verdict="PASS", detail=f"{what} (bound {tol.logprob_fail:g})")


# ---- placements ---------------------------------------------------------------------------


@dataclass
class Placement:
    role: str  # "reference" or "split"
    kind: str  # "head alone" or "split"
    argv: list[str]  # llama-server argv, without --host/--port (added at run time)
    hosts: list[str]  # profile hosts whose devices compute in it
    assignment: str  # where the layers are, as llama.cpp places them
    buffers_mib: dict[str, float] = field(default_factory=dict)  # from llama-server's log

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def model_buffers(log: str) -> dict[str, float]:
    """'load_tensors: RPC0[198.18.100.2:50052] model buffer size = 1.5 MiB' lines of
    llama-server's log (src/llama-model.cpp): where the weights really went."""
    import re

    out: dict[str, float] = {}
    for m in re.finditer(r"load_tensors:\s+(\S+) model buffer size =\s*([\d.]+) MiB", log):
        out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(2))
    return out


def _drop_opt(argv: list[str], *names: str) -> list[str]:
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a in names:
            skip = True
        else:
            out.append(a)
    return out


def _opt(argv: list[str], name: str) -> str | None:
    """The last value of an option (llama.cpp's arg parser: the last one wins)."""
    val = None
    for a, b in itertools.pairwise(argv):
        if a == name:
            val = b
    return val


def _describe(slots: list[int | None], names: list[str]) -> str:
    """'slots 0-2 on CPU (head), 3-6 on RPC0' from per-slot device indices."""
    runs: list[tuple[str, int, int]] = []
    for i, d in enumerate(slots):
        name = "head CPU" if d is None else names[d]
        if runs and runs[-1][0] == name and runs[-1][2] == i - 1:
            runs[-1] = (name, runs[-1][1], i)
        else:
            runs.append((name, i, i))
    last = len(slots) - 1
    parts = [f"{a}-{b}" if a != b else f"{a}" for _, a, b in runs]
    return (
        ", ".join(f"slots {p} on {n}" for p, (n, _, _) in zip(parts, runs, strict=True))
        + f" (slot {last} = output layer)"
    )


@dataclass
class Device:
    name: str  # llama.cpp device name, e.g. RPC0, Metal
    description: str
    free_mib: int


def parse_list_devices(text: str) -> list[Device]:
    """``llama-server --list-devices`` (common/arg.cpp common_print_available_devices):
    '  NAME: DESCRIPTION (TOTAL MiB, FREE MiB free)' per non-CPU device, in llama.cpp's
    device order."""
    import re

    out = []
    for line in text.splitlines():
        m = re.match(r"^\s+(\S+): (.*) \((\d+) MiB, (\d+) MiB free\)\s*$", line)
        if m:
            out.append(Device(m.group(1), m.group(2), int(m.group(4))))
    return out


def another_split(
    split_argv: list[str], n_layer: int, devices: list[Device]
) -> tuple[list[str], str, str]:
    """The reference argv for a model that does not fit the head: the same devices, the
    layers elsewhere. Returns (argv, reference assignment, split assignment)."""
    from linkctl.estimate.layers import llama_slot_devices

    ngl = int(_opt(split_argv, "-ngl") or 99)
    names = [d.name for d in devices]
    if not devices:
        raise InputError(
            "llama-server --list-devices shows no split device with the profile's --rpc",
            "check that every rpc host runs `linkctl serve`",
        )
    ts = _opt(split_argv, "-ts")
    weights = [float(x) for x in ts.split(",")] if ts else [float(d.free_mib) for d in devices]
    weights = (weights + [0.0] * len(devices))[: len(devices)]
    split_slots = llama_slot_devices(n_layer, weights, ngl)
    if all(s is None for s in split_slots):
        raise InputError(
            f"-ngl {ngl} puts no layer on a split device: the split is the head alone",
            "set serve.ngl > 0",
        )
    total = n_layer + 1
    if len(devices) == 1:
        # One split device and the head's CPU: move the boundary by changing -ngl.
        act = sum(s is not None for s in split_slots)
        ref_ngl = act - max(1, act // 2) if act > 1 else act + max(1, (total - act) // 2)
        ref_slots = llama_slot_devices(n_layer, weights, ref_ngl)
        argv = [*split_argv, "-ngl", str(ref_ngl)]
    else:
        counts = [sum(s == i for s in split_slots) for i in range(len(devices))]
        big = max(range(len(counts)), key=lambda i: counts[i])
        move = max(1, counts[big] // 2)
        ref = list(counts)
        ref[big] -= move
        ref[(big + 1) % len(ref)] += move
        ref_slots = llama_slot_devices(n_layer, [float(c) for c in ref], ngl)
        argv = [*split_argv, "-ts", ",".join(str(c) for c in ref)]
    if ref_slots == split_slots:
        raise InputError(
            "could not find another placement of the model's layers to compare against",
            "pass --reference head if the model fits the head",
        )
    return argv, _describe(ref_slots, names), _describe(split_slots, names)


def head_fits(prof: Profile, model_path: str) -> tuple[bool, str]:
    """Does the model fit the head alone, by estimate's memory model (weights + KV at
    CTX + llama.cpp's buffers, against the profile's memory_gb x usable fraction)?"""
    from linkctl.estimate.cost import GIB, scenario
    from linkctl.estimate.layers import llama_slot_devices
    from linkctl.estimate.run import participants
    from linkctl.gguf.info import read_model

    model = read_model(model_path)
    parts, _notes = participants(prof)
    head = next(p for p in parts if p.role == "head")
    n = model.block_count
    slots = (
        llama_slot_devices(n, [1.0], prof.serve.ngl)
        if head.device.kind == "gpu"
        else [None] * (n + 1)
    )
    sc = scenario("local", model, [head], slots, CTX, None)
    need = sc.devices[0].need_bytes
    return sc.fits, (
        f"needs {need / GIB:.2f} GiB at ctx {CTX}, the head holds {head.free_bytes / GIB:.2f} GiB "
        f"({head.free_source})"
    )


# ---- running ----------------------------------------------------------------------------


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
    split: Any = None  # serve.SplitChoice; None: chosen as `linkctl serve` chooses it
    split_spec: str | None = None  # --split, as serve's

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
    lines: list[dict[str, Any]] = field(default_factory=list)
    elapsed_s: float = 0.0
    dry_run: bool = False
    timings: dict[str, float] = field(default_factory=dict)

    @property
    def verdict(self) -> str:
        vs = [ln["verdict"] for ln in self.lines]
        return "FAIL" if "FAIL" in vs else "WARN" if "WARN" in vs else "PASS"

    @property
    def exit_code(self) -> int:
        return 1 if self.verdict == "FAIL" else 0

    def add(self, check: str, verdict: str, detail: str, fix: str | None = None) -> None:
        self.lines.append({"check": check, "verdict": verdict, "detail": detail, "fix": fix})

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
            "lines": self.lines,
            "timings_s": self.timings,
            "elapsed_s": round(self.elapsed_s, 2),
            "dry_run": self.dry_run,
        }


def default_model() -> tuple[str, str]:
    """The tiny random-weight GGUF (same bytes every time), written once to the state dir."""
    from linkctl.core.paths import state_dir
    from linkctl.gguf.tiny import TinySpec, write_tiny_llama

    spec = TinySpec(**TINY)
    path = state_dir() / "verify" / f"tiny-{spec.n_layer}L-{spec.n_embd}d-seed{spec.seed}.gguf"
    if not path.is_file():
        write_tiny_llama(path, spec)
    return str(
        path
    ), f"default: tiny random-weight llama written by linkctl ({spec.n_layer} layers)"


def backend_class(prof: Profile, hosts: list[str], choice: str) -> tuple[Tolerance, str]:
    if choice != "auto":
        return TOLERANCES[choice], f"--backends {choice}"
    from linkctl.estimate.catalog import load_catalog

    cat = load_catalog()
    kinds = {}
    for name in hosts:
        dev = prof.host(name).device
        kinds[name] = BACKEND_OF_FAMILY.get(cat[dev].family) if dev in cat else None
    if None not in kinds.values() and len(set(kinds.values())) == 1:
        return TOLERANCES["same"], f"every host computes on {next(iter(kinds.values()))}"
    shown = ", ".join(f"{h}: {k or 'unknown'}" for h, k in kinds.items())
    return TOLERANCES["mixed"], f"backends differ or are unknown ({shown})"


class _Server:
    """One llama-server on 127.0.0.1, stopped by its own pid on exit."""

    def __init__(self, argv: list[str], log: Path, runner):
        from linkctl.llama.bins import free_port

        self.port = free_port()
        self.argv = [*argv, "--host", "127.0.0.1", "--port", str(self.port)]
        self.log = log
        self._fh = log.open("w")
        self.proc: subprocess.Popen = runner.spawn(
            self.argv, stdout=self._fh, stderr=subprocess.STDOUT
        )

    def __enter__(self) -> _Server:
        return self

    def __exit__(self, *exc: Any) -> None:
        stop_process(self.proc, 15, kill_wait=5)
        self._fh.close()


def greedy_steps(url: str, prompt: str, opts: VerifyOptions) -> list[Step]:
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
    from linkctl.llama.client import post

    ids = post(f"{url}/tokenize", {"content": prompt, "add_special": True}, 60).get("tokens")
    if not ids:
        raise CheckFailed(f"llama-server tokenized the prompt {prompt[:30]!r} to nothing")
    steps: list[Step] = []
    for _ in range(opts.n_predict):
        body = {
            "prompt": ids + [st.token for st in steps],
            "n_predict": 1,
            "n_probs": opts.n_probs,
            "temperature": 0,
            "ignore_eos": True,
            "cache_prompt": True,
            "seed": 0,
            "return_tokens": True,
            "logit_bias": opts.logit_bias,
        }
        r = post(f"{url}/completion", body, 300)
        toks = r.get("tokens") or []
        if not r.get("completion_probabilities") and len(toks) == 1:
            got = [Step(int(toks[0]), math.nan, {}, "", has_probs=False)]
        else:
            got = parse_probs(r)
        if len(got) != 1:
            raise CheckFailed(f"llama-server answered {len(got)} positions for one token")
        steps.append(got[0])
    return steps


def run_prompts(
    pl: Placement,
    opts: VerifyOptions,
    log_dir: Path,
    say: Callable[[str], None],
    runner,
) -> tuple[list[list[Step]], dict[str, float]]:
    from linkctl.llama.client import wait_health

    t0 = time.monotonic()
    with _Server(pl.argv, log_dir / f"{pl.role}.log", runner) as srv:
        say(f"{pl.role} ({pl.kind}): loading the model in llama-server ...")
        wait_health(srv.port, srv.proc, opts.load_timeout_s, srv.log)
        t_load = time.monotonic() - t0
        say(f"{pl.role}: ready in {t_load:.1f} s")
        out = []
        url = f"http://127.0.0.1:{srv.port}"
        for i, prompt in enumerate(opts.prompts, 1):
            steps = greedy_steps(url, prompt, opts)
            say(f"{pl.role}: prompt {i}/{len(opts.prompts)}: {len(steps)} tokens")
            out.append(steps)
    pl.buffers_mib = model_buffers(srv.log.read_text(errors="replace"))
    return out, {f"{pl.role}_load_s": t_load, f"{pl.role}_total_s": time.monotonic() - t0}


def resolve_model(opts: VerifyOptions):
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


def predicted_devices(prof: Profile) -> list[Device]:
    """The split devices as the profile describes them (for --dry-run, which contacts
    nothing): each rpc host's device, then the head's when the catalog calls it a GPU."""
    from linkctl.estimate.catalog import load_catalog

    cat = load_catalog()
    out = [Device(f"RPC{i}", h.rpc_endpoint, 1) for i, h in enumerate(prof.rpc_hosts)]
    dev = cat.get(prof.head.device or "")
    if dev is not None and dev.kind == "gpu":
        out.append(Device(BACKEND_OF_FAMILY.get(dev.family, "GPU").capitalize(), dev.name, 1))
    return out


def plan(
    prof: Profile,
    opts: VerifyOptions,
    bins,
    say: Callable[[str], None],
    runner=None,
    dry_run: bool = False,
) -> VerifyReport:
    """Both placements and the tolerance. Contacts nothing but, for the another-split
    reference (and not in a dry run), `llama-server --list-devices`, which asks each
    rpc-server for its devices."""
    from linkctl.core.runner import default_runner
    from linkctl.serve.plan import choose_split, head_argv

    opts.check()
    runner = runner or default_runner()
    model, source, info = resolve_model(opts)
    if (info.name or "").startswith("linkctl-tiny-llama"):
        from linkctl.gguf.tiny import N_SPECIAL

        opts.logit_bias = [[N_SPECIAL + b, False] for b in range(0x80, 0x100)]
    server = bins.need("llama-server").path
    # -lv 4: llama-server's info log names each device's model buffer (where the weights
    # really went); it changes no computation.
    choice = opts.split if opts.split is not None else choose_split(prof, model, opts.split_spec)
    for note in choice.notes:
        say(f"serve's split: {note}")
    split_argv = _drop_opt(
        head_argv(prof, server, model, choice), "--host", "--port", "-c", "-np", "-lv"
    )
    split_argv += ["-c", str(CTX), "-np", "1", "-lv", "4"]
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
    n_layer = info.block_count
    devices: list[Device] = []
    if ref_kind == "split":
        if dry_run:
            devices = predicted_devices(prof)
        else:
            say("asking llama-server for the split's devices (--list-devices) ...")
            r = runner.run(
                [server, "--rpc", _opt(split_argv, "--rpc") or "", "--list-devices"],
                timeout=60,
                check=False,
            )
            devices = parse_list_devices(r.stdout)
        ref_argv, ref_assign, split_assign = another_split(split_argv, n_layer, devices)
        ref_hosts = [*rpc_hosts, head]
    else:
        ref_argv = _drop_opt(split_argv, "--rpc", "-ts")
        ref_assign = f"every layer on the head (-ngl {_opt(split_argv, '-ngl')}, no --rpc)"
        split_assign = f"-ngl {_opt(split_argv, '-ngl')} over --rpc {_opt(split_argv, '--rpc')}"
        if _opt(split_argv, "-ts"):
            split_assign += f", -ts {_opt(split_argv, '-ts')}"
        ref_hosts = [head]
    tol, tol_why = backend_class(prof, sorted({*ref_hosts, *rpc_hosts, head}), opts.backends)
    return VerifyReport(
        profile=prof.name,
        model=model,
        model_source=source,
        tolerance=tol,
        backends_why=tol_why,
        reference=Placement("reference", ref_kind, ref_argv, ref_hosts, ref_assign),
        split=Placement("split", "split", split_argv, [*rpc_hosts, head], split_assign),
        reference_why=why,
        prompt_texts=list(opts.prompts),
        n_predict=opts.n_predict,
        n_probs=opts.n_probs,
    )


def verify(
    prof: Profile,
    opts: VerifyOptions,
    bins,
    *,
    say: Callable[[str], None] = lambda _m: None,
    dry_run: bool = False,
    runner=None,
    check_endpoints: bool = True,
) -> VerifyReport:
    from linkctl.core.paths import state_dir
    from linkctl.core.runner import default_runner

    t0 = time.monotonic()
    runner = runner or default_runner()
    opts.check()
    resolve_model(opts)  # bad input is refused before anything is contacted
    bins.need("llama-server")
    if check_endpoints and not dry_run:
        # A busy rpc-server (the head's llama-server holds it) would hang our split.
        from linkctl.llama.bins import local_rpc_protocol
        from linkctl.serve import plan as sv

        local = local_rpc_protocol(bins) if bins.rpc_server else None
        for e in sv.check_endpoints(prof, local, bins.build(), timeout=5.0):
            say(f"rpc endpoint {e['name']} {e['host']}:{e['port']}: protocol {e['version']}")
    rep = plan(prof, opts, bins, say, runner, dry_run=dry_run)
    rep.dry_run = dry_run
    if dry_run:
        rep.elapsed_s = time.monotonic() - t0
        return rep
    log_dir = state_dir() / "verify"
    log_dir.mkdir(parents=True, exist_ok=True)
    results: dict[str, list[list[Step]]] = {}
    for pl in (rep.reference, rep.split):
        try:
            results[pl.role], t = run_prompts(pl, opts, log_dir, say, runner)
            rep.timings.update({k: round(v, 2) for k, v in t.items()})
        except CheckFailed as e:
            rep.add(
                pl.role,
                "FAIL",
                f"{pl.kind}: {e.message}",
                f"see {log_dir / (pl.role + '.log')}",
            )
            rep.elapsed_s = time.monotonic() - t0
            return rep
        bufs = ", ".join(f"{k} {v:.1f} MiB" for k, v in pl.buffers_mib.items())
        rep.add(
            pl.role, "PASS", f"{pl.kind}: {pl.assignment}" + (f"; weights: {bufs}" if bufs else "")
        )
    for i, (prompt, ref, got) in enumerate(
        zip(opts.prompts, results["reference"], results["split"], strict=True), 1
    ):
        pr = compare(prompt, ref, got, rep.tolerance)
        rep.prompts.append(pr)
        rep.add(f"prompt {i}", pr.verdict, pr.detail)
    rep.elapsed_s = time.monotonic() - t0
    return rep
