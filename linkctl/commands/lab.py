"""lab up / down / exec / show: namespaces standing in for the profile's hosts."""

from __future__ import annotations

from typing import Annotated

import typer

from linkctl.commands.common import JsonOpt, ProfileOpt, load
from linkctl.output import console, print_json

lab_app = typer.Typer(
    help="Network namespaces that stand in for the profile's hosts (198.18.0.0/15 only).",
    no_args_is_help=True,
)
NameOpt = Annotated[str, typer.Option("--name", help="Lab name (namespaces are lk-NAME-HOST).")]


@lab_app.command("up")
def lab_up(profile: ProfileOpt = None, name: NameOpt = "lab", json_: JsonOpt = False) -> None:
    """Create one namespace per profile host, the link between them, and a wifi router.

    Example:
      linkctl lab up --profile dgx-mac
      linkctl lab exec dgx -- linkctl setup
    """
    from linkctl import lab

    prof, _ = load(profile)
    lb = lab.up(prof, name)
    if json_:
        print_json(lb.as_dict())
        return
    console.print(
        f"lab {lb.name!r} up from profile {prof.name!r}; remapped profile: {lb.profile_path}"
    )
    for h in lb.hosts:
        console.print(
            f"  {h.name:8} netns {h.netns:18} {h.interface:8} {h.address:18} "
            f"default via {h.gateway} dev wlan0",
            markup=False,
        )


@lab_app.command("down")
def lab_down(name: NameOpt = "lab", json_: JsonOpt = False) -> None:
    """Stop every process in the lab's namespaces and remove them (idempotent)."""
    from linkctl import lab

    removed = lab.down(name)
    if json_:
        print_json({"removed": removed})
    else:
        console.print(
            f"lab {name!r}: removed {len(removed)} item(s)"
            if removed
            else f"lab {name!r}: nothing to remove"
        )


@lab_app.command("show")
def lab_show(name: NameOpt = "lab", json_: JsonOpt = False) -> None:
    """Show a running lab."""
    from linkctl import lab

    lb = lab.load_lab(name)
    if json_:
        print_json(lb.as_dict())
    else:
        for h in lb.hosts:
            console.print(f"{h.name:8} {h.netns:18} {h.interface:8} {h.address}", markup=False)


@lab_app.command(
    "exec",
    context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
)
def lab_exec(
    ctx: typer.Context,
    host: Annotated[str, typer.Argument(help="Profile host name.")],
    name: NameOpt = "lab",
) -> None:
    """Run a command inside a host's namespace, with the lab profile and host preset.

    Example: linkctl lab exec dgx -- linkctl status
    """
    import subprocess

    from linkctl import lab

    argv, env = lab.exec_argv(lab.load_lab(name), host, list(ctx.args))
    # Passthrough: the command talks to the user's terminal directly.
    raise typer.Exit(subprocess.call(argv, env=env))


def register(app: typer.Typer) -> None:
    app.add_typer(lab_app, name="lab")
