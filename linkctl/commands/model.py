"""model: write the tiny test model; copy the served model to the prefill host."""

from __future__ import annotations

import sys
from typing import Annotated

import typer

from linkctl.commands.common import (
    DryRunOpt,
    HostOpt,
    JsonOpt,
    ProfileOpt,
    emit_json,
    load_with_host,
)
from linkctl.core.output import console, print_json

model_app = typer.Typer(
    help="Model files: the tiny test model, and sync to the prefill host.", no_args_is_help=True
)


def register(app: typer.Typer) -> None:
    app.add_typer(model_app, name="model")


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


@model_app.command("sync")
def model_sync(
    profile: ProfileOpt = None,
    host: HostOpt = None,
    model: Annotated[
        str | None,
        typer.Option("--model", "-m", help="The file to copy (default: serve.model)."),
    ] = None,
    dry_run: DryRunOpt = False,
    json_: JsonOpt = False,
) -> None:
    """Copy the model from the head to the prefill host over the link.

    Through the prefill host's kv-agent (running under `linkctl serve` there, or
    `linkctl kv-agent`), from this host's link address to its link address, into
    its models directory, where serve.mode = "disaggregated" looks for it. An
    interrupted copy resumes where it stopped (the partial file's SHA-256 is
    checked first); the file appears there only when the SHA-256 of every byte
    matches.

    Examples:
      linkctl model sync --dry-run
      linkctl model sync --model /models/m.gguf
    """
    from pathlib import Path

    from linkctl.core.errors import InputError
    from linkctl.core.log import speaker
    from linkctl.disagg import kvxfer
    from linkctl.disagg import plan as disagg
    from linkctl.trust.secret import load

    prof, h, _backend, path = load_with_host(profile, host)
    if h.role != "head":
        raise InputError(
            f"model sync runs on the head ({prof.head.name}), this is {h.name}",
            f"run it on {prof.head.name}",
        )
    src = Path(model or prof.serve.model)
    if not src.is_file():
        raise InputError(f"model {str(src)!r} is not a file", "set serve.model or pass --model")
    pre = prof.prefill_host
    if prof.serve.disagg.prefill_model:
        raise InputError(
            f"serve.disagg.prefill_model = {prof.serve.disagg.prefill_model!r} names the "
            f"model's path on {pre.name}: there is nothing to sync",
            "remove serve.disagg.prefill_model to let sync place it",
        )
    port = prof.serve.disagg.agent_port
    plan = {
        "source": str(src),
        "bytes": src.stat().st_size,
        "to": f"{pre.name} {pre.ip}:{port} models/{src.name}",
        "from_address": h.ip,
        "path_there": disagg.prefill_model_path(prof),
    }
    if dry_run:
        emit_json(plan, path) if json_ else [console.print(f"{k:13s} {v}") for k, v in plan.items()]
        return
    say = speaker("model-sync")
    last = [-1]

    def progress(done: int, total: int) -> None:
        pct = done * 100 // total if total else 100
        if pct != last[0] and (pct % 5 == 0 or done == total):
            last[0] = pct
            sys.stderr.write(f"\r{src.name}: {done / 2**20:.0f}/{total / 2**20:.0f} MiB {pct}%")
            sys.stderr.flush()

    res = kvxfer.put(
        pre.ip, port, "models", src, secret=load(prof.name), source=h.ip, progress=progress
    )
    sys.stderr.write("\n")
    out = plan | res.as_dict()
    if json_:
        emit_json(out, path)
    else:
        resumed = f", resumed from {res.resumed_from} bytes" if res.resumed_from else ""
        say(
            f"{src.name} -> {pre.name}:{plan['path_there']}: {res.bytes} bytes in "
            f"{res.seconds:.2f} s ({res.gbps:.2f} Gbit/s){resumed}, "
            f"sha256 {(res.sha256 or '')[:16]} verified"
        )
