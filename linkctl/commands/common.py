"""Options and helpers shared by the command modules."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from linkctl.core.paths import DEFAULT_PROFILE

ProfileOpt = Annotated[
    str | None,
    typer.Option(
        "--profile",
        "-p",
        help="Profile name (searched in ~/.config/linkctl/profiles, /etc/linkctl/profiles, "
        "then the shipped ones) or a path to a .toml "
        f"(default: $LINKCTL_PROFILE, else {DEFAULT_PROFILE}).",
        show_default=False,
    ),
]
HostOpt = Annotated[
    str | None,
    typer.Option(
        "--host", help="Which profile host this machine is (default: detected).", show_default=False
    ),
]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print the result as JSON.")]
DryRunOpt = Annotated[bool, typer.Option("--dry-run", help="Print the plan; change nothing.")]
CalibrationOpt = Annotated[
    list[Path] | None,
    typer.Option(
        "--calibration",
        help="Another calibration.json to use besides this host's state (whose file already "
        "holds the peer's terms once a probe has fetched them); repeatable.",
        show_default=False,
    ),
]


def load(profile: str | None):
    from linkctl.core.profile import load_chosen

    return load_chosen(profile)


def load_with_host(profile: str | None, host: str | None, backend=None):
    """(profile, host spec, backend) for commands that act on this machine."""
    from linkctl.net.backend import get_backend
    from linkctl.net.link import identify_host

    prof, _path = load(profile)
    backend = backend or get_backend()
    return prof, identify_host(prof, backend, host), backend
