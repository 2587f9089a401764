"""profile check, setup, teardown, status."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from linkctl.commands.common import (
    DryRunOpt,
    HostOpt,
    JsonOpt,
    ProfileOpt,
    emit_json,
    load_with_host,
)
from linkctl.core.checks import Verdict
from linkctl.core.output import console, print_json, verdict
from linkctl.core.privilege import require_root

if TYPE_CHECKING:
    from linkctl.core.profile import HostSpec
    from linkctl.net.netstate import LinkStatus

profile_app = typer.Typer(help="Validate and show profiles.", no_args_is_help=True)


@profile_app.command("check")
def profile_check(
    file: Annotated[str, typer.Argument(help="Profile name or path to a .toml file.")],
    json_: JsonOpt = False,
) -> None:
    """Validate a profile and print it resolved (defaults filled in).

    Examples:
      linkctl profile check dgx-mac
      linkctl profile check ./my-link.toml
    """
    from linkctl.core.profile import load_profile

    prof, path = load_profile(file)
    data = prof.to_toml_dict()
    if json_:
        print_json({"path": str(path), "profile": data})
        return
    import tomli_w

    console.print(
        f"[green]OK[/] {path}: profile {prof.name!r}, {len(prof.hosts)} hosts, "
        f"head {prof.head.name}, rpc {', '.join(h.name for h in prof.rpc_hosts)}"
    )
    console.print(tomli_w.dumps(data), markup=False)


@profile_app.command("list")
def profile_list(json_: JsonOpt = False) -> None:
    """List the profiles linkctl can find by name."""
    from linkctl.core.paths import profile_dirs, profile_files

    found = [str(f) for f in profile_files(profile_dirs())]
    if json_:
        print_json(found)
    else:
        for f in found:
            console.print(f"{Path(f).stem:24} {f}", markup=False)


def _render_result(res, json_: bool, profile_path: Path) -> None:
    if json_:
        emit_json(res.as_dict(), profile_path)
        return
    for note in res.plan.notes:
        console.print(f"[cyan]note:[/] {note}")
    if res.nothing_to_do:
        console.print(
            f"{res.action} {res.host} ({res.interface}): nothing to do, link is as profiled"
        )
        return
    head = "would apply" if res.dry_run else "applied"
    console.print(
        f"{res.action} {res.host} ({res.interface}): {head} {len(res.plan.changes)} change(s)"
    )
    for c in res.plan.changes:
        undo = f"   [dim](undo: {c.undo.summary})[/]" if c.undo else ""
        console.print(f"  - {c.summary}{undo}")
    if not res.dry_run:
        console.print(f"done in {res.elapsed_s * 1000:.0f} ms; default route unchanged")


def _say(message: str) -> None:
    """One plain line on stderr: what a boot service's log shows."""
    import sys

    print(f"linkctl setup: {message}", file=sys.stderr, flush=True)


def _carrier_after_setup(link, backend, ifname: str, timeout: float) -> None:
    from linkctl.core.errors import CheckFailed, InputError

    try:
        link.wait_for_link_carrier(backend, ifname, timeout, log=_say)
    except InputError as e:
        raise CheckFailed(f"{e.message}; the link is configured", e.fix) from None


def register(app: typer.Typer) -> None:
    app.add_typer(profile_app, name="profile")

    @app.command()
    def setup(
        profile: ProfileOpt = None,
        host: HostOpt = None,
        dry_run: DryRunOpt = False,
        json_: JsonOpt = False,
        wait_carrier: Annotated[
            float | None,
            typer.Option(
                "--wait-carrier",
                metavar="SECONDS",
                help="Boot services: wait up to SECONDS for the interface and its carrier "
                "first (a port that is down is waited for right after setup brings it up).",
                show_default=False,
            ),
        ] = None,
    ) -> None:
        """Configure this host's end of the link: MTU, up, address (no gateway, no default route).

        Checks first (interface exists, not the default-route interface, no overlapping
        subnet, address free on the segment, MTU accepted); applies as one transaction
        and rolls back on any failure. Idempotent.

        Examples:
          linkctl setup --profile dgx-mac --dry-run
          linkctl setup --profile dgx-mac --host dgx --json
          linkctl setup --profile dgx-mac --host mac --wait-carrier 120   # launchd at boot
        """
        from linkctl.net import link

        if not dry_run:
            require_root("setup changes the link's address, MTU and state")
        prof, h, backend, path = load_with_host(profile, host)
        waited = None
        if wait_carrier and not dry_run:
            waited = link.wait_for_link_carrier(backend, h.interface, wait_carrier, log=_say)
        _render_result(link.setup(prof, h, backend, dry_run=dry_run), json_, path)
        if wait_carrier and not dry_run and waited is None:
            _carrier_after_setup(link, backend, h.interface, wait_carrier)

    @app.command()
    def teardown(
        profile: ProfileOpt = None,
        host: HostOpt = None,
        dry_run: DryRunOpt = False,
        json_: JsonOpt = False,
    ) -> None:
        """Remove exactly what setup added and restore the previous MTU.

        Example: linkctl teardown --profile dgx-mac --dry-run
        """
        from linkctl.net import link

        if not dry_run:
            require_root("teardown changes the link's address, MTU and state")
        prof, h, backend, path = load_with_host(profile, host)
        _render_result(link.teardown(prof, h, backend, dry_run=dry_run), json_, path)

    @app.command()
    def status(
        profile: ProfileOpt = None,
        host: HostOpt = None,
        watch: Annotated[
            bool,
            typer.Option(
                "--watch",
                help="Print again every serve.watch_interval_s until Ctrl-C (with --json: "
                "one JSON object per line).",
            ),
        ] = False,
        json_: JsonOpt = False,
    ) -> None:
        """Show the link as it is versus the profile (drift), and what serve's watch says
        while it serves. Exit 1 on drift or a watch FAIL.

        The `serve` object is this host's supervisor (serve/head.json or rpc.json in the
        state dir) and its `watch`: verdict PASS/WARN/FAIL with reasons, since when,
        the figures behind it (RTT and retransmits of the live RPC connection, decode
        tok/s), the mode llama-server runs in (split, alone, stopped) and the canary.

        Examples:
          linkctl status --json
          linkctl status --watch
          linkctl status --watch --json | jq .serve.watch.verdict
        """
        import time

        from linkctl.core.errors import InputError
        from linkctl.net import link

        prof, h, backend, path = load_with_host(profile, host)
        while True:
            served = _served(h)
            try:
                st = link.status(prof, h, backend)
            except InputError as e:
                # The link interface gone (a cable's USB NIC pulled, a veth deleted): still
                # a status, the serve and its watch said beside it.
                if not served and not watch:
                    raise
                st = None
                gone = {"profile": prof.name, "host": h.name, "ok": False, "error": e.message}
            if json_:
                data = {**(st.as_dict() if st else gone), "serve": served}
                if watch:
                    print_json(data, indent=None)
                else:
                    emit_json(data, path)
            elif st is None:
                console.print(f"{'interface':>14}  {gone['error']}", markup=False)
                _show_served(served)
            else:
                _show_status(st, served)
            w = (served or {}).get("watch") or {}
            failed = st is None or not st.ok or w.get("verdict") == "FAIL"
            if not watch:
                break
            time.sleep(prof.serve.watch_interval_s or 5.0)
            if not json_:
                console.print()
        if failed:
            raise typer.Exit(1)


def _served(host: HostSpec) -> dict | None:
    """This host's serve status (its watch included; on a disaggregated head, route's
    with its restores), or None when serve never ran. Read where this host's serve
    writes it: the one state dir (serve by hand, launchd's daemon) or the serve unit's
    own (systemd's StateDirectory=, a throwaway user's); the newer when both hold one."""
    from linkctl.core.errors import InputError
    from linkctl.core.paths import SYSTEM_STATE_DIR, state_dir
    from linkctl.core.records import load_route_status, load_status, status_path
    from linkctl.service.manager import manager_for

    # The unit's directory only beside the system state (not a lab host's own state dir).
    unit_dir = manager_for(host).serve_state_dir if state_dir() == SYSTEM_STATE_DIR else None
    found: list[tuple[float, Path]] = []
    hidden = None
    for root in [None, *([Path(unit_dir)] if unit_dir else [])]:
        p = status_path(host.role, root)
        try:
            found.append((p.stat().st_mtime, p))
        except PermissionError:  # the unit's directory is root's (0700)
            hidden = p
        except OSError:
            continue
    if not found:
        if hidden is None:
            return None
        return {"error": f"{hidden} is not readable by this user: run `sudo linkctl status`"}
    p = max(found)[1]
    try:
        out = load_status(p).model_dump(mode="json")
        route = status_path("route", p.parent.parent)
        if host.role == "head" and route.is_file():
            out["route"] = load_route_status(route).model_dump(mode="json")
        return out
    except InputError as e:
        return {"error": e.message}


def _show_status(st: LinkStatus, served: dict | None) -> None:
    f = st.facts
    speed = f"{f.speed_mbps} Mb/s {f.duplex or ''}".strip() if f.speed_mbps else "unknown"
    dr = st.default_route
    rows = [
        ("host", f"{st.host} ({st.os}) in profile {st.profile}"),
        (
            "interface",
            f"{f.ifname} {'UP' if f.up else 'DOWN'}, carrier {'yes' if f.carrier else 'no'}",
        ),
        ("owner", f"{f.owner}{' (' + f.owner_detail + ')' if f.owner_detail else ''}"),
        ("addresses", ", ".join(f.addresses) or "none"),
        ("mtu", str(f.mtu)),
        ("speed", speed),
        ("mac", f.mac or "unknown"),
        ("default route", f"via {dr.gateway} dev {dr.ifname}" if dr else "none"),
    ]
    for k, v in rows:
        console.print(f"{k:>14}  {v}", markup=False)
    if not st.drift:
        console.print(f"{'drift':>14}  {verdict(Verdict.PASS)} none: link is as profiled")
    for d in st.drift:
        what = f"{d.field}: want {d.want}, have {d.have}"
        console.print(f"{'drift':>14}  {verdict(d.severity)} {what}")
    _show_served(served)


def _show_served(served: dict | None) -> None:
    if served is None:
        console.print(f"{'serve':>14}  not running here (no status)", markup=False)
        return
    console.print(
        f"{'serve':>14}  {served.get('name')} {served.get('state')}, "
        f"{served.get('starts')} start(s)",
        markup=False,
    )
    for model, h in ((served.get("route") or {}).get("restores") or {}).items():
        stop = "; transfers stopped for it" if h["stopped"] else ""
        console.print(
            f"{'restores':>14}  {model}: {h['took']} took, {h['noops']} reused nothing "
            f"({h['in_a_row']} in a row){stop}",
            markup=False,
        )
    w = served.get("watch")
    if not w:
        return
    console.print(
        f"{'watch':>14}  {verdict(Verdict(w['verdict']))} since {w['since']}, mode {w['mode']}"
        f" (checked {w['checked_at']})"
    )
    for r in w["reasons"]:
        console.print(f"{'':>14}  {r}", markup=False)
    figs = ", ".join(f"{k} {v}" for k, v in w["figures"].items() if v is not None)
    console.print(f"{'figures':>14}  {figs}", markup=False)
    c = w.get("canary")
    if c:
        console.print(
            f"{'canary':>14}  {verdict(Verdict(c['verdict']))} {c['detail']} ({c['why']}, "
            f"{c['time']}, {c['wall_s']} s)"
        )
