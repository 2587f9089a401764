"""Profiles: the TOML description of a link and the hosts on it, validated.

A profile names one segment (a direct cable, or a switch) with one head host
(runs llama-server) and any number of rpc hosts (run rpc-server). Every
error is reported as one line naming the field, the value and the fix.
"""

from __future__ import annotations

import ipaddress
import re
import tomllib
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic_core import ErrorDetails

from linkctl.core.errors import InputError
from linkctl.core.paths import DEFAULT_PROFILE, profile_dirs, profile_files

HOST_NAME_PATTERN = r"^[a-z][a-z0-9-]{0,15}$"
PROFILE_NAME_PATTERN = r"^[a-z0-9][a-z0-9_.-]{0,40}$"
IFNAME_RE = re.compile(r"^[A-Za-z0-9_.:-]{1,15}$")
MAC_RE = re.compile(r"^([0-9a-f]{2}:){5}[0-9a-f]{2}$")
# Ethernet MTUs a NIC can plausibly take: IPv4 minimum up to the common jumbo ceiling.
MTU_MIN, MTU_MAX = 576, 9216

Port = Annotated[int, Field(ge=1, le=65535)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=False)


class LinkSpec(_Strict):
    subnet: ipaddress.IPv4Network
    mtu: int = Field(default=9000, ge=MTU_MIN, le=MTU_MAX)
    expected_speed_mbps: int = Field(default=10000, gt=0)

    @field_validator("subnet", mode="before")
    @classmethod
    def _strict_subnet(cls, v: Any) -> Any:
        if isinstance(v, str):
            try:
                return ipaddress.IPv4Network(v, strict=True)
            except ValueError as e:
                raise ValueError(f"not an IPv4 network ({e}); write it as A.B.C.0/PREFIX") from e
        return v

    @field_validator("subnet")
    @classmethod
    def _sane_prefix(cls, v: ipaddress.IPv4Network) -> ipaddress.IPv4Network:
        if v.prefixlen < 16 or v.prefixlen > 30:
            raise ValueError("prefix must be /16 to /30 for a point-to-point segment")
        return v


class RpcSpec(_Strict):
    port: Port = 50052
    # Defaults to the host's link address. A wildcard is refused: rpc-server has no auth.
    bind: ipaddress.IPv4Address | None = None
    threads: int | None = Field(default=None, ge=1, le=1024)
    device: str | None = None
    cache: bool = False
    extra_args: list[str] = []


class HostSpec(_Strict):
    name: str = Field(pattern=HOST_NAME_PATTERN)
    os: Literal["linux", "macos"]
    interface: str
    address: ipaddress.IPv4Interface
    role: Literal["head", "rpc"]
    mac: str | None = None
    rpc: RpcSpec = RpcSpec()
    # Where this host's llama.cpp binaries live; None means PATH.
    llama_bin_dir: str | None = None
    device: str | None = None  # device catalog key, e.g. "gb10", "m2-ultra"
    memory_gb: float | None = Field(default=None, gt=0)

    @field_validator("interface")
    @classmethod
    def _ifname(cls, v: str) -> str:
        if not IFNAME_RE.fullmatch(v):
            raise ValueError("not a valid interface name (1-15 of letters, digits, _.:-)")
        return v

    @field_validator("address", mode="before")
    @classmethod
    def _need_prefix(cls, v: Any) -> Any:
        if isinstance(v, str) and "/" not in v:
            raise ValueError("needs a prefix length, e.g. 192.168.100.2/24")
        return v

    @field_validator("mac")
    @classmethod
    def _mac(cls, v: str | None) -> str | None:
        if v is not None:
            v = v.lower()
            if not MAC_RE.fullmatch(v):
                raise ValueError("not a MAC address; write it as aa:bb:cc:dd:ee:ff")
        return v

    @property
    def ip(self) -> str:
        return str(self.address.ip)

    @property
    def rpc_bind(self) -> str:
        return str(self.rpc.bind or self.address.ip)

    @property
    def rpc_endpoint(self) -> str:
        return f"{self.rpc_bind}:{self.rpc.port}"


class DisaggSpec(_Strict):
    """serve.mode = "disaggregated": prefill on the prefill host, decode on the head."""

    prefill_host: str | None = None  # an rpc host's name; default: the only rpc host
    prefill_port: Port = 8081  # the prefill llama-server, on the prefill host's link address
    decode_port: Port = 8080  # the decode llama-server, on 127.0.0.1 of the head
    agent_port: Port = 50053  # the kv-agent, on the prefill host's link address
    # Prompts with fewer tokens skip disaggregation; None: from the estimate.
    threshold_tokens: int | None = Field(default=None, ge=0)
    slots: int = Field(default=1, ge=1, le=64)  # llama-server -np on both servers
    # route refuses (413) a request body past this: 8 MiB is some two million tokens.
    max_body_bytes: int = Field(default=8 * 1024 * 1024, ge=64 * 1024, le=1024**3)
    # The model on the prefill host; "": where `linkctl model sync` puts it there.
    prefill_model: str = ""


class ServeSpec(_Strict):
    mode: Literal["split", "disaggregated"] = "split"
    disagg: DisaggSpec = DisaggSpec()
    model: str = ""
    host: ipaddress.IPv4Address = ipaddress.IPv4Address("127.0.0.1")
    port: Port = 9999
    ctx: int = Field(default=4096, ge=64)
    ngl: int = Field(default=99, ge=0)
    tensor_split: list[Annotated[float, Field(ge=0)]] = []
    threads: int | None = Field(default=None, ge=1, le=1024)
    extra_args: list[str] = []
    # Layer split the head passes to llama-server: "recommended" (linkctl estimate's
    # fastest memory-feasible split), "llama" (llama.cpp's own, by free memory) or
    # weights "W,W,..." in llama.cpp device order (RPC hosts in --rpc order, then the
    # head's GPU). Unset (None) means "recommended", falling back to llama.cpp's split
    # with a note when the estimate cannot be made; set, it is a demand. None, not the
    # string, so a profile written back out (the lab's copy) stays unset.
    split: str | None = None
    # The head runs `linkctl verify` on serve.model before llama-server; a FAIL refuses to serve.
    verify: bool = False
    # llama-server's API has no authentication unless given keys. Off loopback and off
    # the link (e.g. 0.0.0.0, the Mac's Wi-Fi LAN) serve needs one of these
    # (linkctl.serve.plan.serve_auth): a file of keys for --api-key-file (mode 0600),
    # or an explicit opt-out.
    api_key_file: str | None = None
    allow_unauthenticated: bool = False
    # The watch while serving (linkctl/serve/watch.py): every watch_interval_s (0: off)
    # the link, the live RPC connection, rpc-server and decode speed are judged; a FAIL
    # applies on_fail: "stop" (no split until it clears), "fallback" (llama-server on
    # the head alone, or fallback_model, until the link has held fallback_hold_s), or
    # "keep" (say it, change nothing).
    watch_interval_s: float = Field(default=5.0, ge=0, le=3600)
    # rpc-server silent this long while a request waits is a FAIL (a large model's
    # prefill step can take seconds on a slow host: not shorter than that).
    watch_stall_s: float = Field(default=10.0, ge=0.5, le=3600)
    on_fail: Literal["stop", "fallback", "keep"] = "stop"
    fallback_model: str | None = None
    fallback_hold_s: float = Field(default=60.0, ge=0, le=86400)
    # The canary: verify's fixed prompts, greedy, compared with the fingerprint verify
    # recorded; after every start of llama-server and every canary_interval_s (0: only
    # after starts and on demand, `linkctl verify --canary`).
    canary_interval_s: float = Field(default=0.0, ge=0, le=86400)
    canary_tokens: int = Field(default=8, ge=1, le=24)
    # Prometheus textfile the watch rewrites every interval (node_exporter's collector).
    metrics_textfile: str | None = None

    @field_validator("api_key_file")
    @classmethod
    def _absolute_key_file(cls, v: str | None) -> str | None:
        if v is not None and not v.startswith("/"):
            raise ValueError("must be an absolute path (boot services do not run in your cwd)")
        return v

    @field_validator("split")
    @classmethod
    def _split(cls, v: str | None) -> str | None:
        if v is not None:
            parse_split_spec(v)
        return v


SPLIT_MODES = ("recommended", "llama")


def parse_split_spec(text: str) -> str | list[float]:
    """ "recommended", "llama", or a list of non-negative weights (not all zero);
    ValueError otherwise."""
    t = text.strip()
    if t in SPLIT_MODES:
        return t
    try:
        weights = [float(x) for x in t.replace("/", ",").split(",")]
    except ValueError:
        weights = []
    if not weights or any(w < 0 or w != w for w in weights) or not any(weights):
        raise ValueError(
            "not recommended, llama or comma-separated weights, not all zero "
            "(fix: write e.g. recommended, llama or 3,1)"
        )
    return weights


class ProbeSpec(_Strict):
    min_throughput_gbps: float = Field(default=8.0, gt=0)
    max_rtt_p99_us: float = Field(default=500.0, gt=0)
    # Seconds per iperf3 run (whole seconds; 4 runs: both ways, 1 and 4 streams).
    duration_s: float = Field(default=1.0, gt=0, le=60)
    latency_samples: int = Field(default=1000, ge=10)
    timeout_s: float = Field(default=3.0, gt=0, le=60)
    responder_port: Port = 50070
    iperf_port: Port = 5201


class Profile(_Strict):
    name: str = Field(pattern=PROFILE_NAME_PATTERN)
    description: str = ""
    link: LinkSpec
    hosts: list[HostSpec] = Field(min_length=2)
    serve: ServeSpec = ServeSpec()
    probe: ProbeSpec = ProbeSpec()

    @model_validator(mode="after")
    def _cross_checks(self) -> Profile:
        heads = [h.name for h in self.hosts if h.role == "head"]
        if len(heads) != 1:
            raise _FieldError(
                "hosts", [h.role for h in self.hosts], f"needs exactly one head, found {len(heads)}"
            )
        if not any(h.role == "rpc" for h in self.hosts):
            raise _FieldError("hosts", "role", "needs at least one rpc host")
        seen_names: set[str] = set()
        seen_addrs: dict[str, str] = {}
        net = self.link.subnet
        for i, h in enumerate(self.hosts):
            where = f"hosts[{i}]"
            if h.name in seen_names:
                raise _FieldError(f"{where}.name", h.name, "duplicate host name")
            seen_names.add(h.name)
            if h.address.network != net:
                raise _FieldError(
                    f"{where}.address", str(h.address), f"must be inside link.subnet {net}"
                )
            if h.address.ip in (net.network_address, net.broadcast_address):
                raise _FieldError(
                    f"{where}.address", str(h.address), "is the network or broadcast address"
                )
            if h.ip in seen_addrs:
                raise _FieldError(
                    f"{where}.address", h.ip, f"already used by host {seen_addrs[h.ip]}"
                )
            seen_addrs[h.ip] = h.name
            if h.rpc.bind is not None and h.rpc.bind != h.address.ip:
                what = "a wildcard" if h.rpc.bind.is_unspecified else "not this host's link address"
                raise _FieldError(
                    f"{where}.rpc.bind",
                    str(h.rpc.bind),
                    f"is {what}; rpc-server has no authentication and binds only to {h.ip}",
                )
        if self.serve.tensor_split and self.serve.split is not None:
            raise _FieldError(
                "serve.tensor_split",
                self.serve.tensor_split,
                "is set together with serve.split; keep one (serve.split takes llama.cpp "
                "device order)",
            )
        if self.serve.mode == "disaggregated":
            d = self.serve.disagg
            rpc_names = [h.name for h in self.hosts if h.role == "rpc"]
            if d.prefill_host is None and len(rpc_names) != 1:
                raise _FieldError(
                    "serve.disagg.prefill_host", None, f"name one of the rpc hosts: {rpc_names}"
                )
            if d.prefill_host is not None and d.prefill_host not in rpc_names:
                raise _FieldError(
                    "serve.disagg.prefill_host", d.prefill_host, f"is not an rpc host: {rpc_names}"
                )
            if d.decode_port == self.serve.port:
                raise _FieldError(
                    "serve.disagg.decode_port",
                    d.decode_port,
                    "is serve.port, where route listens; pick another port",
                )
            if d.prefill_port == d.agent_port:
                raise _FieldError(
                    "serve.disagg.agent_port", d.agent_port, "is serve.disagg.prefill_port"
                )
        if self.serve.tensor_split and len(self.serve.tensor_split) != len(self.hosts):
            raise _FieldError(
                "serve.tensor_split",
                self.serve.tensor_split,
                f"needs one weight per host ({len(self.hosts)})",
            )
        return self

    @property
    def head(self) -> HostSpec:
        return next(h for h in self.hosts if h.role == "head")

    @property
    def rpc_hosts(self) -> list[HostSpec]:
        return [h for h in self.hosts if h.role == "rpc"]

    @property
    def prefill_host(self) -> HostSpec:
        """The host that prefills in serve.mode = "disaggregated"."""
        name = self.serve.disagg.prefill_host or self.rpc_hosts[0].name
        return self.host(name)

    def host(self, name: str) -> HostSpec:
        for h in self.hosts:
            if h.name == name:
                return h
        raise InputError(
            f"--host {name!r} is not in profile {self.name!r}",
            f"use one of: {', '.join(h.name for h in self.hosts)}",
        )

    def peers_of(self, name: str) -> list[HostSpec]:
        return [h for h in self.hosts if h.name != name]

    def to_toml_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json", exclude_none=True)


class _FieldError(ValueError):
    """A cross-field error that knows which field it is about."""

    def __init__(self, field: str, value: Any, msg: str):
        self.field, self.value, self.msg = field, value, msg
        super().__init__(msg)


_FIXES = {
    "extra_forbidden": "remove it or check the spelling",
    "missing": "add it",
    "literal_error": None,
    "int_parsing": "write a whole number",
    "int_type": "write a whole number",
    "float_parsing": "write a number",
    "string_type": "write a quoted string",
    "list_type": "write a list",
}


def _format_error(err: ErrorDetails, source: str) -> tuple[str, str | None]:
    """(message, fix) for the first validation error."""
    ctx = err.get("ctx") or {}
    inner = ctx.get("error")
    if isinstance(inner, _FieldError):
        return f"{source}: {inner.field} = {inner.value!r}: {inner.msg}", None
    loc = ".".join(str(p) if not isinstance(p, int) else f"[{p}]" for p in err["loc"])
    loc = loc.replace(".[", "[")
    msg = err["msg"].removeprefix("Value error, ")
    fix = _FIXES.get(err["type"])
    value = err.get("input")
    shown = "" if err["type"] == "missing" else f" = {value!r}"
    return f"{source}: {loc or 'profile'}{shown}: {msg}", fix


def parse_profile(data: dict[str, Any], source: str = "profile") -> Profile:
    try:
        return Profile.model_validate(data)
    except ValidationError as e:
        # One line: the first error; the rest are usually consequences of it.
        raise InputError(*_format_error(e.errors()[0], source)) from None


def resolve_profile_path(name_or_path: str) -> Path:
    p = Path(name_or_path)
    if p.suffix == ".toml" or "/" in name_or_path:
        try:
            found = p.is_file()
        except OSError as e:  # a directory on the way this user may not search
            raise InputError(
                f"--profile {name_or_path!r}: cannot read it: {e.strerror}",
                "give a profile this user can read",
            ) from None
        if not found:
            raise InputError(f"--profile {name_or_path!r}: no such file", "give a path to a .toml")
        return p.absolute()
    dirs = profile_dirs()
    for d in dirs:
        cand = d / f"{name_or_path}.toml"
        if cand in profile_files([d]):
            return cand
    known = sorted({f.stem for f in profile_files(dirs)})
    raise InputError(
        f"--profile {name_or_path!r}: no such profile in {', '.join(map(str, dirs))}",
        f"use one of: {', '.join(known) or 'none found'}, or a path to a .toml file",
    )


def load_chosen(name_or_path: str | None) -> tuple[Profile, Path]:
    """The profile a command was given (--profile), else $LINKCTL_PROFILE, else the
    default, ``dgx-mac``."""
    import os

    return load_profile(name_or_path or os.environ.get("LINKCTL_PROFILE") or DEFAULT_PROFILE)


def announce(profile: Profile, path: Path, host: str | None = None) -> None:
    """A command's first progress line, on stderr: the profile and the file it came
    from (a copy in ~/.config/linkctl/profiles shadows the shipped one of the same
    name), and this host when the command acts as one."""
    from linkctl.core.log import write_line

    on = f", host {host}" if host else ""
    write_line(f"linkctl: profile {profile.name} from {path}{on}")


def load_profile(name_or_path: str) -> tuple[Profile, Path]:
    path = resolve_profile_path(name_or_path)
    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as e:
        raise InputError(f"{path}: not valid TOML: {e}", "fix the syntax at that line") from None
    except (OSError, UnicodeDecodeError) as e:
        raise InputError(f"{path}: cannot read: {e}") from None
    return parse_profile(data, str(path)), path
