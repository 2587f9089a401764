"""key: the pair secret both hosts of a profile hold (linkctl.trust.secret)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

from linkctl.commands.common import DryRunOpt, JsonOpt, ProfileOpt, emit_json, load
from linkctl.core.output import console

key_app = typer.Typer(
    help="The pair secret: what the responder and the kv-agent ask a peer to prove.",
    no_args_is_help=True,
)


def register(app: typer.Typer) -> None:
    app.add_typer(key_app, name="key")


def _done(what: str, profile: str, dry_run: bool, json_: bool, path: Path) -> None:
    from linkctl.trust.secret import key_path, load

    where = key_path(profile)
    out = {"profile": profile, "path": str(where), "action": what, "dry_run": dry_run}
    if not dry_run:
        out["fingerprint"] = load(profile).fingerprint
    if json_:
        emit_json(out, path)
        return
    verb = f"would {what}" if dry_run else what
    fp = f", fingerprint {out['fingerprint']}" if not dry_run else ""
    console.print(f"{verb} {where}{fp}", markup=False)


@key_app.command("new")
def key_new(
    profile: ProfileOpt = None,
    force: Annotated[
        bool, typer.Option("--force", help="Replace a secret this host already has.")
    ] = False,
    json_: JsonOpt = False,
    dry_run: DryRunOpt = False,
) -> None:
    """Make a new pair secret on this host (32 random bytes, mode 0600).

    Then give the peer the same one, over a channel you trust:

    \b
      sudo linkctl key show --export | ssh PEER sudo linkctl key set

    `linkctl pair` makes one on both hosts by itself; this is for a profile
    written by hand.

    Examples:
      sudo linkctl key new --profile dgx-mac
      sudo linkctl key new --force      (replace it: then set it on the peer too)
    """
    from linkctl.core.errors import InputError
    from linkctl.core.privilege import require_writable_state
    from linkctl.trust import secret

    prof, path = load(profile)
    if secret.key_path(prof.name).exists() and not force:
        raise InputError(
            f"this host already has a pair secret for {prof.name} ({secret.key_path(prof.name)})",
            "keep it, or pass --force to replace it (then set the new one on the peer)",
        )
    if not dry_run:
        require_writable_state("the pair secret (keys/)")
        secret.store(prof.name, secret.generate())
    _done("wrote", prof.name, dry_run, json_, path)


@key_app.command("set")
def key_set(
    profile: ProfileOpt = None,
    json_: JsonOpt = False,
    dry_run: DryRunOpt = False,
) -> None:
    """Store the peer's pair secret, read from stdin (the line `key show --export`
    printed there).

    Examples:
      ssh PEER sudo linkctl key show --export | sudo linkctl key set
      sudo linkctl key set --profile dgx-mac < secret.txt
    """
    from linkctl.core.privilege import require_writable_state
    from linkctl.trust import secret

    prof, path = load(profile)
    key = secret.parse(sys.stdin.readline(), "stdin")
    if not dry_run:
        require_writable_state("the pair secret (keys/)")
        secret.store(prof.name, key)
    _done("wrote", prof.name, dry_run, json_, path)


@key_app.command("show")
def key_show(
    profile: ProfileOpt = None,
    export: Annotated[
        bool, typer.Option("--export", help="Print the secret itself (for `key set` on the peer).")
    ] = False,
    json_: JsonOpt = False,
) -> None:
    """Where this host's pair secret is and its fingerprint: the two hosts of a pair
    show the same fingerprint, or they will refuse each other.

    Examples:
      sudo linkctl key show
      sudo linkctl key show --export | ssh PEER sudo linkctl key set
    """
    from linkctl.trust import secret

    prof, path = load(profile)
    s = secret.load(prof.name)
    if export:
        sys.stdout.write(s.key.hex() + "\n")
        return
    if json_:
        emit_json({"profile": prof.name, "path": s.where, "fingerprint": s.fingerprint}, path)
        return
    console.print(f"pair secret {s.where}, fingerprint {s.fingerprint}", markup=False)
