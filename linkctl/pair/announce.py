"""What one host announces on the cable. The peer's announcement is untrusted input:
parsed strictly (unknown fields, wrong types and out-of-range values refused), with
every string and list bounded."""

from __future__ import annotations

import ipaddress
import secrets
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from linkctl.core.errors import InputError
from linkctl.core.profile import HOST_NAME_PATTERN

PROTOCOL: Literal[1] = 1
MAX_BYTES = 4096  # one announcement; a datagram longer than this is refused
MAX_NETWORKS = 64

# Printable only: a peer's strings reach screens and logs (no control characters).
PRINTABLE = r"^[^\x00-\x1f\x7f]*$"
Short = Annotated[str, Field(max_length=64, pattern=PRINTABLE)]


class Wants(BaseModel):
    """What the host's owner asked for on the command line (both sides must agree)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    name: Short | None = None
    subnet: Short | None = None
    head: Short | None = None
    model: Annotated[str, Field(max_length=512, pattern=PRINTABLE)] | None = None
    # How far this run goes: both hosts must go as far (a peer that probes needs this
    # host's responder).
    dry_run: bool = False
    setup: bool = True


class Announcement(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    protocol: Literal[1]
    linkctl: Short
    nonce: str = Field(pattern=r"^[0-9a-f]{32}$")
    # This host's X25519 public share: the pair secret is agreed from both
    # (linkctl.trust.agreement), and the pairing code covers them.
    key_share: str = Field(pattern=r"^[0-9a-f]{64}$")
    host: str = Field(pattern=HOST_NAME_PATTERN)
    os: Literal["linux", "macos"]
    interface: str = Field(pattern=r"^[A-Za-z0-9_.:-]{1,15}$")
    mac: str | None = Field(default=None, pattern=r"^([0-9a-f]{2}:){5}[0-9a-f]{2}$")
    accelerator: Short = ""
    device: Short | None = None  # the device catalog's key, when it knows the accelerator
    memory_gb: float = Field(gt=0, le=65536)
    usable_gb: float = Field(gt=0, le=65536)
    llama_build: Annotated[str, Field(max_length=128, pattern=PRINTABLE)] | None = None
    rpc_protocol: Annotated[list[Annotated[int, Field(ge=0, le=1000)]], Field(max_length=3)] = []
    max_mtu: int = Field(ge=1280, le=65535)
    speed_mbps: int | None = Field(default=None, gt=0, le=10_000_000)
    # IPv4 networks this host routes or holds (its pairing interface's excepted): the
    # subnet agreed on must overlap none of them.
    networks: Annotated[list[Short], Field(max_length=MAX_NETWORKS)] = []
    wants: Wants = Wants()

    def used_networks(self) -> list[ipaddress.IPv4Network]:
        return [ipaddress.IPv4Network(n, strict=False) for n in self.networks]


def parse(data: Any, source: str) -> Announcement:
    """A peer's announcement; InputError (exit 2) naming the first bad field."""
    try:
        ann = Announcement.model_validate(data)
        ann.used_networks()
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(str(x) for x in err["loc"]) or "announcement"
        raise InputError(
            f"malformed announcement from {source}: {where}: {err['msg']}",
            "the peer runs another linkctl, or it is not a linkctl peer; install the same "
            "linkctl on both hosts",
        ) from None
    except ValueError as e:
        raise InputError(
            f"malformed announcement from {source}: networks: {e}",
            "install the same linkctl on both hosts",
        ) from None
    return ann


def host_name(raw: str) -> str:
    """A host name a profile accepts (a letter first, then 15 of a-z0-9-)."""
    name = "".join(c if c.isalnum() and c.isascii() else "-" for c in raw.lower()).strip("-")
    if not name or not name[0].isalpha():
        name = "h" + name
    return name[:16].rstrip("-")


@dataclass(frozen=True)
class Local:
    """Facts gathered here before announcing (pair.run fills them)."""

    host: str
    os: str
    interface: str
    mac: str | None
    accelerator: str
    device: str | None
    memory_gb: float
    usable_gb: float
    llama_build: str | None
    rpc_protocol: tuple[int, ...]
    max_mtu: int
    speed_mbps: int | None
    networks: tuple[str, ...]


def announcement(local: Local, wants: Wants, version: str, key_share: str) -> Announcement:
    return Announcement(
        protocol=PROTOCOL,
        linkctl=version,
        nonce=secrets.token_hex(16),
        key_share=key_share,
        host=local.host,
        os=local.os,  # type: ignore[arg-type]
        interface=local.interface,
        mac=local.mac,
        accelerator=local.accelerator[:64],
        device=local.device,
        memory_gb=local.memory_gb,
        usable_gb=local.usable_gb,
        llama_build=local.llama_build[:128] if local.llama_build else None,
        rpc_protocol=list(local.rpc_protocol),
        max_mtu=max(1280, min(local.max_mtu, 65535)),
        speed_mbps=local.speed_mbps,
        networks=list(local.networks[:MAX_NETWORKS]),
        wants=wants,
    )
