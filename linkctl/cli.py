"""The linkctl command line: thin, every command a call into a module.

Heavy modules (pyroute2, scapy, gguf) are imported inside the commands so
`linkctl --help` stays fast.
"""

from __future__ import annotations

import copy
import inspect
import os
import re
import sys
from typing import Any

# Plain click help: typer's rich help pulls in rich.markdown and markdown-it,
# tripling `linkctl --help` start-up time. Tables and progress still use rich.
os.environ.setdefault("TYPER_USE_RICH", "0")
# linkctl's models validate the same whatever pydantic plugins this Python has; looking
# for them scans every installed package's entry points (importlib.metadata, ~20 ms a
# command). typer turns the scan off the same way while it builds its adapters.
os.environ.setdefault("PYDANTIC_DISABLE_PLUGINS", "__all__")

import typer

from linkctl import __version__
from linkctl.commands import (
    disagg,
    doctor,
    estimate,
    key,
    lab,
    lifecycle,
    link,
    llama,
    model,
    pair,
    probe,
    serve,
    service,
    verify,
)
from linkctl.core.errors import LinkctlError

app = typer.Typer(
    name="linkctl",
    help="Verified, measured direct links for llama.cpp RPC split inference.\n\n"
    "\b\n"
    "  sudo linkctl pair                      each host: find the other, write the profile\n"
    "  sudo linkctl up --profile dgx-mac      each host: link, probe gate, serve, at boot\n"
    "  sudo linkctl down                      undo it all\n"
    "  sudo linkctl setup --profile dgx-mac   configure this host's end of the link\n"
    "  sudo linkctl probe                     verify and measure the link\n"
    "  linkctl estimate --model m.gguf        predict decode/prefill tokens/s\n"
    "  sudo linkctl verify                    the split computes what one machine computes\n"
    "  sudo linkctl serve                     launch rpc-server / llama-server\n"
    "  sudo linkctl lab demo                  the whole path in namespaces, one command\n\n"
    "One state for root and users: /var/lib/linkctl once root made it (users read it; "
    "commands that write it need sudo), else ~/.local/state/linkctl; $LINKCTL_STATE_DIR "
    "overrides both.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
for module in (
    lifecycle,
    link,
    lab,
    pair,
    key,
    probe,
    serve,
    disagg,
    model,
    estimate,
    service,
    doctor,
    llama,
    verify,
):
    module.register(app)


def _print_version(value: bool) -> None:
    # Eager: runs while the options are parsed, before click asks for a command.
    if value:
        print(f"linkctl {__version__}")
        raise typer.Exit(0)


@app.callback()
def _root(
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Log every step."),
    version: bool = typer.Option(
        False,
        "--version",
        help="Print the version and exit.",
        is_eager=True,
        callback=_print_version,
    ),
) -> None:
    if verbose or os.environ.get("LINKCTL_VERBOSE"):
        import logging

        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")


def _keep_examples(cmd: Any) -> None:
    """Click rewraps help paragraphs; a paragraph led by \\b is kept as written, so
    every "Examples:" block in a docstring keeps one command per line."""
    if cmd.help:
        cmd.help = re.sub(r"(^|\n)(Examples?:\n)", r"\1\b\n\2", inspect.cleandoc(cmd.help))
    for sub in getattr(cmd, "commands", {}).values():
        _keep_examples(sub)


def _only(argv: list[str]) -> typer.Typer:
    """The app with only the command ``argv`` names (its first word that is not an
    option; the root takes flags only), when it names one: typer builds every
    registered command's parameters on start-up (~60 ms for all twenty), which a
    read-only command like `linkctl status` need not pay. Help, usage errors and
    unknown names get the whole app, so what anyone sees is unchanged."""
    name = next((a for a in argv if not a.startswith("-")), None)
    cmds = [c for c in app.registered_commands if _command_name(c) == name]
    groups = [g for g in app.registered_groups if g.name == name]
    if not cmds and not groups:
        return app
    only = copy.copy(app)  # same callback, settings and help; fewer commands
    only.registered_commands, only.registered_groups = cmds, groups
    return only


def _command_name(c: Any) -> str:
    return c.name or typer.main.get_command_name(c.callback.__name__)


def main() -> None:
    cmd = typer.main.get_command(_only(sys.argv[1:]))
    _keep_examples(cmd)
    try:
        cmd(prog_name="linkctl")
    except LinkctlError as e:
        from linkctl.core.output import error_line

        error_line(e.line())
        sys.exit(e.exit_code)
    except KeyboardInterrupt:
        sys.exit(130)
