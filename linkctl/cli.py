"""The linkctl command line: thin, every command a call into a module.

Heavy modules (pyroute2, scapy, gguf) are imported inside the commands so
`linkctl --help` stays fast.
"""

from __future__ import annotations

import logging
import os
import sys

import typer

from linkctl import __version__
from linkctl.commands import lab, link, serve
from linkctl.errors import LinkctlError

app = typer.Typer(
    name="linkctl",
    help="Verified, measured direct links for llama.cpp RPC split inference.\n\n"
    "  linkctl setup --profile dgx-mac   configure this host's end of the link\n\n"
    "  linkctl status                    the link versus the profile\n\n"
    "  linkctl lab up                    namespaces standing in for the hosts",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
for module in (link, lab, serve):
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


def main() -> None:
    try:
        app()
    except LinkctlError as e:
        from linkctl.output import error_line

        error_line(e.line())
        sys.exit(e.exit_code)
    except KeyboardInterrupt:
        sys.exit(130)
