"""serve.mode = "disaggregated": what each host runs, from the profile.

    prefill host : llama-server on its link address (--slot-save-path = the kv area)
                   + kv-agent on its link address (areas kv and models)
    head         : llama-server on 127.0.0.1:decode_port (--slot-save-path its own kv dir)
                   + route on serve.host:serve.port, where clients already go

Both servers get the same context, slot count, GPU layers and extra arguments from
the one profile (the same KV cache layout among them), and --cache-ram 0 (see
linkctl/disagg/route.py for why). A layer split's --rpc is not used in this mode.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from linkctl.core.paths import state_dir
from linkctl.core.profile import HostSpec, Profile
from linkctl.llama.invocation import KvLayout, ServerInvocation

if TYPE_CHECKING:
    from linkctl.disagg.router import RouteConfig


def kv_dir() -> Path:
    """This host's slot files: the llama-server --slot-save-path and the agent's kv area."""
    return state_dir() / "serve" / "slots"


def models_dir() -> Path:
    """Where `linkctl model sync` puts model files on the prefill host."""
    return state_dir() / "models"


def prefill_model_path(profile: Profile) -> str:
    d = profile.serve.disagg
    if d.prefill_model:
        return d.prefill_model
    return str(models_dir() / Path(profile.serve.model or "model.gguf").name)


def prefill_key_path() -> Path:
    """The prefill llama-server's --api-key-file: the key derived from the pair secret
    (linkctl.disagg.router.prefill_api_key), written 0600 by serve on the prefill host
    at each start."""
    return state_dir() / "serve" / "prefill-api-key"


def server_invocation(
    profile: Profile, binary: str, model: str, host: str, port: int, api_key_file: str | None
) -> ServerInvocation:
    """One of the two servers: the same context, slots, layers, threads and extra
    arguments on both, so that a slot saved on one restores on the other."""
    s, d = profile.serve, profile.serve.disagg
    inv = ServerInvocation(
        binary,
        model,
        host,
        port,
        ngl=s.ngl,
        ctx=s.ctx,
        slots=d.slots,
        threads=s.threads,
        # The decode server checks the users' keys (serve.api_key_file), route forwarding
        # the client's Authorization; the prefill server only the key derived from the
        # pair secret, which route alone sends it (RouteConfig.prefill_headers).
        api_key_file=api_key_file,
        slot_save_path=str(kv_dir()),
        cache_ram_mib=0,
    )
    return inv.with_extra(s.extra_args, "serve.extra_args")


def kv_layout(profile: Profile) -> KvLayout:
    """The KV cache layout both servers run, from the profile."""
    return server_invocation(profile, "llama-server", "", "127.0.0.1", 0, None).kv


@dataclass
class DisaggPlan:
    profile: str
    host: str
    role: Literal["prefill", "decode"]
    prefill: ServerInvocation
    decode: ServerInvocation
    agent: str  # host:port of the kv-agent
    route_listen: str
    threshold_tokens: int | None
    notes: list[str] = field(default_factory=list)

    @property
    def invocation(self) -> ServerInvocation:
        """What this host's llama-server runs."""
        return self.decode if self.role == "decode" else self.prefill

    def as_dict(self) -> dict[str, Any]:
        """`serve --dry-run --json` in disaggregated mode."""
        return {
            "profile": self.profile,
            "host": self.host,
            "role": self.role,
            "argv": self.invocation.argv(),
            "prefill_argv": self.prefill.argv(),
            "decode_argv": self.decode.argv(),
            "prefill_url": self.prefill.base_url,
            "decode_url": self.decode.base_url,
            "agent": self.agent,
            "route_listen": self.route_listen,
            "threshold_tokens": self.threshold_tokens,
            "kv_layout": self.prefill.kv.as_dict(),
            "notes": self.notes,
        }


def build_plan(
    profile: Profile, host: HostSpec, binary: str = "llama-server", model: str | None = None
) -> DisaggPlan:
    s, d = profile.serve, profile.serve.disagg
    pre = profile.prefill_host
    model = model or s.model
    notes = []
    if not model:
        notes.append("serve.model is empty: set it in the profile or pass --model")
    prefill = server_invocation(
        profile, binary, prefill_model_path(profile), pre.ip, d.prefill_port,
        str(prefill_key_path()),
    )  # fmt: skip
    decode = server_invocation(
        profile, binary, model or "MODEL", "127.0.0.1", d.decode_port, s.api_key_file
    )
    role: Literal["prefill", "decode"] = "decode" if host.role == "head" else "prefill"
    if role == "prefill" and host.name != pre.name:
        notes.append(f"{host.name} is not the prefill host ({pre.name}): it runs nothing")
    return DisaggPlan(
        profile=profile.name,
        host=host.name,
        role=role,
        prefill=prefill,
        decode=decode,
        agent=f"{pre.ip}:{d.agent_port}",
        route_listen=f"{s.host}:{s.port}",
        threshold_tokens=d.threshold_tokens,
        notes=notes,
    )


def resolve_route_config(
    profile: Profile, model: str | None, threshold: int | None = None
) -> RouteConfig:
    """route_config with the threshold from --threshold, else the profile, else the
    estimate (linkctl/estimate/ttft.py)."""
    from linkctl.estimate.ttft import threshold_for_profile

    if threshold is not None or profile.serve.disagg.threshold_tokens is not None:
        return route_config(profile, threshold)
    est = threshold_for_profile(profile, model or profile.serve.model)
    return route_config(profile, est.tokens, source=est.source, from_estimate=True)


def route_config(
    profile: Profile, threshold: int | None = None, source: str = "", from_estimate: bool = False
) -> RouteConfig:
    """The RouteConfig for the head, from the profile; ``threshold`` overrides both
    serve.disagg.threshold_tokens and the estimate."""
    from linkctl.disagg.router import RouteConfig
    from linkctl.llama.client import LlamaServer
    from linkctl.serve.auth import read_api_keys

    s, d = profile.serve, profile.serve.disagg
    pre = profile.prefill_host
    head = profile.head
    if threshold is not None:
        t, why = threshold, source if from_estimate else "--threshold"
    elif d.threshold_tokens is not None:
        t, why = d.threshold_tokens, "serve.disagg.threshold_tokens"
    else:
        t, why = 512, source or "default (no estimate)"
    return RouteConfig(
        decode=LlamaServer("127.0.0.1", d.decode_port),
        decode_slot_dir=kv_dir(),
        prefill=LlamaServer(pre.ip, d.prefill_port, source=head.ip),
        agent_host=pre.ip,
        agent_port=d.agent_port,
        source=head.ip,
        threshold_tokens=t,
        threshold_source=why,
        slots=d.slots,
        max_body_bytes=d.max_body_bytes,
        listen_host=str(s.host),
        listen_port=s.port,
        api_keys=read_api_keys(s.api_key_file) if s.api_key_file else [],
        profile_name=profile.name,
    )
