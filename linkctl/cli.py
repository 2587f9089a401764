"""The linkctl command line: thin, every command a call into a module.

Heavy modules (pyroute2, scapy, gguf) are imported inside the commands so
`linkctl --help` stays fast.
"""

from __future__ import annotations

import inspect
import logging
import os
import re
import sys
from typing import Any

# Plain click help: typer's rich help pulls in rich.markdown and markdown-it,
# tripling `linkctl --help` start-up time. Tables and progress still use rich.
os.environ.setdefault("TYPER_USE_RICH", "0")

import typer

from linkctl import __version__
from linkctl.commands import doctor, estimate, lab, link, probe, serve, service
from linkctl.errors import LinkctlError

app = typer.Typer(
    name="linkctl",
    help="Verified, measured direct links for llama.cpp RPC split inference.\n\n"
    "\b\n"
    "  linkctl setup --profile dgx-mac   configure this host's end of the link\n"
    "  linkctl probe                     verify and measure the link\n"
    "  linkctl estimate --model m.gguf   predict decode/prefill tokens/s\n"
    "  linkctl serve                     launch rpc-server / llama-server\n"
    "  linkctl lab demo                  the whole path in namespaces, one command",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
for module in (link, lab, probe, serve, estimate, service, doctor):
    module.register(app)


@app.callback()
def _root(
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Log every step."),
    version: bool = typer.Option(False, "--version", help="Print the version and exit."),
) -> None:
    if version:
        print(f"linkctl {__version__}")
        raise typer.Exit(0)
    if verbose or os.environ.get("LINKCTL_VERBOSE"):
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")


def _keep_examples(cmd: Any) -> None:
    """Click rewraps help paragraphs; a paragraph led by \\b is kept as written, so
    every "Examples:" block in a docstring keeps one command per line."""
    if cmd.help:
        cmd.help = re.sub(r"(^|\n)(Examples?:\n)", r"\1\b\n\2", inspect.cleandoc(cmd.help))
    for sub in getattr(cmd, "commands", {}).values():
        _keep_examples(sub)


def main() -> None:
    cmd = typer.main.get_command(app)
    _keep_examples(cmd)
    try:
        cmd(prog_name="linkctl")
    except LinkctlError as e:
        from linkctl.output import error_line

        error_line(e.line())
        sys.exit(e.exit_code)
    except KeyboardInterrupt:
        sys.exit(130)
