"""The one typed llama.cpp invocation: what a llama-server or a ggml-rpc-server is asked
to run, as data. Every caller builds one and changes it field by field (serve's head and
rpc hosts, the two servers of disaggregated serving, verify's placements, calibrate's
servers; the boot units run `linkctl serve`, which builds it); argv is rendered once, at
the edge, by ``argv()``, and nothing reads an argv back.

A profile's ``extra_args`` meet the invocation in ``with_extra``: an option the
invocation owns is taken into its typed field (the last one wins, as in llama.cpp's
own parser, common/arg.cpp), and one that would undo a decision linkctl makes on
purpose (where the server listens, which rpc endpoints, which model, the API key, the
split) is refused with the profile field to set instead. What remains is passed on,
unread, after the typed options.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields, replace
from typing import Any

from linkctl.core.errors import InputError

# llama-server's defaults for the KV cache flags (`llama-server --help` at b11434).
DEFAULT_CACHE_TYPE = "f16"
DEFAULT_FLASH_ATTN = "auto"


@dataclass(frozen=True)
class FieldDiff:
    """One named difference between two records: ``field`` is ``a`` on one side, ``b``
    on the other."""

    field: str
    a: Any
    b: Any

    def text(self, a_name: str, b_name: str) -> str:
        return f"{self.field}: {a_name} {self.a}, {b_name} {self.b}"


def diff_fields(a: Any, b: Any, prefix: str = "") -> list[FieldDiff]:
    """The fields of two dataclass records of one type that differ, by name."""
    return [
        FieldDiff(prefix + f.name, getattr(a, f.name), getattr(b, f.name))
        for f in fields(a)
        if getattr(a, f.name) != getattr(b, f.name)
    ]


@dataclass(frozen=True)
class KvLayout:
    """The llama-server flags that change what a slot file holds. A state file records
    the cache's types and whether V is stored transposed (no flash attention), and
    llama.cpp refuses to restore one that differs (src/llama-kv-cache.cpp,
    state_read_meta/state_read_data); /props does not report them."""

    cache_type_k: str = DEFAULT_CACHE_TYPE
    cache_type_v: str = DEFAULT_CACHE_TYPE
    flash_attn: str = DEFAULT_FLASH_ATTN

    def as_dict(self) -> dict[str, str]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> KvLayout:
        return cls(**{f.name: str(d[f.name]) for f in fields(cls) if f.name in d})


@dataclass(frozen=True)
class ServerInvocation:
    """One llama-server. ``None`` for an option means: not passed (llama.cpp's default)."""

    binary: str
    model: str
    host: str = "127.0.0.1"
    port: int = 8080
    rpc: tuple[str, ...] = ()  # rpc endpoints host:port, in llama.cpp's device order
    ngl: int | None = None
    ctx: int | None = None
    slots: int | None = None  # -np
    # -ts weights in llama.cpp device order (RPC devices in --rpc order, then the local
    # GPU); with it -fit off: llama.cpp's automatic fitting (common/fit.cpp) may rewrite
    # the split and layer count when memory looks short, and skips its extra pass.
    tensor_split: tuple[float, ...] | None = None
    threads: int | None = None
    api_key_file: str | None = None
    slot_save_path: str | None = None
    cache_ram_mib: int | None = None  # --cache-ram (0: no prompt cache between requests)
    ubatch: int | None = None
    kv: KvLayout = KvLayout()
    devices: tuple[str, ...] = ()  # --device, e.g. RPC0
    verbosity: int | None = None  # -lv
    metrics: bool = False  # --metrics: /metrics, the counters serve's watch reads
    extra_args: tuple[str, ...] = ()

    def argv(self) -> list[str]:
        a = [self.binary, "-m", self.model]
        if self.rpc:
            a += ["--rpc", ",".join(self.rpc)]
        a += _opt("-ngl", self.ngl) + _opt("-c", self.ctx) + _opt("-np", self.slots)
        a += ["--host", self.host, "--port", str(self.port)]
        if self.tensor_split:
            a += ["-ts", split_text(self.tensor_split), "-fit", "off"]
        a += _opt("-t", self.threads) + _opt("--api-key-file", self.api_key_file)
        a += _opt("--slot-save-path", self.slot_save_path) + _opt("--cache-ram", self.cache_ram_mib)
        a += _opt("-ub", self.ubatch)
        kv = self.kv
        if kv.cache_type_k != DEFAULT_CACHE_TYPE:
            a += ["-ctk", kv.cache_type_k]
        if kv.cache_type_v != DEFAULT_CACHE_TYPE:
            a += ["-ctv", kv.cache_type_v]
        if kv.flash_attn != DEFAULT_FLASH_ATTN:
            a += ["-fa", kv.flash_attn]
        if self.devices:
            a += ["--device", ",".join(self.devices)]
        a += ["--metrics"] if self.metrics else []
        return a + _opt("-lv", self.verbosity) + list(self.extra_args)

    @property
    def base_url(self) -> str:
        host = "127.0.0.1" if self.host == "0.0.0.0" else self.host
        return f"http://{host}:{self.port}"

    def list_devices_argv(self) -> list[str]:
        """`llama-server --rpc ... --list-devices`: the devices this invocation would
        split over (common/arg.cpp common_print_available_devices), asking each
        rpc-server for its memory; loads no model."""
        return [self.binary, "--rpc", ",".join(self.rpc), "--list-devices"]

    def changed(self, **changes: Any) -> ServerInvocation:
        return replace(self, **changes)

    def with_extra(self, args: Sequence[str], where: str) -> ServerInvocation:
        """The invocation with a profile's extra arguments (``where``: the profile field)
        taken in: owned options into their fields, refused ones refused, the rest kept."""
        changes, rest = _take_owned(args, where, _SERVER_OWNED, _SERVER_REFUSED)
        kv = {
            k: changes.pop(k)
            for k in ("cache_type_k", "cache_type_v", "flash_attn")
            if k in changes
        }
        if kv:
            changes["kv"] = replace(self.kv, **kv)
        return replace(self, **changes, extra_args=(*self.extra_args, *rest))


@dataclass(frozen=True)
class RpcServerInvocation:
    """One ggml-rpc-server. It has no authentication: ``host`` is the link address,
    never a wildcard (linkctl.serve.plan checks the profile's bind)."""

    binary: str
    host: str
    port: int
    threads: int | None = None
    device: str | None = None  # -d
    cache: bool = False  # -c: the local tensor cache
    extra_args: tuple[str, ...] = ()

    def argv(self) -> list[str]:
        a = [self.binary, "-H", self.host, "-p", str(self.port)]
        a += _opt("-t", self.threads) + _opt("-d", self.device)
        return a + (["-c"] if self.cache else []) + list(self.extra_args)

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.port}"

    def with_extra(self, args: Sequence[str], where: str) -> RpcServerInvocation:
        changes, rest = _take_owned(args, where, _RPC_OWNED, _RPC_REFUSED)
        return replace(self, **changes, extra_args=(*self.extra_args, *rest))


def split_text(weights: Sequence[float]) -> str:
    """-ts as llama.cpp takes it: 3,1 (no trailing .0)."""
    return ",".join(f"{w:g}" for w in weights)


def _opt(flag: str, value: object) -> list[str]:
    return [] if value is None else [flag, str(value)]


# Options the invocation owns: flag -> (field, parser). From llama.cpp common/arg.cpp
# (llama-server) and tools/rpc/rpc-server.cpp (ggml-rpc-server), b11434.
_SERVER_OWNED: dict[str, tuple[str, type]] = {
    **dict.fromkeys(("-ngl", "--gpu-layers", "--n-gpu-layers"), ("ngl", int)),
    **dict.fromkeys(("-c", "--ctx-size"), ("ctx", int)),
    **dict.fromkeys(("-np", "--parallel"), ("slots", int)),
    **dict.fromkeys(("-t", "--threads"), ("threads", int)),
    **dict.fromkeys(("-ub", "--ubatch-size"), ("ubatch", int)),
    **dict.fromkeys(("-ctk", "--cache-type-k"), ("cache_type_k", str)),
    **dict.fromkeys(("-ctv", "--cache-type-v"), ("cache_type_v", str)),
    **dict.fromkeys(("-fa", "--flash-attn"), ("flash_attn", str)),
    **dict.fromkeys(("-lv", "--verbosity", "--log-verbosity"), ("verbosity", int)),
    **dict.fromkeys(("-cram", "--cache-ram"), ("cache_ram_mib", int)),
    **dict.fromkeys(("-dev", "--device"), ("devices", tuple)),
}
_SERVER_REFUSED = {
    **dict.fromkeys(("--host", "--port"), "serve.host and serve.port"),
    **dict.fromkeys(("-m", "--model"), "serve.model"),
    "--rpc": "the profile's rpc hosts",
    **dict.fromkeys(("--api-key", "--api-key-file"), "serve.api_key_file"),
    **dict.fromkeys(("-ts", "--tensor-split"), "serve.split"),
    "--slot-save-path": "nothing (serve sets it in disaggregated mode)",
}
_RPC_OWNED: dict[str, tuple[str, type]] = {
    **dict.fromkeys(("-t", "--threads"), ("threads", int)),
    **dict.fromkeys(("-d", "--device"), ("device", str)),
}
# rpc-server has no authentication: where it listens is the profile's, never an argument's.
_RPC_REFUSED = {
    **dict.fromkeys(("-H", "--host"), "hosts[].rpc.bind (the link address only)"),
    **dict.fromkeys(("-p", "--port"), "hosts[].rpc.port"),
}


def _take_owned(
    args: Sequence[str],
    where: str,
    owned: dict[str, tuple[str, type]],
    refused: dict[str, str],
) -> tuple[dict[str, Any], list[str]]:
    changes: dict[str, Any] = {}
    rest: list[str] = []
    it = iter(args)
    for a in it:
        flag, eq, inline = a.partition("=")
        if flag in refused:
            raise InputError(
                f"{where} = {list(args)!r} sets {flag}, which linkctl decides",
                f"remove it; set {refused[flag]} instead",
            )
        if flag not in owned:
            rest.append(a)
            continue
        name, kind = owned[flag]
        value = inline if eq else next(it, None)
        # -fa was a bare switch in older builds and takes on|off|auto now: an option read
        # as its value would silently swallow that option.
        if value is None or (value.startswith("-") and not value[1:].isdigit()):
            raise InputError(
                f"{where} = {list(args)!r}: {flag} needs a value", f"give {flag} VALUE"
            )
        try:
            changes[name] = tuple(value.split(",")) if kind is tuple else kind(value)
        except ValueError:
            what = "a whole number" if kind is int else f"a {kind.__name__}"
            raise InputError(
                f"{where} = {list(args)!r}: {flag} {value!r} is not {what}",
                f"give {flag} {what}",
            ) from None
    return changes, rest
