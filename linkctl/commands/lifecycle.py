"""up and down: this host's end of the pair, from bare to serving and back."""

from __future__ import annotations

from typing import Annotated

import typer

from linkctl.commands.common import DryRunOpt, HostOpt, JsonOpt, LlamaBinDirOpt, ProfileOpt
from linkctl.core.output import console, print_json


def _host(profile: str | None, host: str | None, why: str):
    """The profile, this host of it, the backend and the profile's path (said first on
    stderr), after the one-line refusal of a user who is not root: before anything
    else, the profile's own file included."""
    from linkctl.commands.common import load_with_host
    from linkctl.core.privilege import require_root

    require_root(why)
    return load_with_host(profile, host)


def _show(res, json_: bool) -> None:
    if json_:
        print_json(res.as_dict())
        return
    for st in res.stages:
        mark = "changed" if st.changed else "ok"
        console.print(f"  {st.name:12} {mark:8} {st.detail}", markup=False)
    for note in getattr(res, "notes", []):
        console.print(f"[cyan]note:[/] {note}")
    console.print(res.summary(), markup=False)


def register(app: typer.Typer) -> None:
    @app.command()
    def up(
        profile: ProfileOpt = None,
        host: HostOpt = None,
        no_boot: Annotated[
            bool,
            typer.Option(
                "--no-boot",
                help="A one-off: run the services now, not at every boot (the link "
                "configuration itself persists as setup makes it; `down` removes it).",
            ),
        ] = False,
        wait: Annotated[
            float,
            typer.Option(
                "--wait",
                metavar="SECONDS",
                help="How long to wait for the peer's probe gate to pass (run up on the "
                "other host within this time).",
            ),
        ] = 300.0,
        serve_wait: Annotated[
            float,
            typer.Option(
                "--serve-wait",
                metavar="SECONDS",
                help="How long to wait for this host's server once the link passed "
                "(a large model takes minutes to load).",
            ),
        ] = 300.0,
        llama_bin_dir: LlamaBinDirOpt = None,
        dry_run: DryRunOpt = False,
        json_: JsonOpt = False,
    ) -> None:
        """Bring this host's end of the pair up and keep it up: link, responder, the
        probe gate against the peer, calibration, serve, boot services.

        Run it on each host (as root), the second within --wait of the first. Stages,
        each said on stderr: preflight (refuses before changing anything: not root, the
        profile does not match this machine, no llama.cpp, no model), link setup,
        calibration when this host has none for its llama.cpp build, the services
        (systemd units / launchd daemons: responder, link + probe gate, serve), the
        peer's probe gate, and this host's server answering. The last line says what
        serves and how to reach it. Running it again changes nothing and says so. A
        peer that stays away past --wait undoes everything (exit 1, the probe's
        reason). `linkctl down` undoes it all.

        Examples:
          sudo linkctl up --profile dgx-mac --dry-run
          sudo linkctl up --profile dgx-mac
          sudo linkctl up --profile dgx-mac --host mac --no-boot --json
        """
        from linkctl.core.log import speaker
        from linkctl.lifecycle.up import UpOptions
        from linkctl.lifecycle.up import up as run_up

        prof, h, backend, path = _host(
            profile, host, "up configures the link and installs the services"
        )
        opts = UpOptions(
            boot=not no_boot,
            wait_s=wait,
            serve_wait_s=serve_wait,
            llama_bin_dir=llama_bin_dir,
            dry_run=dry_run,
        )
        _show(run_up(prof, path, h, backend, opts, say=speaker("up")), json_)

    @app.command()
    def down(
        profile: ProfileOpt = None,
        host: HostOpt = None,
        dry_run: DryRunOpt = False,
        json_: JsonOpt = False,
    ) -> None:
        """Undo `linkctl up` on this host: stop and remove the services (and what they
        wrote), tear the link configuration down, and put linkctl's state back as it
        was before up. Running it twice is harmless.

        Examples:
          sudo linkctl down --dry-run
          sudo linkctl down --profile dgx-mac --json
        """
        from linkctl.core.log import speaker
        from linkctl.lifecycle.down import down as run_down

        prof, h, backend, path = _host(
            profile, host, "down removes the services and the link configuration"
        )
        _show(run_down(prof, path, h, backend, say=speaker("down"), dry_run=dry_run), json_)
