"""probe (verify and measure the link) and responder (its peer side)."""

from __future__ import annotations

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
from linkctl.core.output import console, print_json, verdict


def _fmt(v: object) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:g}"
    return str(v)


def _render(report) -> None:
    from rich.table import Table

    head = f"probe {report.host} -> {report.peer} ({report.peer_address}), profile {report.profile}"
    t = Table(title=head, title_justify="left", show_edge=False, pad_edge=False)
    t.add_column("check", no_wrap=True)
    t.add_column("verdict", no_wrap=True)
    t.add_column("value", no_wrap=True, justify="right")
    t.add_column("limit", no_wrap=True, justify="right")
    t.add_column("detail", overflow="fold")
    for c in report.checks:
        t.add_row(c.name, verdict(c.verdict), _fmt(c.value), _fmt(c.threshold), c.detail)
    console.print(t)
    if report.stopped:
        console.print(f"[red]stopped:[/] {report.stopped}")
    word = {0: "[green]PASS[/]", 1: "[red]FAIL[/]", 2: "[red]COULD NOT RUN[/]"}[report.exit_code]
    console.print(f"{word} in {report.elapsed_s:.1f} s (exit {report.exit_code})")


def register(app: typer.Typer) -> None:
    @app.command()
    def probe(
        profile: ProfileOpt = None,
        host: HostOpt = None,
        peer: Annotated[
            str | None,
            typer.Option(
                "--peer",
                help="Probe only this profile host (default: the head probes every rpc "
                "host, an rpc host probes the head).",
                show_default=False,
            ),
        ] = None,
        json_: JsonOpt = False,
        prom: Annotated[
            str | None,
            typer.Option(
                "--prom",
                help="Also write the figures in Prometheus text format to FILE "
                "(node_exporter textfile collector).",
                metavar="FILE",
                show_default=False,
            ),
        ] = None,
        duration: Annotated[
            float | None,
            typer.Option(
                "--duration",
                help="Seconds per iperf3 run (whole seconds; default: the profile's "
                "probe.duration_s).",
                show_default=False,
            ),
        ] = None,
        samples: Annotated[
            int | None,
            typer.Option(
                "--samples",
                help="TCP round trips per size (default: probe.latency_samples).",
                min=10,
                show_default=False,
            ),
        ] = None,
        no_throughput: Annotated[
            bool, typer.Option("--no-throughput", help="Skip the iperf3 runs.")
        ] = False,
        max_age: Annotated[
            float | None,
            typer.Option(
                "--max-age",
                metavar="SECONDS",
                help="Probe only the peers without a passing report younger than SECONDS "
                "(the others' reports are reused as they are). The head's serve unit runs "
                "this before every start, so a restart a day later re-probes.",
                min=0,
                show_default=False,
            ),
        ] = None,
    ) -> None:
        """Verify and measure the link: NIC, peer ARP/MAC, path MTU, RTT, throughput, RPC.

        Needs root (ARP through a raw socket) and `linkctl responder` running on the
        peer. Exit 0 all pass, 1 a check failed, 2 could not run. The report is saved
        to the state directory, /var/lib/linkctl/probe ($LINKCTL_STATE_DIR overrides),
        where estimate, doctor and serve read it whoever runs them; --json prints a list
        of reports, one per peer probed (a list of one for one peer).

        Examples:
          sudo linkctl probe --profile dgx-mac
          sudo linkctl probe --peer dgx --json --prom /var/lib/node_exporter/textfile/linkctl.prom
        """
        from linkctl.core.privilege import require_root
        from linkctl.probe import choose_peers, report, run_probe

        require_root("probe sends ARP through a raw socket")
        prof, me, backend, path = load_with_host(profile, host)
        peers = choose_peers(prof, me, peer)
        if max_age is not None:
            peers = _stale(prof, peers, max_age, json_)
        reports = []
        for p in peers:
            progress = None if json_ else _IperfProgress()
            try:
                r = run_probe(
                    prof,
                    me,
                    p,
                    backend,
                    duration_s=duration,
                    samples=samples,
                    throughput=not no_throughput,
                    on_iperf=progress.on_run if progress else None,
                )
            finally:
                if progress:
                    progress.close()
            report.save(r)
            reports.append(r)
            if not json_:
                _render(r)
        if prom:
            report.write_prometheus(prom, reports)
        if json_:
            # One shape whatever the number of peers: a list, one report per peer probed
            # (empty when --max-age found every peer's report fresh).
            emit_json([r.to_json() for r in reports], path)
        code = max((r.exit_code for r in reports), default=0)
        if code:
            raise typer.Exit(code)

    @app.command()
    def responder(
        profile: ProfileOpt = None,
        host: HostOpt = None,
        dry_run: DryRunOpt = False,
        json_: JsonOpt = False,
    ) -> None:
        """Serve the probe's peer side on this host's link address: a TCP echo for
        latency and `iperf3 -s` for throughput. Runs until SIGTERM/Ctrl-C.

        Every host of the pair runs one (`linkctl up` and the boot services start it):
        each host's probe measures against the other's. Its banner also hands the peer
        this host's calibration, which the peer's probe stores.

        Examples:
          linkctl responder --profile dgx-mac
          linkctl responder --dry-run --json
        """
        import json
        import sys

        from linkctl.core.records import calibration_of
        from linkctl.probe.responder import Responder
        from linkctl.trust.secret import load as load_secret

        prof, me, backend, path = load_with_host(profile, host)
        spec = prof.probe
        r = Responder(
            me.ip,
            spec.responder_port,
            spec.iperf_port,
            runner=backend.runner,
            host=me.name,
            calibration=lambda: calibration_of(me.name),
            secret=None if dry_run else load_secret(prof.name),
        )
        if dry_run:
            plan = r.plan()
            if json_:
                print_json(plan)
            else:
                console.print(
                    f"responder {me.name} [dry run]: would listen on {me.ip}:{spec.responder_port} "
                    f"(TCP echo) and run {' '.join(plan['iperf_argv'])}",
                    markup=False,
                )
            return

        def ready(info: dict) -> None:
            if json_:
                sys.stdout.write(json.dumps({"profile_path": str(path), **info}) + "\n")
            else:
                console.print(
                    f"responder {me.name}: echo on {me.ip}:{spec.responder_port}, "
                    f"iperf3 -s on {me.ip}:{spec.iperf_port} (pid {info['iperf_pid']}); "
                    "SIGTERM to stop",
                    markup=False,
                )
            sys.stdout.flush()

        r.serve_forever(ready)
        if not json_:
            console.print(f"responder {me.name}: stopped", markup=False)


def _stale(prof, peers, max_age: float, quiet: bool) -> list:
    """The peers whose latest report failed, is missing or is older than ``max_age``."""
    import time

    from linkctl.core.records import latest_probe

    out = []
    for p in peers:
        found = latest_probe(prof.name, p.name, p.ip)
        if found is not None and found[2].ok and time.time() - found[0] <= max_age:
            if not quiet:
                console.print(
                    f"probe -> {p.name}: {found[1]} passed {time.time() - found[0]:.0f} s ago "
                    f"(--max-age {max_age:g}): not probed again",
                    markup=False,
                )
            continue
        out.append(p)
    return out


if TYPE_CHECKING:
    import threading

    from rich.progress import Progress, TaskID


class _IperfProgress:
    """A rich progress bar on stderr while iperf3 runs (never in --json mode)."""

    def __init__(self) -> None:
        self._progress: Progress | None = None
        self._task: TaskID | None = None
        self._timer: threading.Thread | None = None

    def on_run(self, key: str, seconds: int) -> None:
        import threading
        import time

        from rich.console import Console
        from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

        if self._progress is None:
            self._progress = Progress(
                TextColumn("iperf3 {task.description}"),
                BarColumn(),
                TimeElapsedColumn(),
                console=Console(stderr=True),
                transient=True,
            )
            self._progress.start()
        if self._task is not None:
            self._progress.remove_task(self._task)
        self._task = self._progress.add_task(key, total=seconds)
        task, progress, start = self._task, self._progress, time.monotonic()

        def tick() -> None:
            while self._task == task and self._progress is not None:
                progress.update(task, completed=min(seconds, time.monotonic() - start))
                time.sleep(0.1)

        self._timer = threading.Thread(target=tick, daemon=True)
        self._timer.start()

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
        self._progress = None
        self._task = None
