"""pair: two hosts on one cable find each other and write the same profile."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from linkctl.commands.common import DryRunOpt, JsonOpt, LlamaBinDirOpt
from linkctl.core.output import console, print_json


def register(app: typer.Typer) -> None:
    @app.command()
    def pair(
        interface: Annotated[
            str | None,
            typer.Option(
                "--interface",
                "-i",
                help="The port the cable is in (default: the one wired port with a carrier, "
                "not the default route's, not WiFi, no address of another network).",
                show_default=False,
            ),
        ] = None,
        name: Annotated[
            str | None,
            typer.Option(
                "--name", help="The profile's name (default: HEAD-RPC).", show_default=False
            ),
        ] = None,
        subnet: Annotated[
            str | None,
            typer.Option(
                "--subnet",
                help="The link's IPv4 subnet (default: 192.168.100.0/24, else the first "
                "free 192.168.N.0/30; either must overlap nothing on either host).",
                show_default=False,
            ),
        ] = None,
        head: Annotated[
            str | None,
            typer.Option(
                "--head",
                help="Which host runs llama-server (default: the one with more usable "
                "accelerator memory).",
                show_default=False,
            ),
        ] = None,
        model: Annotated[
            str | None,
            typer.Option(
                "--model",
                "-m",
                help="serve.model: the GGUF's absolute path on the head (on one host or "
                "the same on both).",
                show_default=False,
            ),
        ] = None,
        host: Annotated[
            str | None,
            typer.Option(
                "--host",
                envvar="LINKCTL_HOST",
                help="This host's name in the profile (default: its host name).",
                show_default=False,
            ),
        ] = None,
        write: Annotated[
            Path | None,
            typer.Option(
                "--write",
                help="Where to write the profile (default: /etc/linkctl/profiles/NAME.toml).",
                show_default=False,
            ),
        ] = None,
        window: Annotated[
            float,
            typer.Option(
                "--window", metavar="SECONDS", help="How long to wait for the other host."
            ),
        ] = 120.0,
        yes: Annotated[
            bool,
            typer.Option(
                "--yes",
                help="Accept the pairing code without asking (scripts; both screens "
                "still show it).",
            ),
        ] = False,
        no_setup: Annotated[
            bool,
            typer.Option("--no-setup", help="Write the profile only: no setup, no probe."),
        ] = False,
        llama_bin_dir: LlamaBinDirOpt = None,
        dry_run: DryRunOpt = False,
        json_: JsonOpt = False,
    ) -> None:
        """Pair this host with the one at the other end of the cable: run it on both
        within --window seconds (as root).

        Over IPv6 link-local on the cable's port only (no IPv4, nothing routed), each
        host announces its name, OS, port and MAC, accelerator and memory, llama.cpp
        build and RPC protocol, and MTU. Both screens show one code: confirm it on each
        (or --yes), so a third host on a shared segment cannot pair silently. Both then
        write the same profile (subnet free on both, the head the host with more
        usable memory), run setup and probe on the new link, and print the `linkctl up`
        line for each host. Refusals (exit 2, nothing written): a second peer, a
        malformed announcement, another linkctl or RPC protocol, clocks apart, a
        subnet in use, a port that loses its carrier, no peer within the window.

        Examples:
          sudo linkctl pair
          sudo linkctl pair --interface enP7s7 --name spark-studio --dry-run
          sudo linkctl pair --yes --no-setup --json
        """
        import sys

        from linkctl.core.errors import InputError
        from linkctl.core.log import speaker
        from linkctl.core.privilege import require_root
        from linkctl.net.backend import get_backend
        from linkctl.pair.run import PairOptions
        from linkctl.pair.run import pair as run_pair

        require_root("pairing binds to the cable's port and writes /etc/linkctl")
        if not yes and not sys.stdin.isatty():
            raise InputError(
                "pair shows a code to confirm on both screens, and stdin is not a terminal",
                "run it on a terminal, or pass --yes (scripts)",
            )
        opts = PairOptions(
            interface=interface,
            name=name,
            subnet=subnet,
            head=head,
            host=host,
            model=model,
            write=write,
            llama_bin_dir=llama_bin_dir,
            window_s=window,
            setup=not no_setup,
            dry_run=dry_run,
        )

        def ask(code: str, peer) -> bool:
            return typer.confirm(f"Does {peer.host}'s screen show {code}?", err=True)

        backend = get_backend()
        res = run_pair(
            opts, backend, say=speaker("pair"), confirm=None if yes else ask, runner=backend.runner
        )
        if json_:
            print_json(res.as_dict())
            return
        if res.diff:
            console.print(res.diff, markup=False, end="")
        if res.dry_run:
            console.print(res.profile_text, markup=False, end="")
            console.print("dry run: nothing written", markup=False)
        for line in res.up_lines:
            console.print(line, markup=False)
