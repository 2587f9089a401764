"""doctor: read-only pre-flight of this host before `linkctl serve`."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from linkctl.commands.common import HostOpt, JsonOpt, ProfileOpt
from linkctl.core.checks import Verdict
from linkctl.core.output import console, print_json, verdict_lines


def _render(res) -> None:
    verdict_lines(
        [(ln.verdict, ln.name, ln.detail or str(ln.value or ""), ln.fix) for ln in res.lines]
    )
    if res.bad_input:
        return
    order = (Verdict.FAIL, Verdict.WARN, Verdict.PASS, Verdict.SKIP)
    counts = {v: sum(ln.verdict is v for ln in res.lines) for v in order}
    summary = ", ".join(f"{n} {v}" for v, n in counts.items() if n)
    console.print(
        f"doctor {res.profile}/{res.host} ({res.role}, {res.os_name}): {summary} "
        f"in {res.elapsed_s:.1f} s (exit {res.exit_code})",
        markup=False,
    )


def register(app: typer.Typer) -> None:
    @app.command()
    def doctor(
        profile: ProfileOpt = None,
        host: HostOpt = None,
        json_: JsonOpt = False,
        peer_timeout: Annotated[
            float,
            typer.Option(
                "--peer-timeout",
                help="Seconds to wait for each peer's ARP reply and rpc-server HELLO.",
                min=0.1,
                max=30.0,
            ),
        ] = 2.0,
        service_root: Annotated[
            Path,
            typer.Option(
                "--root",
                help="Look for the installed boot services under this directory instead of "
                "the real system (as `service status --root`).",
            ),
        ] = Path("/"),
    ) -> None:
        """Check, read-only, everything that must be true here before `linkctl serve`.

        One line per check, PASS / WARN / FAIL (SKIP when a check it needs failed),
        with the fix: profile valid, this host identified, interface up at the
        expected speed and duplex, address and MTU as profiled, the default route
        not on the link, each peer answering ARP (pinned MAC), llama.cpp binaries
        and RPC protocol versions (HELLO to the rpc hosts' rpc-servers, from the
        head), boot services installed, a recent passing probe report.

        Sends only ARP who-has out of the link interface to the peers' link
        addresses, and (head) one RPC HELLO to each rpc host's endpoint. Runs as a
        user: the ARP check alone needs root, and without it says so (WARN).
        Exit 0 no FAIL, 1 a FAIL, 2 bad input (profile invalid, host unknown).

        Examples:
          linkctl doctor --profile dgx-mac
          linkctl doctor --profile dgx2-mac-switch --host mac --json
        """
        from linkctl.doctor import run

        res = run(
            profile,
            host,
            peer_timeout_s=peer_timeout,
            service_root=service_root.resolve(),
        )
        if json_:
            print_json(res.as_json())
        else:
            _render(res)
        if res.exit_code:
            raise typer.Exit(res.exit_code)
