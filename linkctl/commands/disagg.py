"""linkctl route (head) and linkctl kv-agent (prefill host): disaggregated serving."""

from __future__ import annotations

import sys
from typing import Annotated

import typer

from linkctl.commands.common import DryRunOpt, HostOpt, JsonOpt, ProfileOpt, load_with_host
from linkctl.core.output import console, print_json


def _stamp_say(who: str):
    from linkctl.serve.supervise import stamp

    def say(msg: str) -> None:
        sys.stderr.write(f"{stamp()} linkctl[{who}] {msg}\n")
        sys.stderr.flush()

    return say


def wait_for_signal() -> None:
    """Block the main thread until SIGTERM or SIGINT."""
    from linkctl.core.stopflag import stop_on_signals

    with stop_on_signals() as stop:
        stop.wait()


def register(app: typer.Typer) -> None:
    _register_model_sync()

    @app.command()
    def route(
        profile: ProfileOpt = None,
        host: HostOpt = None,
        threshold: Annotated[
            int | None,
            typer.Option(
                "--threshold",
                min=0,
                help="Prompt tokens from which to disaggregate (default: "
                "serve.disagg.threshold_tokens, else the estimate).",
                show_default=False,
            ),
        ] = None,
        model: Annotated[
            str | None,
            typer.Option("--model", "-m", help="The decode model (overrides serve.model)."),
        ] = None,
        wait: Annotated[
            float, typer.Option("--wait", help="Seconds to wait for both servers' /props.")
        ] = 120.0,
        dry_run: DryRunOpt = False,
        json_: JsonOpt = False,
    ) -> None:
        """HTTP front on the head: long prompts prefill on the prefill host.

        Serves llama-server's /completion, /v1/completions and /v1/chat/completions
        (streaming or not) on serve.host:serve.port. A prompt of at least the
        threshold's tokens is prefilled on the prefill host's llama-server, its slot
        saved, copied over the link by the kv-agent (checksummed), restored into a
        slot of the decode server here, and generated there; shorter prompts go
        straight to the decode server. If the prefill host or the transfer fails,
        the request is prefilled here instead (logged as a fallback). Refuses to
        start when the two servers differ (build, model, context, slots, template).
        Every answer carries X-Linkctl-Route: direct|disaggregated|fallback;
        GET /linkctl/stats shows counts and the recent requests.

        Examples:
          linkctl route --dry-run
          linkctl route --threshold 256
        """
        from linkctl.disagg import kvxfer
        from linkctl.disagg import plan as disagg
        from linkctl.disagg import route as rt

        prof, h, _backend = load_with_host(profile, host)
        if h.role != "head":
            from linkctl.core.errors import InputError

            raise InputError(
                f"route runs on the head ({prof.head.name}), this is {h.name}",
                "run `linkctl kv-agent` here instead",
            )
        cfg = disagg.resolve_route_config(prof, model, threshold)
        summary = {
            "listen": f"{cfg.listen_host}:{cfg.listen_port}",
            "decode": cfg.decode.url,
            "prefill": cfg.prefill.url if cfg.prefill else None,
            "agent": f"{cfg.agent_host}:{cfg.agent_port}",
            "source": cfg.source,
            "threshold_tokens": cfg.threshold_tokens,
            "threshold_source": cfg.threshold_source,
            "slots": cfg.slots,
        }
        if dry_run:
            if json_:
                print_json(summary)
            else:
                for k, v in summary.items():
                    console.print(f"{k:17s} {v}", markup=False)
            return
        say = _stamp_say("route")
        local_fp = {
            **kvxfer.fingerprint(model or prof.serve.model),
            "kv_layout": disagg.kv_layout(list(prof.serve.extra_args)),
        }
        remote_fp = kvxfer.remote_model(cfg.agent_host or "", cfg.agent_port, source=cfg.source)
        rt.check_pair(cfg, (local_fp, remote_fp), wait_s=wait, say=say)
        cfg.decode_slot_dir.mkdir(parents=True, exist_ok=True)
        server = rt.RouteServer(rt.Router(cfg)).start()
        say(
            f"listening on {summary['listen']}; disaggregating prompts of "
            f"{cfg.threshold_tokens}+ tokens ({cfg.threshold_source})"
        )
        try:
            wait_for_signal()
        finally:
            server.stop()
            say("stopped")

    @app.command("kv-agent")
    def kv_agent(
        profile: ProfileOpt = None,
        host: HostOpt = None,
        json_: JsonOpt = False,
        dry_run: DryRunOpt = False,
    ) -> None:
        """Serve slot files and receive model files over the link (prefill host).

        Binds only to this host's link address (serve.disagg.agent_port) and answers
        only peers on the link subnet; no authentication, like rpc-server. Areas:
        kv (the prefill llama-server's --slot-save-path) and models (`model sync`).

        Examples:
          linkctl kv-agent --dry-run
          linkctl kv-agent --host dgx
        """
        from linkctl.disagg import kvxfer
        from linkctl.disagg import plan as disagg

        prof, h, backend = load_with_host(profile, host)
        areas = {"kv": disagg.kv_dir(), "models": disagg.models_dir()}
        plan = {
            "bind": f"{h.ip}:{prof.serve.disagg.agent_port}",
            "areas": {k: str(v) for k, v in areas.items()},
            "model": disagg.prefill_model_path(prof),
            "allowed_peers": str(prof.link.subnet),
            # The flags serve gives this host's llama-server (disagg.server_argv).
            "kv_layout": disagg.kv_layout(list(prof.serve.extra_args)),
        }
        if dry_run:
            print_json(plan) if json_ else [console.print(f"{k:14s} {v}") for k, v in plan.items()]
            return
        from linkctl.serve.plan import check_bind_on_link

        check_bind_on_link(h, backend)
        for d in areas.values():
            d.mkdir(parents=True, exist_ok=True)
        say = _stamp_say("kv-agent")
        agent = kvxfer.Agent(
            h.ip,
            prof.serve.disagg.agent_port,
            areas,
            prof.link.subnet,
            log=say,
            model=plan["model"],
            kv_layout=plan["kv_layout"],
        ).start()
        say(f"listening on {plan['bind']} (peers {plan['allowed_peers']} only)")
        try:
            wait_for_signal()
        finally:
            agent.stop()
            say("stopped")


def _register_model_sync() -> None:
    from linkctl.commands.serve import model_app

    @model_app.command("sync")
    def model_sync(
        profile: ProfileOpt = None,
        host: HostOpt = None,
        model: Annotated[
            str | None,
            typer.Option("--model", "-m", help="The file to copy (default: serve.model)."),
        ] = None,
        dry_run: DryRunOpt = False,
        json_: JsonOpt = False,
    ) -> None:
        """Copy the model from the head to the prefill host over the link.

        Through the prefill host's kv-agent (running under `linkctl serve` there, or
        `linkctl kv-agent`), from this host's link address to its link address, into
        its models directory, where serve.mode = "disaggregated" looks for it. An
        interrupted copy resumes where it stopped (the partial file's SHA-256 is
        checked first); the file appears there only when the SHA-256 of every byte
        matches.

        Examples:
          linkctl model sync --dry-run
          linkctl model sync --model /models/m.gguf
        """
        from pathlib import Path

        from linkctl.core.errors import InputError
        from linkctl.disagg import kvxfer
        from linkctl.disagg import plan as disagg

        prof, h, _backend = load_with_host(profile, host)
        if h.role != "head":
            raise InputError(
                f"model sync runs on the head ({prof.head.name}), this is {h.name}",
                f"run it on {prof.head.name}",
            )
        src = Path(model or prof.serve.model)
        if not src.is_file():
            raise InputError(f"model {str(src)!r} is not a file", "set serve.model or pass --model")
        pre = prof.prefill_host
        if prof.serve.disagg.prefill_model:
            raise InputError(
                f"serve.disagg.prefill_model = {prof.serve.disagg.prefill_model!r} names the "
                f"model's path on {pre.name}: there is nothing to sync",
                "remove serve.disagg.prefill_model to let sync place it",
            )
        port = prof.serve.disagg.agent_port
        plan = {
            "source": str(src),
            "bytes": src.stat().st_size,
            "to": f"{pre.name} {pre.ip}:{port} models/{src.name}",
            "from_address": h.ip,
            "path_there": disagg.prefill_model_path(prof),
        }
        if dry_run:
            print_json(plan) if json_ else [console.print(f"{k:13s} {v}") for k, v in plan.items()]
            return
        say = _stamp_say("model-sync")
        last = [-1]

        def progress(done: int, total: int) -> None:
            pct = done * 100 // total if total else 100
            if pct != last[0] and (pct % 5 == 0 or done == total):
                last[0] = pct
                sys.stderr.write(f"\r{src.name}: {done / 2**20:.0f}/{total / 2**20:.0f} MiB {pct}%")
                sys.stderr.flush()

        res = kvxfer.put(pre.ip, port, "models", src, source=h.ip, progress=progress)
        sys.stderr.write("\n")
        out = plan | res.as_dict()
        if json_:
            print_json(out)
        else:
            resumed = f", resumed from {res.resumed_from} bytes" if res.resumed_from else ""
            say(
                f"{src.name} -> {pre.name}:{plan['path_there']}: {res.bytes} bytes in "
                f"{res.seconds:.2f} s ({res.gbps:.2f} Gbit/s){resumed}, sha256 {res.sha256[:16]} "
                "verified"
            )
