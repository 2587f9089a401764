"""lab up / down / exec / show: namespaces standing in for the profile's hosts."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Annotated

import typer

from linkctl.commands.common import DryRunOpt, JsonOpt, ProfileOpt, emit_json, load
from linkctl.core.checks import Verdict
from linkctl.core.output import console, print_json
from linkctl.core.privilege import require_root

if TYPE_CHECKING:
    from linkctl.lab.boot import BootPlan
    from linkctl.lab.demo_context import DemoReport

lab_app = typer.Typer(
    help="Network namespaces that stand in for the profile's hosts (198.18.0.0/15 only).",
    no_args_is_help=True,
)
NameOpt = Annotated[str, typer.Option("--name", help="Lab name (namespaces are lk-NAME-HOST).")]
NETNS = "the lab makes, enters and removes network namespaces"


@lab_app.callback()
def _linux_only() -> None:
    # Network namespaces and pyroute2 exist only on Linux (pyroute2 is not installed
    # elsewhere: see its environment marker in pyproject.toml).
    if not sys.platform.startswith("linux"):
        from linkctl.core.errors import InputError

        raise InputError(
            f"linkctl lab needs Linux network namespaces; this is {sys.platform}",
            "run the lab on a Linux machine (the Mac side is covered by setup --dry-run)",
        )


@lab_app.command("up")
def lab_up(
    profile: ProfileOpt = None,
    name: NameOpt = "lab",
    dry_run: DryRunOpt = False,
    json_: JsonOpt = False,
) -> None:
    """Create one namespace per profile host, the link between them, and a wifi router.

    Example:
      linkctl lab up --profile dgx-mac
      linkctl lab exec dgx -- linkctl setup
    """
    from linkctl.lab import netns as lab

    if not dry_run:
        require_root(NETNS)
    prof, path = load(profile)
    lb = lab.plan(prof, name) if dry_run else lab.up(prof, name)
    if json_:
        emit_json({**lb.as_dict(), "namespaces": lab.namespaces(lb), "dry_run": dry_run}, path)
        return
    if dry_run:
        console.print(
            f"lab {lb.name!r} from profile {prof.name!r} [dry run]: would create namespaces "
            f"{', '.join(lab.namespaces(lb))} and write {lb.root}",
            markup=False,
        )
    else:
        console.print(
            f"lab {lb.name!r} up from profile {prof.name!r}; remapped profile: {lb.profile_path}"
        )
    for h in lb.hosts:
        console.print(
            f"  {h.name:8} netns {h.netns:18} {h.interface:8} {h.address:18} "
            f"default via {h.gateway} dev wlan0",
            markup=False,
        )


@lab_app.command("down")
def lab_down(name: NameOpt = "lab", dry_run: DryRunOpt = False, json_: JsonOpt = False) -> None:
    """Stop every process in the lab's namespaces and remove them (idempotent)."""
    from linkctl.lab import netns as lab

    if not dry_run:
        require_root(NETNS)
    plan = lab.down_plan(name)
    removed = plan.items if dry_run else lab.down(name)
    if json_:
        out: dict = {"removed": removed, "dry_run": dry_run}
        if dry_run:
            out["processes"] = plan.processes
        print_json(out)
    elif not removed:
        console.print(f"lab {name!r}: nothing to remove", markup=False)
    elif dry_run:
        pids = sum(len(p) for p in plan.processes.values())
        console.print(
            f"lab {name!r} [dry run]: would stop {pids} process(es) and remove "
            f"{', '.join(removed)}",
            markup=False,
        )
    else:
        console.print(f"lab {name!r}: removed {len(removed)} item(s)", markup=False)


@lab_app.command("show")
def lab_show(name: NameOpt = "lab", json_: JsonOpt = False) -> None:
    """Show a running lab."""
    from linkctl.lab import netns as lab

    lb = lab.load_lab(name)
    if json_:
        print_json(lb.as_dict())
    else:
        for h in lb.hosts:
            console.print(f"{h.name:8} {h.netns:18} {h.interface:8} {h.address}", markup=False)


@lab_app.command(
    "exec",
    context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
)
def lab_exec(
    ctx: typer.Context,
    host: Annotated[str, typer.Argument(help="Profile host name.")],
    name: NameOpt = "lab",
) -> None:
    """Run a command inside a host's namespace, with the lab profile and host preset.

    The command talks to this terminal directly; SIGTERM and SIGINT to `lab exec` are
    passed on to it. Exit status: the command's (128 + N when signal N ended it).

    Example: linkctl lab exec dgx -- linkctl status
    """
    from linkctl.core.runner import foreground
    from linkctl.lab import netns as lab

    require_root(NETNS)
    argv, env = lab.exec_argv(lab.load_lab(name), host, list(ctx.args))
    raise typer.Exit(foreground(argv, env=env))


@lab_app.command("demo")
def lab_demo(
    profile: ProfileOpt = None,
    delay_ms: Annotated[
        float,
        typer.Option("--delay-ms", help="Extra one-way delay on the RPC path (delay proxy)."),
    ] = 0.0,
    rate: Annotated[
        str | None,
        typer.Option("--rate", help="Shape each direction of the link with tbf, e.g. 1gbit."),
    ] = None,
    tokens: Annotated[int, typer.Option("--tokens", help="Tokens per timed completion.")] = 64,
    runs: Annotated[int, typer.Option("--runs", help="Timed completions (best is kept).")] = 3,
    threads: Annotated[
        int,
        typer.Option("--threads", "-t", help="CPU threads for rpc-server and llama-server."),
    ] = 1,
    name: NameOpt = "demo",
    dry_run: Annotated[
        bool,
        typer.Option(
            "--dry-run", help="Print the lab it would make and every step, in order; run nothing."
        ),
    ] = False,
    json_: JsonOpt = False,
) -> None:
    """The whole path in namespaces: setup, probe, estimate, serve, a real completion.

    Brings up a lab for the profile, configures every host with `setup`, runs the
    responder and `probe`, writes a tiny GGUF, calibrates, runs `estimate`, starts
    rpc-server and llama-server with `serve`, times real completions, tears it all
    down (also on Ctrl-C or failure) and prints predicted vs measured decode
    tokens/s. Needs root and the llama.cpp build (scripts/build-llama.sh).

    Examples:
      linkctl lab demo
      linkctl lab demo --profile dgx2-mac-switch --json
      linkctl lab demo --rate 1gbit --delay-ms 0.5
      linkctl lab demo --dry-run
    """
    from linkctl.lab.demo import Demo, DemoOptions

    if not dry_run:
        require_root(NETNS)
    prof, path = load(profile)
    opts = DemoOptions(
        name=name, delay_ms=delay_ms, rate=rate, tokens=tokens, runs=runs, threads=threads
    )

    def say(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    if dry_run:
        plan = Demo(prof, opts, say=say).plan()
        if json_:
            print_json(plan.as_json())
            return
        out = console.print
        out(
            f"linkctl lab demo [dry run]: profile {plan.profile} in lab {plan.lab.name!r}, "
            f"namespaces {', '.join(plan.namespaces)}",
            markup=False,
        )
        for i, title in enumerate(plan.steps, 1):
            out(f"  [{i:>2}] {title}", markup=False)
        out(f"  writes {', '.join(plan.writes)} (the lab's is removed at the end)", markup=False)
        return

    try:
        report = Demo(prof, opts, say=say).run()
    except KeyboardInterrupt:
        print("interrupted: lab stopped and removed", file=sys.stderr)
        raise typer.Exit(130) from None
    if json_:
        emit_json(report.as_json(), path)
    else:
        render_demo(report)


def render_demo(r: DemoReport) -> None:
    """The demo's final report as text (a finished run's: every section is there)."""
    lab, sh, lim, m = r.lab, r.shaping, r.probe_limits, r.model
    p, me = r.predicted, r.measured
    assert lab and sh and lim and m and p and me and r.link and r.calibration, "report unfinished"
    out = console.print
    shaped = ", ".join(
        x
        for x in (
            f"tbf {sh.rate_bps / 1e9:g} Gbit/s" if sh.rate_bps else "",
            f"+{sh.delay_ms:g} ms one way on RPC" if sh.delay_ms else "",
        )
        if x
    )
    out(
        f"linkctl lab demo: profile {r.profile} in lab {lab.name!r} "
        f"({lab.subnet}){'; ' + shaped if shaped else ''}",
        markup=False,
    )
    for lk in r.link:
        rpc_rtt = float("nan") if lk.rpc_rtt_p50_us is None else lk.rpc_rtt_p50_us
        out(
            f"  link    head -> {lk.peer}: path MTU {lk.path_mtu}, TCP RTT p50 "
            f"{lk.rtt_p50_us:.0f} µs p99 {lk.rtt_p99_us:.0f} µs, RPC RTT p50 "
            f"{rpc_rtt:.0f} µs, {lk.throughput_gbps:.1f} / "
            f"{lk.throughput_rev_gbps:.1f} Gbit/s (1 stream, each way), "
            f"{Verdict.PASS if lk.ok else Verdict.FAIL}",
            markup=False,
        )
    out(
        f"          probe limits in the lab (one shared CPU, not the profile's): p99 RTT "
        f"<= {lim.max_rtt_p99_us:g} µs, throughput >= {lim.min_throughput_gbps:g} Gbit/s",
        markup=False,
    )
    out(f"  model   tiny llama, {m.n_layer} layers, {m.bytes / 1e6:.0f} MB F32", markup=False)
    for host, c in r.calibration.items():
        out(
            f"  calib   {host}: {c.decode_tok_s:.1f} tok/s alone = "
            f"{c.effective_bandwidth_gbs:.2f} GB/s effective",
            markup=False,
        )
    out(
        f"  decode  predicted {p.split_decode_tok_s:.1f} tok/s split, measured "
        f"{me.split_decode_tok_s:.1f} tok/s (best of {len(me.runs_tok_s)}, median "
        f"{me.median_decode_tok_s:.1f}; {me.tokens_generated} tokens generated): "
        f"error {r.error_pct:+.1f}%",
        markup=False,
    )
    out(
        f"  network {p.network_per_token_us:.0f} µs per token "
        f"({p.network_per_layer_us:.1f} µs per layer) at RTT {p.rtt_us:.0f} µs",
        markup=False,
    )
    out(
        f"  advice  {p.recommendation}: {p.reason} "
        f"(local only predicted {p.local_decode_tok_s:.1f} tok/s)",
        markup=False,
    )
    if r.verify:
        out(f"  verify  {r.verify.summary}", markup=False)
    left = r.left_behind or []
    out(
        f"  cleanup {'nothing left behind' if not left else 'LEFT BEHIND: ' + ', '.join(left)}; "
        f"total {r.total_s:.0f} s",
        markup=False,
    )


@lab_app.command("boot")
def lab_boot(
    profile: ProfileOpt = None,
    name: NameOpt = "boot",
    install: Annotated[
        bool,
        typer.Option(
            "--install",
            help="Run `linkctl service install` in every container, then reboot them.",
        ),
    ] = False,
    hold: Annotated[
        float,
        typer.Option("--hold", help="Seconds to keep them running (0: until Ctrl-C)."),
    ] = 0.0,
    dry_run: Annotated[
        bool,
        typer.Option(
            "--dry-run",
            help="Print the lab, the image (cached or to build) and the containers; make nothing.",
        ),
    ] = False,
    json_: JsonOpt = False,
) -> None:
    """Boot every profile host as a container with systemd as PID 1, in a lab of its own.

    A Debian rootfs (mmdebstrap, cached under /var/cache/linkctl/rootfs) with linkctl
    installed from a wheel of this checkout; each host boots inside its lab namespace
    (link port named like the profile's interface, WiFi router for the default route),
    with the llama.cpp build bound read-only. Runs until Ctrl-C (or --hold seconds),
    then removes every container, mount, cgroup and namespace it made.

    Examples:
      linkctl lab boot --install
      linkctl lab boot --profile dgx2-mac-switch --hold 60
      linkctl lab boot --install --dry-run
    """
    import time

    from linkctl.core.errors import InputError
    from linkctl.lab import boot, rootfs

    if not dry_run:
        require_root(f"{NETNS} and boots containers")
    prof, path = load(profile)

    def say(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    llama = boot.llama_dir()
    if install and llama is None:
        raise InputError("--install needs the llama.cpp build", "run scripts/build-llama.sh first")
    if dry_run:
        _show_boot_plan(boot.plan(prof, name, llama, install), json_)
        return
    image = rootfs.prepare(log=say)
    try:
        with boot.BootLab(prof, name, image, llama, log=say) as bl:
            if install:
                bl.install_services()
                say(f"installed the services; rebooted in {bl.reboot_all():.1f} s")
            hosts = {
                h: {"container": c.name, "pid1": c.leader(), "netns": c.netns}
                for h, c in bl.containers.items()
            }
            if json_:
                emit_json({"lab": name, "profile": prof.name, "hosts": hosts}, path)
            else:
                for h, info in hosts.items():
                    console.print(
                        f"  {h:8} {info['container']:20} PID 1 = {info['pid1']}  "
                        f"enter: nsenter -t {info['pid1']} -a bash",
                        markup=False,
                    )
            print("booted; Ctrl-C stops and removes everything", file=sys.stderr, flush=True)
            end = time.monotonic() + hold if hold > 0 else float("inf")
            while time.monotonic() < end:
                time.sleep(0.5)
    except KeyboardInterrupt:
        print("interrupted: containers and lab removed", file=sys.stderr)
        raise typer.Exit(130) from None
    finally:
        image.discard()
    print("containers and lab removed", file=sys.stderr)


def _show_boot_plan(p: BootPlan, json_: bool) -> None:
    if json_:
        print_json(p.as_json())
        return
    out = console.print
    out(
        f"lab boot [dry run]: profile {p.profile} in lab {p.lab.name!r}, namespaces "
        f"{', '.join(p.namespaces)}",
        markup=False,
    )
    im = p.image
    for what, path, cached in (
        ("rootfs", im.base, im.base_cached),
        ("wheels", im.wheels, im.wheels_cached),
    ):
        out(f"  {what:9} {path} ({'cached' if cached else 'would be built'})", markup=False)
    for host, c in p.containers.items():
        binds = " ".join(c["binds"]) or "no binds"
        out(
            f"  {host:9} container {c['name']} in {c['dir']}, netns {c['netns']}, {binds}",
            markup=False,
        )
    if p.install:
        out("  then      `linkctl service install` in every container, and a reboot", markup=False)


def register(app: typer.Typer) -> None:
    app.add_typer(lab_app, name="lab")
