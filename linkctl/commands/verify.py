"""verify: the split computes what one machine computes (head only)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated

import typer

from linkctl.commands.common import (
    CalibrationOpt,
    DryRunOpt,
    HostOpt,
    JsonOpt,
    ProfileOpt,
    emit_json,
    load_with_host,
)
from linkctl.core.output import console, verdict_lines

if TYPE_CHECKING:
    from pathlib import Path

    from linkctl.core.profile import Profile
    from linkctl.llama.bins import LlamaBins
    from linkctl.serve.verify import VerifyOptions, VerifyReport

ModelOpt = Annotated[
    str | None,
    typer.Option(
        "--model",
        "-m",
        help="Model to check (default: a tiny random-weight GGUF linkctl writes; no download).",
        show_default=False,
    ),
]


def render(rep: VerifyReport) -> None:
    if rep.dry_run:
        console.print(f"model      {rep.model} ({rep.model_source})", markup=False)
        console.print(f"tolerance  {rep.tolerance.why} ({rep.backends_why})", markup=False)
        console.print(f"reference  {rep.reference.kind}: {rep.reference_why}", markup=False)
        for pl in (rep.reference, rep.split):
            console.print(f"{pl.role:10} {' '.join(pl.invocation.argv())}", markup=False)
            console.print(f"{'':10} {pl.assignment}", markup=False)
        console.print(
            f"prompts    {len(rep.prompt_texts)} x {rep.n_predict} tokens, greedy, "
            f"top-{rep.n_probs} log-probabilities compared"
        )
        return
    verdict_lines([(ln.verdict, ln.name, ln.detail, ln.fix) for ln in rep.lines])
    console.print(f"tolerance: {rep.tolerance.why} ({rep.backends_why})", markup=False)
    console.print(f"reference: {rep.reference_why}", markup=False)
    console.print(rep.summary(), markup=False)


def run_verify(
    prof: Profile,
    opts: VerifyOptions,
    bins: LlamaBins,
    profile_path: Path,
    *,
    json_: bool = False,
    dry_run: bool = False,
) -> int:
    """Run, print (lines or JSON), return the exit code."""
    from linkctl.core.log import speaker
    from linkctl.serve.verify import record_fingerprint, verify

    rep = verify(prof, opts, bins, say=speaker("verify"), dry_run=dry_run)
    rep.fingerprint = record_fingerprint(rep)
    if json_:
        emit_json(rep.as_dict(), profile_path)
    else:
        render(rep)
    return rep.exit_code


def register(app: typer.Typer) -> None:
    @app.command()
    def verify(
        profile: ProfileOpt = None,
        host: HostOpt = None,
        model: ModelOpt = None,
        reference: Annotated[
            str,
            typer.Option(
                "--reference",
                help="auto: the head alone if the model fits it (estimate's memory model), "
                "else another split; head; split.",
            ),
        ] = "auto",
        backends: Annotated[
            str,
            typer.Option(
                "--backends",
                help="Tolerance class. auto: 'same' when every host's catalog device has "
                "the same ggml backend, else 'mixed'.",
            ),
        ] = "auto",
        split: Annotated[
            str | None,
            typer.Option(
                "--split",
                help="The split to verify, as `linkctl serve --split` (recommended, llama or "
                "W,W,...). Default: serve.split, resolved as serve resolves it.",
                show_default=False,
            ),
        ] = None,
        tokens: Annotated[
            int, typer.Option("--tokens", help="Tokens generated per fixed prompt.")
        ] = 24,
        canary: Annotated[
            bool,
            typer.Option(
                "--canary",
                help="Run the canary now on the llama-server serve runs: the first "
                "serve.canary_tokens positions of the fixed prompts against the "
                "fingerprint the last verify of that model recorded. A FAIL takes the "
                "split out of service (serve.on_fail).",
            ),
        ] = False,
        calibration: CalibrationOpt = None,
        dry_run: DryRunOpt = False,
        json_: JsonOpt = False,
    ) -> None:
        """Prove the split computes what one machine computes, before serving (head only).

        Runs three fixed prompts, greedy, through a reference placement and through
        the split `linkctl serve` runs, one llama-server at a time on 127.0.0.1, and
        compares per generated position the chosen token and the top-8
        log-probabilities (llama-server's n_probs). The reference is the head alone
        when the model fits it, else another split of the same model (the layers
        placed differently). Identical backends must agree exactly on tokens and
        within 1e-4 nats; unlike backends (Metal vs CUDA) within 0.1 nats and no
        token disagreement in the first 16 positions. The rpc hosts must run
        `linkctl serve` and no llama-server may hold them.

        A verify that passes keeps its reference run as the canary's fingerprint
        (serve/fingerprint-*.json): `serve` repeats a short part of it on the live
        server after every start, every serve.canary_interval_s, and with --canary.

        Exit 0 PASS or WARN, 1 FAIL (--canary: anything but PASS), 2 bad input or
        environment.

        Examples:
          linkctl verify
          sudo linkctl verify --canary --json
          linkctl verify --model /models/m.gguf --json
          linkctl verify --reference split --dry-run
          linkctl verify --split llama
        """
        from linkctl.core.privilege import require_writable_state
        from linkctl.llama.bins import find_bins
        from linkctl.serve.verify import VerifyOptions

        if not dry_run:
            require_writable_state("its test model and logs (verify/)")
        prof, h, _backend, path = load_with_host(profile, host)
        if h.role != "head":
            from linkctl.core.errors import InputError

            raise InputError(
                f"verify runs on the head ({prof.head.name}); this host is {h.name} ({h.role})",
                f"run it on {prof.head.name}",
            )
        if canary:
            raise typer.Exit(_canary(prof, model, json_, path))
        bins = find_bins(h.llama_bin_dir)
        opts = VerifyOptions(
            model=model,
            reference=reference,
            backends=backends,
            n_predict=tokens,
            split_spec=split,
            calibration=calibration,
        )
        code = run_verify(prof, opts, bins, path, json_=json_, dry_run=dry_run)
        if code:
            raise typer.Exit(code)


def _canary(prof: Profile, model: str | None, json_: bool, profile_path: Path) -> int:
    """`verify --canary`: the canary on the serving llama-server, its result saved where
    serve's watch takes it in (serve/canary.json)."""
    from linkctl.core.checks import Verdict
    from linkctl.core.records import canary_path, save_record
    from linkctl.llama.client import LlamaServer
    from linkctl.serve.auth import own_headers
    from linkctl.serve.canary import fingerprint_for, run_canary

    s = prof.serve
    target = model or s.model
    fp = fingerprint_for(prof.name, target)
    host = "127.0.0.1" if s.host.is_unspecified else str(s.host)
    server = LlamaServer(host, s.port, headers=own_headers(prof), timeout=60)
    res = run_canary(server, fp, s.canary_tokens, "demand")
    saved = save_record(res, canary_path())
    if json_:
        emit_json({**res.model_dump(mode="json"), "saved": str(saved)}, profile_path)
    else:
        verdict_lines([(res.verdict, "canary", res.detail, None)])
        console.print(f"{res.wall_s} s on {server.url}; saved {saved}", markup=False)
    return 0 if res.verdict is Verdict.PASS else 1
