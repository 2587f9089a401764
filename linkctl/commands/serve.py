"""serve: rpc-server on rpc hosts, llama-server on the head, supervised."""

from __future__ import annotations

import sys
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
from linkctl.core.output import console, warn_line

if TYPE_CHECKING:
    from pathlib import Path

    from linkctl.core.profile import HostSpec, Profile
    from linkctl.llama.bins import LlamaBins
    from linkctl.net.backend import Backend
    from linkctl.serve.split import SplitChoice


def verify_gate(
    prof: Profile, bins: LlamaBins, model: str | None, wait: float, choice: SplitChoice
) -> None:
    """`linkctl verify` on the served model and split before llama-server starts; a FAIL
    stops here."""
    from linkctl.core.errors import CheckFailed
    from linkctl.core.log import speaker
    from linkctl.llama import rpc
    from linkctl.serve.verify import VerifyOptions, record_fingerprint, verify

    say = speaker("verify")
    for h in prof.rpc_hosts:  # the rpc hosts may still be starting, as run_head allows
        rpc.wait_ready(h.rpc_bind, h.rpc.port, wait)
    rep = verify(prof, VerifyOptions(model=model, split=choice), bins, say=say)
    rep.fingerprint = record_fingerprint(rep)
    if rep.fingerprint:
        say(f"canary fingerprint: {rep.fingerprint}")
    for ln in rep.lines:
        say(f"{ln.verdict} {ln.name}: {ln.detail}")
    say(rep.summary())
    if rep.exit_code:
        raise CheckFailed(
            f"verify failed, not serving: {rep.summary()}",
            "see the lines above; run `linkctl verify --model MODEL` to reproduce",
        )


def register(app: typer.Typer) -> None:
    @app.command()
    def serve(
        profile: ProfileOpt = None,
        host: HostOpt = None,
        model: Annotated[
            str | None,
            typer.Option(
                "--model",
                "-m",
                help="Model file (overrides serve.model; head only).",
                show_default=False,
            ),
        ] = None,
        skip_probe: Annotated[
            bool, typer.Option("--skip-probe", help="Serve without a passing probe report (warns).")
        ] = False,
        wait: Annotated[
            float,
            typer.Option("--wait", help="Head: seconds to wait for the rpc endpoints to answer."),
        ] = 60.0,
        split: Annotated[
            str | None,
            typer.Option(
                "--split",
                help="Head: layer split. recommended (the estimate's fastest split that "
                "fits, from the saved probe report and calibrations), llama (llama.cpp's "
                "own, by free memory) or weights W,W,... in llama.cpp order (rpc hosts in "
                "--rpc order, then the head's GPU). Default: serve.split (recommended).",
                show_default=False,
            ),
        ] = None,
        calibration: CalibrationOpt = None,
        verify: Annotated[
            bool,
            typer.Option(
                "--verify",
                help="Head: run `linkctl verify` on the model first; a FAIL refuses to serve "
                "(also serve.verify = true in the profile).",
            ),
        ] = False,
        dry_run: DryRunOpt = False,
        json_: JsonOpt = False,
    ) -> None:
        """Start this host's half of the pair and keep it running.

        rpc host: ggml-rpc-server bound to the link address only, ready when HELLO
        answers. Head: gate on the probe report, HELLO every rpc endpoint and compare
        RPC protocol versions, then llama-server --rpc ... -ts <split>, ready when /health
        answers. Both restart their server with backoff and forward SIGTERM/SIGINT.
        With --verify (or serve.verify = true) the head first proves with
        `linkctl verify` that the split computes what one machine computes.
        While it serves, both hosts watch the link, the live RPC connection, rpc-server
        and decode/prefill rates every serve.watch_interval_s, and the head repeats
        verify's canary; a FAIL applies serve.on_fail (stop, fallback to the head
        alone, keep). `linkctl status --watch` shows it.
        It writes its status to the state directory: once root's /var/lib/linkctl
        exists, run it with sudo (--dry-run reads only, as any user).

        Examples:
          linkctl serve --dry-run
          linkctl serve --host mac --split llama
          linkctl serve --host mac --verify
          linkctl serve --host mac --split 40,41 --dry-run --json
          linkctl serve --profile dgx-mac --host dgx
          linkctl serve --host mac --model /models/m.gguf
        """
        from linkctl.core.privilege import require_writable_state
        from linkctl.llama.bins import find_bins
        from linkctl.serve import auth, run
        from linkctl.serve import plan as sv
        from linkctl.serve.split import choose_split

        if not dry_run:
            require_writable_state("its status (serve/)")
        prof, h, backend, path = load_with_host(profile, host)
        bins = find_bins(h.llama_bin_dir)

        def head_split() -> SplitChoice:
            return choose_split(prof, model or prof.serve.model, split, calibration=calibration)

        if prof.serve.mode == "disaggregated":
            if verify or prof.serve.verify:
                from linkctl.core.errors import InputError

                raise InputError(
                    "--verify / serve.verify checks a layer split, and serve.mode = "
                    '"disaggregated" runs none (each host holds the whole model)',
                    'drop --verify / serve.verify, or use serve.mode = "split"',
                )
            _serve_disaggregated(prof, h, backend, bins, model, skip_probe, dry_run, json_, path)
            return
        if dry_run:
            choice = head_split() if h.role == "head" else None
            plan = sv.build_plan(prof, h, bins, model, choice)
            if h.role == "head" and (verify or prof.serve.verify):
                plan.notes.append("verify: `linkctl verify` runs on the model before llama-server")
            if json_:
                emit_json(plan.as_dict(), path)
                return
            for note in plan.notes:
                console.print(f"[cyan]note:[/] {note}")
            for b in (bins.rpc_server, bins.llama_server):
                if b:
                    console.print(
                        f"bin  {b.name}: {b.path} (via {b.found_via}"
                        f"{', ' + b.version if b.version else ''})",
                        markup=False,
                    )
            for name, inv in plan.rpc.items():
                console.print(f"rpc  {name}: {' '.join(inv.argv())}", markup=False)
            console.print(f"head {prof.head.name}: {' '.join(plan.head.argv())}", markup=False)
            if choice is not None:
                console.print(choice.summary(), markup=False)
            return
        if h.role == "rpc":
            plan = sv.build_plan(prof, h, bins, model)
            if json_:
                emit_json(plan.as_dict(), path)
            bins.need("rpc-server")
            raise typer.Exit(run.run_rpc(plan, prof, h, backend))
        auth.serve_auth(prof)  # an open API is refused before anything starts
        bins.need("llama-server")
        run.model_path_check(model or prof.serve.model)
        _probe_gate(prof, h, backend, skip_probe)
        choice = head_split()
        plan = sv.build_plan(prof, h, bins, model, choice)
        if json_:
            emit_json(plan.as_dict(), path)
        if verify or prof.serve.verify:
            verify_gate(prof, bins, plan.model, wait, choice)
        raise typer.Exit(run.run_head(plan, prof, bins, wait_s=wait, split=choice, backend=backend))


def _probe_gate(prof: Profile, h: HostSpec, backend: Backend, skip_probe: bool) -> None:
    """The head serves only over a link with a passing probe report (or --skip-probe);
    as root (launchd's serve, `sudo linkctl serve`) a report that has aged is probed
    again. systemd's serve unit runs without privileges: its ExecStartPre does that."""
    from linkctl.core.privilege import is_root
    from linkctl.probe import probe_again
    from linkctl.serve.run import probe_gate

    if skip_probe:
        warn_line("--skip-probe: serving without a passing probe report for this link")
        return

    def reprobe(peer: HostSpec):
        sys.stderr.write(f"linkctl: probing {peer.name} again: its report has aged\n")
        return probe_again(prof, h, peer, backend)

    for line in probe_gate(prof, h, reprobe=reprobe if is_root() else None):
        sys.stderr.write(f"linkctl: {line}\n")


def _serve_disaggregated(
    prof: Profile,
    h: HostSpec,
    backend: Backend,
    bins: LlamaBins,
    model: str | None,
    skip_probe: bool,
    dry_run: bool,
    json_: bool,
    profile_path: Path,
) -> None:
    """serve.mode = "disaggregated": the prefill host runs the prefill llama-server and
    the kv-agent on its link address; the head runs the decode llama-server and route."""
    from linkctl.core.errors import InputError
    from linkctl.disagg import plan as disagg
    from linkctl.disagg import run
    from linkctl.serve.auth import read_api_keys, serve_auth
    from linkctl.serve.run import model_path_check

    # route listens on serve.host: the same API rule as the split mode; the prefill
    # host's llama-server reads the same key file (its path, on that host).
    auth = serve_auth(prof) if h.role == "head" else None
    if auth is None and prof.serve.api_key_file:
        read_api_keys(prof.serve.api_key_file)
    binary = bins.llama_server.path if bins.llama_server else "llama-server"
    plan = disagg.build_plan(prof, h, binary, model)
    if dry_run:
        if json_:
            emit_json(plan.as_dict(), profile_path)
            return
        for note in plan.notes:
            console.print(f"[cyan]note:[/] {note}")
        pre, head = prof.prefill_host.name, prof.head.name
        console.print(f"prefill {pre}: {' '.join(plan.prefill.argv())}", markup=False)
        console.print(f"kv-agent {pre}: {plan.agent}", markup=False)
        console.print(f"decode  {head}: {' '.join(plan.decode.argv())}", markup=False)
        console.print(f"route   {head}: {plan.route_listen}", markup=False)
        return
    if json_:
        emit_json(plan.as_dict(), profile_path)
    bins.need("llama-server")
    if h.role != "head":
        if h.name != prof.prefill_host.name:
            raise InputError(
                f"{h.name} is not serve.disagg.prefill_host ({prof.prefill_host.name})",
                "run serve on the prefill host and the head only",
            )
        # No model check here: the kv-agent starts first, so `model sync` can bring it.
        raise typer.Exit(run.run_prefill(plan, prof, h, backend))
    model_path_check(plan.decode.model)
    assert auth is not None
    sys.stderr.write(f"linkctl: {auth.summary().replace('llama-server', 'route')}\n")
    _probe_gate(prof, h, backend, skip_probe)
    raise typer.Exit(run.run_decode(plan, prof))
