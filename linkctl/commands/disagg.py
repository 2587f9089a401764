"""route (head) and kv-agent (prefill host): disaggregated serving's own commands."""

from __future__ import annotations

from typing import Annotated

import typer

from linkctl.commands.common import (
    DryRunOpt,
    HostOpt,
    JsonOpt,
    ProfileOpt,
    emit_json,
    load_with_host,
)
from linkctl.core.output import console
from linkctl.core.paths import private_dir
from linkctl.core.privilege import require_writable_state


def wait_for_signal() -> None:
    """Block the main thread until SIGTERM or SIGINT."""
    from linkctl.core.stopflag import stop_on_signals

    with stop_on_signals() as stop:
        stop.wait()


def register(app: typer.Typer) -> None:
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
        from linkctl.core.log import speaker
        from linkctl.disagg import kvxfer
        from linkctl.disagg import plan as disagg
        from linkctl.disagg import route as rt
        from linkctl.disagg.fingerprint import fingerprint
        from linkctl.disagg.pair import check_pair

        if not dry_run:
            require_writable_state("its status and slot files (serve/)")
        prof, h, _backend, path = load_with_host(profile, host)
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
                emit_json(summary, path)
            else:
                for k, v in summary.items():
                    console.print(f"{k:17s} {v}", markup=False)
            return
        say = speaker("route")
        local_fp = fingerprint(model or prof.serve.model, disagg.kv_layout(prof))
        remote_fp = kvxfer.remote_model(
            cfg.agent_host or "", cfg.agent_port, secret=cfg.secret, source=cfg.source
        )
        check_pair(cfg, (local_fp, remote_fp), wait_s=wait, say=say)
        private_dir(cfg.decode_slot_dir)
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
        only peers on the link subnet that prove the pair secret (`linkctl key show`)
        before any request. Areas: kv (the prefill llama-server's --slot-save-path)
        and models (`model sync`).

        Examples:
          linkctl kv-agent --dry-run
          linkctl kv-agent --host dgx
        """
        from linkctl.core.log import speaker
        from linkctl.disagg import plan as disagg
        from linkctl.disagg.run import start_agent
        from linkctl.trust.secret import key_path

        if not dry_run:
            require_writable_state("slot files and models (serve/slots, models/)")
        prof, h, backend, path = load_with_host(profile, host)
        kv = disagg.kv_layout(prof)  # what serve gives this host's llama-server
        plan = {
            "bind": f"{h.ip}:{prof.serve.disagg.agent_port}",
            "areas": {"kv": str(disagg.kv_dir()), "models": str(disagg.models_dir())},
            "model": disagg.prefill_model_path(prof),
            "allowed_peers": str(prof.link.subnet),
            "authentication": f"pair secret {key_path(prof.name)}",
            "kv_layout": kv.as_dict(),
        }
        if dry_run:
            if json_:
                emit_json(plan, path)
            else:
                for k, v in plan.items():
                    console.print(f"{k:14s} {v}")
            return
        from linkctl.serve.run import check_bind_on_link

        check_bind_on_link(h, backend)
        agent = start_agent(prof, h, kv)
        try:
            wait_for_signal()
        finally:
            agent.stop()
            speaker("kv-agent")("stopped")
