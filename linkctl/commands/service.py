"""service install / uninstall / status: boot-time systemd units and launchd daemons."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from linkctl.commands.common import (
    DryRunOpt,
    HostOpt,
    JsonOpt,
    LlamaBinDirOpt,
    ProfileOpt,
    emit_json,
)
from linkctl.core.checks import Verdict
from linkctl.core.output import console, error_line, print_json, verdict

if TYPE_CHECKING:
    from linkctl.service import ServiceResult

service_app = typer.Typer(
    help="Boot-time services that bring the link and the llama.cpp pair up by themselves.",
    no_args_is_help=True,
)
RootOpt = Annotated[
    Path,
    typer.Option(
        "--root",
        help="Install into this directory instead of the real system (/). Nothing is "
        "enabled or started unless the root is /.",
    ),
]


def _run(what: str, do: Callable[[], ServiceResult]) -> ServiceResult:
    """``do()``, saying on the way out when a signal stopped its file transaction (which
    put every file back first; the exit code is 128 + the signal's number)."""
    from linkctl.service import Interrupted

    try:
        return do()
    except Interrupted as e:
        error_line(f"{what} stopped by {e.signame}: every file it had touched is put back")
        raise


def _need_root(root: Path, dry_run: bool) -> None:
    """Installing on / writes system unit or daemon files and starts them; elsewhere
    (an image) or as a dry run it does not."""
    if root.resolve() == Path("/") and not dry_run:
        from linkctl.core.privilege import require_root

        require_root("it writes and starts boot services in /")


def _show(res: ServiceResult, json_: bool, profile_path: Path | None = None) -> None:
    from linkctl.service import Action

    if json_ and profile_path:
        emit_json(res.as_dict(), profile_path)
        return
    if json_:  # uninstall: it reads no profile
        print_json(res.as_dict())
        return
    for note in res.notes:
        console.print(f"[cyan]note:[/] {note}")
    if res.profile:
        console.print(
            f"{res.action} ({res.manager}) for {res.profile}/{res.host} in {res.root}"
            + (" [dry run]" if res.dry_run else ""),
            markup=False,
        )
    for d in res.dirs_created:
        console.print(f"  mkdir     {d}", markup=False)
    for f in res.files:
        extra = ""
        if f.backup and f.action in (Action.REPLACE, Action.RESTORE):
            extra = f" (backup {f.backup})"
        console.print(f"  {f.action:9} {f.path}{extra}", markup=False)
    for d in res.dirs_removed:
        console.print(f"  rmdir     {d}", markup=False)
    for argv in res.commands:
        head = "would run" if res.dry_run else "ran"
        console.print(f"  {head}: {' '.join(argv)}", markup=False)
    if res.profile and not res.changed and not res.dry_run:
        console.print("nothing changed", markup=False)


def register(app: typer.Typer) -> None:
    app.add_typer(service_app, name="service")


@service_app.command("install")
def service_install(
    profile: ProfileOpt = None,
    host: HostOpt = None,
    root: RootOpt = Path("/"),
    linkctl_bin: Annotated[
        str | None,
        typer.Option(
            "--linkctl-bin",
            help="linkctl as the services run it (default: this running linkctl).",
            show_default=False,
        ),
    ] = None,
    llama_bin_dir: LlamaBinDirOpt = None,
    serve_user: Annotated[
        str | None,
        typer.Option(
            "--serve-user",
            help="Account for serve/responder (default: systemd DynamicUser when the files "
            "allow it, else root without capabilities; macOS: root).",
            show_default=False,
        ),
    ] = None,
    wait_carrier: Annotated[
        float,
        typer.Option("--wait-carrier", help="Seconds setup waits for carrier at boot."),
    ] = 120.0,
    dry_run: DryRunOpt = False,
    json_: JsonOpt = False,
) -> None:
    """Render the units (systemd) or daemons (launchd) for this host and install them.

    Refuses (exit 2, nothing written) when linkctl or the llama.cpp binaries are not
    where the services would run them, or the profile does not validate. Idempotent;
    anything foreign it overwrites is kept as FILE.linkctl-bak.

    Examples:
      linkctl service install --profile dgx-mac --dry-run
      linkctl service install --profile dgx-mac --host dgx --root /tmp/img
    """
    import os

    from linkctl import service as svc
    from linkctl.core.errors import InputError
    from linkctl.core.profile import announce, load_chosen
    from linkctl.net.backend import get_backend
    from linkctl.net.link import identify_host

    _need_root(root, dry_run)
    prof, path = load_chosen(profile)
    try:
        h = identify_host(prof, get_backend(), host)
    except InputError as e:
        raise InputError(e.message, "pass --host NAME (the host the services are for)") from None
    announce(prof, path, h.name)
    root = root.resolve()
    bin_dir = llama_bin_dir or svc.default_llama_bin_dir(h)
    if not bin_dir:
        raise InputError(
            f"no llama.cpp {'rpc-server' if h.role == 'rpc' else 'llama-server'} found for "
            f"{h.name}; the serve service needs one",
            "run scripts/build-llama.sh, or pass --llama-bin-dir DIR",
        )
    target = f"{svc.PROFILE_DIR}/{prof.name}.toml"
    text: str | None = path.read_text()
    if str(root) == "/" and os.path.realpath(path) == os.path.realpath(target):
        text = None  # the profile already lives where the units read it
    paths = svc.ServicePaths(
        linkctl_bin=linkctl_bin or svc.default_linkctl_bin(),
        llama_bin_dir=os.path.abspath(bin_dir),
        profile_path=target,
        profile_text=text,
        wait_carrier_s=wait_carrier,
        serve_user=serve_user,
    )
    import linkctl

    pkg = str(Path(linkctl.__file__).parent) if str(root) == "/" else None
    res = _run(
        "service install",
        lambda: svc.install(prof, h, paths, root=root, dry_run=dry_run, package_dir=pkg),
    )
    _show(res, json_, path)


@service_app.command("uninstall")
def service_uninstall(
    root: RootOpt = Path("/"), dry_run: DryRunOpt = False, json_: JsonOpt = False
) -> None:
    """Stop and remove what `service install` put there; restore what it replaced.

    Example: linkctl service uninstall --dry-run
    """
    from linkctl import service as svc

    _need_root(root, dry_run)
    res = _run("service uninstall", lambda: svc.uninstall(root=root.resolve(), dry_run=dry_run))
    _show(res, json_)


@service_app.command("status")
def service_status(root: RootOpt = Path("/"), json_: JsonOpt = False) -> None:
    """What is installed, whether it is intact, and (on /) whether it is running.
    Exit 1 when something installed is missing, modified, or not running.

    Example: linkctl service status --json
    """
    from linkctl import service as svc

    st = svc.status(root=root.resolve())
    if json_:
        print_json(st.as_dict())
    else:
        for note in st.notes:
            console.print(f"[cyan]note:[/] {note}")
        if st.installed:
            console.print(
                f"{st.manager} services for {st.profile}/{st.host} in {st.root}", markup=False
            )
            for f in st.files:
                v = Verdict.PASS if f.ok else Verdict.FAIL
                console.print(f"  {verdict(v)} {f.path}: {f.state}")
            for s in st.services:
                v = Verdict.PASS if s.ok else Verdict.FAIL
                pid = f" pid {s.pid}" if s.pid else ""
                detail = f" ({s.sub})" if s.sub else ""
                console.print(f"  {verdict(v)} {s.name}: {s.active}{detail}{pid}")
    if not st.ok:
        raise typer.Exit(1)
