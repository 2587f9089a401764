"""serve: rpc-server on rpc hosts, llama-server on the head, supervised; model write-tiny."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from linkctl.commands.common import DryRunOpt, HostOpt, JsonOpt, ProfileOpt, load_with_host
from linkctl.core.output import console, print_json, warn_line

model_app = typer.Typer(help="Model files for tests and the lab.", no_args_is_help=True)


@model_app.command("write-tiny")
def write_tiny(
    path: Annotated[str, typer.Argument(help="Where to write the .gguf file.")],
    layers: Annotated[int, typer.Option("--layers", help="Transformer blocks.")] = 4,
    embd: Annotated[int, typer.Option("--embd", help="Embedding width.")] = 64,
    ff: Annotated[int, typer.Option("--ff", help="Feed-forward width.")] = 128,
    seed: Annotated[int, typer.Option("--seed", help="Random seed (same seed, same bytes).")] = 0,
    json_: JsonOpt = False,
) -> None:
    """Write a tiny random-weight llama GGUF (byte-level vocab); nothing is downloaded.

    Example: linkctl model write-tiny /tmp/tiny.gguf --layers 4
    """
    from linkctl.gguf.tiny import TinySpec, write_tiny_llama

    info = write_tiny_llama(path, TinySpec(n_layer=layers, n_embd=embd, n_ff=ff, seed=seed))
    if json_:
        print_json(info)
    else:
        console.print(
            f"wrote {info['path']}: {info['params']} params, {info['n_layer']} layers, "
            f"{info['bytes']} bytes",
            markup=False,
        )


def verify_gate(prof, bins, model: str | None, wait: float, choice=None) -> None:
    """`linkctl verify` on the served model and split before llama-server starts; a FAIL
    stops here."""
    from linkctl.commands.verify import say
    from linkctl.core.errors import CheckFailed
    from linkctl.llama import rpc
    from linkctl.serve.verify import VerifyOptions, verify

    for h in prof.rpc_hosts:  # the rpc hosts may still be starting, as run_head allows
        rpc.wait_ready(h.rpc_bind, h.rpc.port, wait)
    rep = verify(prof, VerifyOptions(model=model, split=choice), bins, say=say)
    for ln in rep.lines:
        say(f"{ln['verdict']} {ln['check']}: {ln['detail']}")
    say(rep.summary())
    if rep.exit_code:
        raise CheckFailed(
            f"verify failed, not serving: {rep.summary()}",
            "see the lines above; run `linkctl verify --model MODEL` to reproduce",
        )


def register(app: typer.Typer) -> None:
    app.add_typer(model_app, name="model")

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
        calibration: Annotated[
            list[Path] | None,
            typer.Option(
                "--calibration",
                help="Extra calibration.json for the estimate (e.g. copied from the rpc "
                "host); repeatable.",
                show_default=False,
            ),
        ] = None,
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

        Examples:
          linkctl serve --dry-run
          linkctl serve --host mac --split llama
          linkctl serve --host mac --verify
          linkctl serve --host mac --split 40,41 --dry-run --json
          linkctl serve --profile dgx-mac --host dgx
          linkctl serve --host mac --model /models/m.gguf
        """
        from linkctl.llama.bins import find_bins
        from linkctl.serve import plan as sv

        prof, h, backend = load_with_host(profile, host)
        bins = find_bins(h.llama_bin_dir)

        def head_split() -> sv.SplitChoice:
            return sv.choose_split(prof, model or prof.serve.model, split, calibration=calibration)

        if prof.serve.mode == "disaggregated":
            if verify or prof.serve.verify:
                from linkctl.core.errors import InputError

                raise InputError(
                    "--verify / serve.verify checks a layer split, and serve.mode = "
                    '"disaggregated" runs none (each host holds the whole model)',
                    'drop --verify / serve.verify, or use serve.mode = "split"',
                )
            _serve_disaggregated(prof, h, backend, bins, model, skip_probe, dry_run, json_)
            return
        if dry_run:
            choice = head_split() if h.role == "head" else None
            plan = sv.build_plan(prof, h, bins, model, choice)
            if h.role == "head" and (verify or prof.serve.verify):
                plan.notes.append("verify: `linkctl verify` runs on the model before llama-server")
            if json_:
                print_json(plan.as_dict())
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
            for name, argv in plan.rpc_argv.items():
                console.print(f"rpc  {name}: {' '.join(argv)}", markup=False)
            console.print(f"head {prof.head.name}: {' '.join(plan.head_argv)}", markup=False)
            if choice is not None:
                console.print(choice.summary(), markup=False)
            return
        if h.role == "rpc":
            plan = sv.build_plan(prof, h, bins, model)
            if json_:
                print_json(plan.as_dict())
            bins.need("rpc-server")
            raise typer.Exit(sv.run_rpc(plan, h, backend))
        sv.serve_auth(prof)  # an open API is refused before anything starts
        bins.need("llama-server")
        sv.model_path_check(model or prof.serve.model)
        if skip_probe:
            warn_line("--skip-probe: serving without a passing probe report for this link")
        else:
            import sys

            for line in sv.probe_gate(prof, h):
                sys.stderr.write(f"linkctl: {line}\n")
        choice = head_split()
        plan = sv.build_plan(prof, h, bins, model, choice)
        if json_:
            print_json(plan.as_dict())
        if verify or prof.serve.verify:
            verify_gate(prof, bins, plan.model, wait, choice)
        raise typer.Exit(sv.run_head(plan, prof, bins, wait_s=wait, split=choice))


def _serve_disaggregated(prof, h, backend, bins, model, skip_probe, dry_run, json_) -> None:
    """serve.mode = "disaggregated": the prefill host runs the prefill llama-server and
    the kv-agent on its link address; the head runs the decode llama-server and route."""
    import sys

    from linkctl.disagg import plan as disagg
    from linkctl.serve import plan as sv

    # route listens on serve.host: the same API rule as the split mode; the prefill
    # host's llama-server reads the same key file (its path, on that host).
    auth = sv.serve_auth(prof) if h.role == "head" else None
    if auth is None and prof.serve.api_key_file:
        sv.read_api_keys(prof.serve.api_key_file)
    binary = bins.llama_server.path if bins.llama_server else "llama-server"
    plan = disagg.build_plan(prof, h, binary, model)
    if dry_run:
        if json_:
            print_json(plan.as_dict())
            return
        for note in plan.notes:
            console.print(f"[cyan]note:[/] {note}")
        console.print(
            f"prefill {prof.prefill_host.name}: {' '.join(plan.prefill_argv)}", markup=False
        )
        console.print(f"kv-agent {prof.prefill_host.name}: {plan.agent}", markup=False)
        console.print(f"decode  {prof.head.name}: {' '.join(plan.decode_argv)}", markup=False)
        console.print(f"route   {prof.head.name}: {plan.route_listen}", markup=False)
        return
    if json_:
        print_json(plan.as_dict())
    bins.need("llama-server")
    if h.role != "head":
        if h.name != prof.prefill_host.name:
            from linkctl.core.errors import InputError

            raise InputError(
                f"{h.name} is not serve.disagg.prefill_host ({prof.prefill_host.name})",
                "run serve on the prefill host and the head only",
            )
        # No model check here: the kv-agent starts first, so `model sync` can bring it.
        raise typer.Exit(disagg.run_prefill(plan, prof, h, backend))
    sv.model_path_check(plan.argv[plan.argv.index("-m") + 1])
    assert auth is not None
    sys.stderr.write(f"linkctl: {auth.summary().replace('llama-server', 'route')}\n")
    if skip_probe:
        warn_line("--skip-probe: serving without a passing probe report for this link")
    else:
        for line in sv.probe_gate(prof, h):
            sys.stderr.write(f"linkctl: {line}\n")
    raise typer.Exit(disagg.run_decode(plan, prof, plan.argv[plan.argv.index("-m") + 1]))
