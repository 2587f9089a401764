"""Both announcements -> one profile, computed alike on both hosts (so that its digest
proves agreement), or a refusal naming the field, the value and the fix."""

from __future__ import annotations

import hashlib
import ipaddress
import json
from collections.abc import Iterator
from typing import Any

import tomli_w

from linkctl.core.errors import InputError
from linkctl.core.profile import Profile, parse_profile
from linkctl.pair.announce import Announcement

DEFAULT_SUBNET = ipaddress.IPv4Network("192.168.100.0/24")  # the shipped profiles'
MAX_CLOCK_SKEW_S = 120.0  # probe reports and calibrations carry times both hosts read
JUMBO = 9000


def transcript(a: Announcement, b: Announcement) -> bytes:
    """Both announcements' digest, the same whichever host computes it."""
    both = sorted(json.dumps(x.model_dump(mode="json"), sort_keys=True) for x in (a, b))
    return hashlib.sha256("\n".join(both).encode()).digest()


def code(a: Announcement, b: Announcement) -> str:
    """The short code both screens show: the same on both hosts only for these two
    announcements, key shares included (a third host's differs), like Bluetooth's
    numeric comparison."""
    n = int.from_bytes(transcript(a, b)[:8], "big")
    digits = f"{n % 1_000_000:06d}"
    return f"{digits[:3]}-{digits[3:]}"


def check_peer(me: Announcement, peer: Announcement, skew_s: float) -> None:
    """Refuse a peer this host cannot pair with: same name, another linkctl, another
    RPC protocol, a run that goes less far, a clock far off (``skew_s``: the peer's
    send time minus this host's receive time)."""
    if peer.host == me.host:
        raise InputError(
            f"both hosts are named {me.host!r}",
            "give one of them another name: linkctl pair --host NAME",
        )
    if peer.linkctl != me.linkctl:
        raise InputError(
            f"peer {peer.host} runs linkctl {peer.linkctl}, this host {me.linkctl}",
            "install the same linkctl release on both hosts",
        )
    # ggml-rpc.cpp refuses a server whose major protocol differs (RPC_PROTO_MAJOR_VERSION).
    if me.rpc_protocol and peer.rpc_protocol and me.rpc_protocol[0] != peer.rpc_protocol[0]:
        mine, theirs = (".".join(map(str, p)) for p in (me.rpc_protocol, peer.rpc_protocol))
        raise InputError(
            f"peer {peer.host}'s llama.cpp speaks RPC protocol {theirs}, this host's {mine}",
            "build the same llama.cpp release on both hosts (scripts/build-llama.sh)",
        )
    for flag, mine_v, theirs_v in (
        ("--dry-run", me.wants.dry_run, peer.wants.dry_run),
        ("--no-setup", not me.wants.setup, not peer.wants.setup),
    ):
        if mine_v != theirs_v:
            raise InputError(
                f"{flag} is given on {me.host if mine_v else peer.host} only",
                f"give {flag} on both hosts or on neither",
            )
    if abs(skew_s) > MAX_CLOCK_SKEW_S:
        raise InputError(
            f"peer {peer.host}'s clock is {skew_s:+.0f} s from this host's "
            f"(at most {MAX_CLOCK_SKEW_S:g} s)",
            "turn on time sync on both (Linux: timedatectl set-ntp true; macOS: "
            "System Settings > General > Date & Time)",
        )


def _one(field: str, a: str | None, b: str | None) -> str | None:
    if a and b and a != b:
        raise InputError(
            f"the two hosts were given different --{field}: {a!r} and {b!r}",
            f"give the same --{field} on both, or on one only",
        )
    return a or b


def _candidates() -> Iterator[ipaddress.IPv4Network]:
    yield DEFAULT_SUBNET
    for third in range(101, 255):
        yield ipaddress.IPv4Network(f"192.168.{third}.0/30")


def _overlaps(net: ipaddress.IPv4Network, a: Announcement, b: Announcement) -> str | None:
    for ann in (a, b):
        for used in ann.used_networks():
            if used.prefixlen > 0 and net.overlaps(used):
                return f"{used} on {ann.host}"
    return None


def parse_subnet(text: str) -> ipaddress.IPv4Network:
    try:
        net = ipaddress.IPv4Network(text, strict=True)
    except ValueError as e:
        raise InputError(f"--subnet {text!r}: {e}", "write it as A.B.C.0/30") from None
    if not 16 <= net.prefixlen <= 30:
        raise InputError(f"--subnet {text}: prefix /{net.prefixlen}", "use /16 to /30")
    return net


def subnet(a: Announcement, b: Announcement) -> ipaddress.IPv4Network:
    wanted = _one("subnet", a.wants.subnet, b.wants.subnet)
    if wanted:
        net = parse_subnet(wanted)
        clash = _overlaps(net, a, b)
        if clash:
            raise InputError(
                f"--subnet {net} overlaps {clash}", "choose a subnet neither host uses"
            )
        return net
    for net in _candidates():
        if not _overlaps(net, a, b):
            return net
    raise InputError("no free subnet in 192.168.100-254", "choose one with --subnet A.B.C.D/30")


def roles(a: Announcement, b: Announcement) -> tuple[Announcement, Announcement, str]:
    """(head, rpc host, why): the larger usable accelerator memory holds the model and
    runs llama-server, unless --head names a host."""
    named = _one("head", a.wants.head, b.wants.head)
    if named:
        by_name = {x.host: x for x in (a, b)}
        if named not in by_name:
            raise InputError(f"--head {named!r} is neither host", f"name {a.host} or {b.host}")
        head = by_name[named]
        return head, (b if head is a else a), "--head"
    head, rpc = sorted((a, b), key=lambda x: (-x.usable_gb, -x.memory_gb, x.host))
    if head.usable_gb == rpc.usable_gb:
        return head, rpc, f"equal memory ({head.usable_gb:g} GiB): the first by name"
    return head, rpc, f"more usable memory ({head.usable_gb:g} vs {rpc.usable_gb:g} GiB)"


def profile(a: Announcement, b: Announcement) -> tuple[Profile, str]:
    """The profile both hosts write (the same whichever host computes it), and why the
    head is the head."""
    net = subnet(a, b)
    head, rpc, why = roles(a, b)
    name = _one("name", a.wants.name, b.wants.name) or f"{head.host}-{rpc.host}"
    mtu = min(JUMBO, head.max_mtu, rpc.max_mtu)
    speeds = [s for s in (head.speed_mbps, rpc.speed_mbps) if s]
    addrs = list(net.hosts())

    def host(x: Announcement, role: str, ip: ipaddress.IPv4Address) -> dict:
        h = {
            "name": x.host,
            "os": x.os,
            "interface": x.interface,
            "address": f"{ip}/{net.prefixlen}",
            "role": role,
            "memory_gb": x.memory_gb,
        }
        if x.mac:
            h["mac"] = x.mac  # pinned: probe notices a swapped cable
        if x.device:
            h["device"] = x.device
        return h

    data: dict[str, Any] = {
        "name": name,
        "description": (
            f"{head.host} ({head.accelerator or head.os}, head) and "
            f"{rpc.host} ({rpc.accelerator or rpc.os}, rpc), paired by linkctl pair"
        ),
        "link": {
            "subnet": str(net),
            "mtu": mtu,
            "expected_speed_mbps": min(speeds) if speeds else 10000,
        },
        "hosts": [host(head, "head", addrs[0]), host(rpc, "rpc", addrs[1])],
    }
    model = _one("model", a.wants.model, b.wants.model)
    if model:
        data["serve"] = {"model": model}
    try:
        return parse_profile(data, "the paired profile"), why
    except InputError as e:
        raise InputError(f"the paired profile is not valid: {e.message}", e.fix) from None


def render(prof: Profile) -> str:
    return "# written by `linkctl pair`\n" + tomli_w.dumps(prof.to_toml_dict())


def digest(text: str, a: Announcement, b: Announcement) -> str:
    """What each host confirms: this profile, in this session (both nonces)."""
    nonces = "".join(sorted((a.nonce, b.nonce)))
    return hashlib.sha256(f"{nonces}\n{text}".encode()).hexdigest()
