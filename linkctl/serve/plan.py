"""What each host of the pair runs, as typed invocations: ggml-rpc-server on every rpc
host, llama-server on the head (linkctl.llama.invocation; argv rendered only where a
process starts or a plan is printed). No side effects.

rpc-server has no authentication: it binds only to the host's link address, never to
a wildcard or another address, whatever the profile's bind or extra arguments say.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from linkctl.core.errors import InputError
from linkctl.core.profile import HostSpec, Profile
from linkctl.llama.bins import LlamaBins
from linkctl.llama.invocation import RpcServerInvocation, ServerInvocation
from linkctl.serve.auth import ServeAuth, serve_auth
from linkctl.serve.split import SplitChoice, legacy_tensor_split


@dataclass
class ServePlan:
    profile: str
    host: str
    role: str  # "rpc" or "head"
    head: ServerInvocation
    rpc: dict[str, RpcServerInvocation]  # rpc host name -> its rpc-server, in --rpc order
    model: str | None = None
    notes: list[str] = field(default_factory=list)
    bins: dict[str, Any] = field(default_factory=dict)
    split: SplitChoice | None = None  # head only
    auth: ServeAuth | None = None  # head only

    @property
    def invocation(self) -> ServerInvocation | RpcServerInvocation:
        """What this host runs."""
        return self.rpc[self.host] if self.role == "rpc" else self.head

    @property
    def endpoints(self) -> list[str]:
        return [inv.endpoint for inv in self.rpc.values()]

    @property
    def health_url(self) -> str | None:
        return f"{self.head.base_url}/health" if self.role == "head" else None

    def as_dict(self) -> dict[str, Any]:
        """`serve --dry-run --json`: this host's argv, every host's, and the decisions."""
        return {
            "profile": self.profile,
            "host": self.host,
            "role": self.role,
            "argv": self.invocation.argv(),
            "rpc_argv": {name: inv.argv() for name, inv in self.rpc.items()},
            "head_argv": self.head.argv(),
            "endpoints": self.endpoints,
            "bind": self.rpc[self.host].host if self.role == "rpc" else None,
            "health_url": self.health_url,
            "model": self.model,
            "notes": self.notes,
            "bins": self.bins,
            "split": self.split.as_dict() if self.split and self.role == "head" else None,
            "auth": self.auth.as_dict() if self.auth else None,
        }


def _bin_for(host: HostSpec, local: HostSpec, bins: LlamaBins, role: str) -> str:
    """The binary path for ``host``: the found one for this host, else the profile's
    llama_bin_dir or the plain name (resolved on that host)."""
    found = bins.rpc_server if role == "rpc-server" else bins.llama_server
    if host.name == local.name and found:
        return found.path
    name = "ggml-rpc-server" if role == "rpc-server" else "llama-server"
    return str(Path(host.llama_bin_dir) / name) if host.llama_bin_dir else name


def check_bind_spec(host: HostSpec) -> None:
    """The profile's bind must be this host's own link address (never a wildcard)."""
    bind = ipaddress.IPv4Address(host.rpc_bind)
    if bind.is_unspecified or bind != host.address.ip:
        what = "a wildcard" if bind.is_unspecified else f"not {host.name}'s link address {host.ip}"
        raise InputError(
            f"hosts.{host.name}.rpc.bind = {bind} is {what}; rpc-server has no authentication",
            f"remove rpc.bind (defaults to {host.ip}) or set it to {host.ip}",
        )


def rpc_invocation(host: HostSpec, binary: str) -> RpcServerInvocation:
    check_bind_spec(host)
    r = host.rpc
    inv = RpcServerInvocation(binary, host.rpc_bind, r.port, r.threads, r.device, r.cache)
    return inv.with_extra(r.extra_args, f"hosts.{host.name}.rpc.extra_args")


def head_invocation(
    profile: Profile, binary: str, model: str, split: SplitChoice | None = None
) -> ServerInvocation:
    """The head's llama-server: every rpc host's endpoint, the split's -ts weights, the
    profile's context, GPU layers, threads and API key file, then serve.extra_args."""
    s = profile.serve
    weights = split.tensor_split if split is not None else legacy_tensor_split(profile)
    inv = ServerInvocation(
        binary,
        model,
        host=str(s.host),
        port=s.port,
        # llama.cpp orders devices RPC servers first (in --rpc order), then local ones
        # (src/llama.cpp llama_prepare_model_devices).
        rpc=tuple(h.rpc_endpoint for h in profile.rpc_hosts),
        ngl=s.ngl,
        ctx=s.ctx,
        tensor_split=tuple(weights) if weights else None,
        threads=s.threads,
        api_key_file=s.api_key_file,
    )
    return inv.with_extra(s.extra_args, "serve.extra_args")


def build_plan(
    profile: Profile,
    host: HostSpec,
    bins: LlamaBins,
    model: str | None = None,
    split: SplitChoice | None = None,
) -> ServePlan:
    """Every host's invocation, for this host's role; no side effects."""
    model = model or profile.serve.model
    notes = []
    if not model:
        notes.append("serve.model is empty: set it in the profile or pass --model")
    rpc = {
        h.name: rpc_invocation(h, _bin_for(h, host, bins, "rpc-server")) for h in profile.rpc_hosts
    }
    head_bin = _bin_for(profile.head, host, bins, "llama-server")
    head = head_invocation(profile, head_bin, model or "MODEL", split)
    if profile.serve.host.is_unspecified:
        notes.append(f"llama-server listens on {profile.serve.host}: every interface")
    auth = serve_auth(profile) if host.role == "head" else None
    if auth is not None:
        notes.append(auth.summary())
    for role_bin, b in (("rpc-server", bins.rpc_server), ("llama-server", bins.llama_server)):
        if b is None:
            notes.append(f"{role_bin} not found on this host (searched: {', '.join(bins.tried)})")
    if split is not None and host.role == "head":
        notes += split.notes
    return ServePlan(
        profile=profile.name,
        host=host.name,
        role=host.role,
        head=head,
        rpc=rpc,
        model=model or None,
        notes=notes,
        bins=bins.as_dict(),
        split=split if host.role == "head" else None,
        auth=auth,
    )
