"""llama find: every llama.cpp build linkctl can see, with version and RPC protocol."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from linkctl.commands.common import JsonOpt, ProfileOpt
from linkctl.core.output import console, print_json, warn_line

llama_app = typer.Typer(help="The llama.cpp binaries linkctl finds and runs.", no_args_is_help=True)


def register(app: typer.Typer) -> None:
    app.add_typer(llama_app, name="llama")


@llama_app.command("find")
def llama_find(
    profile: ProfileOpt = None,
    host: Annotated[
        str | None,
        typer.Option(
            "--host", help="Also search this profile host's llama_bin_dir.", show_default=False
        ),
    ] = None,
    bin_dir: Annotated[
        Path | None,
        typer.Option("--llama-bin-dir", help="Search this directory first.", show_default=False),
    ] = None,
    no_protocol: Annotated[
        bool,
        typer.Option(
            "--no-protocol",
            help="Do not start each rpc-server on 127.0.0.1 to learn its RPC protocol.",
        ),
    ] = False,
    json_: JsonOpt = False,
) -> None:
    """List every llama-server / rpc-server found, in the order linkctl searches:
    the profile's llama_bin_dir, $LINKCTL_LLAMA_BIN, PATH, scripts/build-llama.sh's
    cache, a source build's build/bin ($LLAMA_CPP_DIR, ~/llama.cpp), Homebrew
    (/opt/homebrew/bin, /usr/local/bin). Each with llama-server's version and its
    rpc-server's RPC protocol (asked with HELLO on 127.0.0.1); '*' marks what serve
    runs. Exit 1 when nothing is found.

    Examples:
      linkctl llama find
      linkctl llama find --profile dgx-mac --host dgx --json
    """
    from linkctl.commands.common import load
    from linkctl.llama.bins import candidates

    directory = str(bin_dir) if bin_dir else None
    path = None
    if host and not directory:
        prof, path = load(profile)
        directory = prof.host(host).llama_bin_dir
    found = candidates(directory, protocol=not no_protocol)
    protocols = {c.rpc_protocol for c in found if c.rpc_protocol}
    if json_:
        # profile_path: the profile --host was read from (null when none was needed).
        print_json(
            {"profile_path": str(path) if path else None, "builds": [c.as_dict() for c in found]}
        )
    else:
        for c in found:
            mark = "*" if c.selected else " "
            console.print(f"{mark} {c.directory}  (via {c.found_via})", markup=False)
            if c.llama_server:
                console.print(
                    f"    llama-server  {c.version or 'version unknown'}"
                    + (f" ({c.build})" if c.build else "")
                    + ("  [serve runs this]" if "llama-server" in c.selected else ""),
                    markup=False,
                )
            if c.rpc_server:
                proto = c.rpc_protocol or (c.error and f"unknown: {c.error}") or "not asked"
                console.print(
                    f"    {Path(c.rpc_server).name}  RPC protocol {proto}"
                    + ("  [serve runs this]" if "rpc-server" in c.selected else ""),
                    markup=False,
                )
            else:
                console.print(
                    "    no rpc-server here: this build may lack GGML_RPC (llama-server "
                    "--rpc needs it)",
                    markup=False,
                )
        if not found:
            console.print("no llama.cpp binaries found", markup=False)
    if len(protocols) > 1:
        warn_line(
            f"builds with different RPC protocols ({', '.join(sorted(protocols))}): "
            "both hosts must run one llama.cpp version (scripts/build-llama.sh on each)"
        )
    if not found:
        raise typer.Exit(1)
