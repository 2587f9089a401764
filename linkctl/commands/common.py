"""Options and helpers shared by the command modules."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, NamedTuple

import typer

from linkctl.core.paths import DEFAULT_PROFILE

if TYPE_CHECKING:
    from linkctl.core.profile import HostSpec, Profile
    from linkctl.net.backend import Backend

ProfileOpt = Annotated[
    str | None,
    typer.Option(
        "--profile",
        "-p",
        help="Profile name (searched in ~/.config/linkctl/profiles, under sudo the invoking "
        "user's first, then /etc/linkctl/profiles and the shipped ones) or a path to a .toml "
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
LlamaBinDirOpt = Annotated[
    str | None,
    typer.Option(
        "--llama-bin-dir",
        metavar="DIR",
        help="Directory of this host's llama-server / ggml-rpc-server (default: the profile "
        "host's llama_bin_dir, PATH, then linkctl's build cache).",
        show_default=False,
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


def load(profile: str | None) -> tuple[Profile, Path]:
    """The chosen profile and its file, said first on stderr
    (linkctl.core.profile.announce)."""
    from linkctl.core.profile import announce, load_chosen

    prof, path = load_chosen(profile)
    announce(prof, path)
    return prof, path


class Loaded(NamedTuple):
    """What a command acting as one host of the profile starts from."""

    profile: Profile
    host: HostSpec
    backend: Backend
    path: Path


def load_with_host(profile: str | None, host: str | None, backend=None) -> Loaded:
    """The profile, this host of it and the backend, said first on stderr (profile,
    file and host)."""
    from linkctl.core.profile import announce, load_chosen
    from linkctl.net.backend import get_backend
    from linkctl.net.link import identify_host

    prof, path = load_chosen(profile)
    backend = backend or get_backend()
    h = identify_host(prof, backend, host)
    announce(prof, path, h.name)
    return Loaded(prof, h, backend, path)


def emit_json(data: dict[str, Any] | list[dict[str, Any]], profile_path: Path) -> None:
    """A command's --json result, naming the profile file it used (``profile_path``,
    in each record when the result is a list of them)."""
    from linkctl.core.output import print_json

    def named(d: dict[str, Any]) -> dict[str, Any]:
        return {"profile_path": str(profile_path), **d}

    print_json([named(d) for d in data] if isinstance(data, list) else named(data))
