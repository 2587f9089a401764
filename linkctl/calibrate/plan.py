"""`linkctl calibrate`, stage 1 of 3: the plan, which is what `--dry-run` prints.

Which host and device, which models (given ones, and the generated ones that make
the two-term solve possible, see linkctl.calibrate.solve), how many timed runs of how many
tokens, threads, the CPU quota the measurement will run under, the exact llama.cpp
commands, and where the result will be stored. Making the plan reads model headers
and the existing calibration file and picks free ports; it writes nothing.
calibrate_measure.measure runs it; calibrate.record turns the figures into the record.
"""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path
from typing import Any, Generic, TypeVar

from pydantic import BaseModel, Field, computed_field

from linkctl.core.errors import InputError
from linkctl.core.profile import Profile
from linkctl.core.runner import Runner
from linkctl.gguf.tiny import TinySpec
from linkctl.llama.invocation import RpcServerInvocation, ServerInvocation

# Generated models for the two-term solve: many thin blocks against few wide ones, so
# the per-block cost and the bandwidth weigh differently in their per-token times.
# The small pair (60-110 MB) is larger than a CPU's last-level cache; the large pair
# (0.6-1.6 GB) is past the tens of MB of a GPU's L2 or an Apple chip's system cache,
# so the bandwidth measured is the memory's (see extra_models for which).
GENERATED = {
    "cpu": (
        TinySpec(n_layer=24, n_embd=256, n_head=4, n_ff=512),
        TinySpec(n_layer=2, n_embd=1024, n_head=8, n_ff=2816),
    ),
    "gpu": (
        TinySpec(n_layer=48, n_embd=512, n_head=8, n_ff=1536),
        TinySpec(n_layer=2, n_embd=4096, n_head=32, n_ff=11008),
    ),
}
MAX_CONTEXT = 2048


class PlannedModel(BaseModel):
    path: str
    # A generated model: its shape, and whether measure writes it (False: already there).
    spec: TinySpec | None = None
    to_write: bool = False
    # A given model read mostly quantized: timed for its types' rate (reads_quantized).
    quantized: bool = False

    @property
    def generated(self) -> bool:
        return self.spec is not None


Inv = TypeVar("Inv", ServerInvocation, RpcServerInvocation)


class Server(BaseModel, Generic[Inv]):
    """One server calibrate starts, and where its log goes."""

    invocation: Inv = Field(exclude=True)
    log: str

    @computed_field  # type: ignore[prop-decorator]
    @property
    def argv(self) -> list[str]:
        return self.invocation.argv()

    @computed_field  # type: ignore[prop-decorator]
    @property
    def port(self) -> int:
        return self.invocation.port


class CpuQuota(BaseModel):
    cpus: float | None  # the quota as a share of CPUs (0.5: half of one CPU); None: no limit
    source: str  # which cgroup file says so


class CalibrationPlan(BaseModel):
    host: str
    device: str  # catalog key
    device_kind: str
    models: list[PlannedModel]
    tokens: int
    runs: int
    threads: int | None  # None: llama.cpp's default
    rpc: bool
    context: int
    prompt_tokens: int
    cpu_quota: CpuQuota | None  # None: not readable here (unknown, not unlimited)
    servers: list[Server[ServerInvocation]]  # one llama-server per model, all up at once
    # --rpc: ggml-rpc-server, then a llama-server using it
    rpc_server: Server[RpcServerInvocation] | None = None
    rpc_head: Server[ServerInvocation] | None = None
    llama_server: str
    build: str | None = None  # llama-server --version: what the record says it measured
    workdir: str  # generated models and the servers' logs
    saves_to: str
    catalog_layer_us: float
    catalog_effective_bandwidth_gbs: float

    @property
    def commands(self) -> list[list[str]]:
        later = [s.argv for s in (self.rpc_server, self.rpc_head) if s]
        return [s.argv for s in self.servers] + later

    def as_json(self) -> dict[str, Any]:
        """What `--dry-run --json` prints: the plan, with the commands first as before."""
        return {
            "host": self.host,
            "dry_run": True,
            "commands": self.commands,
            **self.model_dump(mode="json", exclude={"host"}),
        }


def _blocks_per_byte(model) -> float:
    return model.block_count / max(1, sum(model.layer_active_bytes()))


def _spec_blocks_per_byte(spec: TinySpec) -> float:
    """Blocks per byte of a generated model (F32: 4 x (4 e^2 + 3 e ff) bytes a block)."""
    e, ff = spec.n_embd, spec.n_ff
    return 1.0 / (4 * (4 * e * e + 3 * e * ff))


def extra_models(given: list, kind: str = "cpu") -> tuple[TinySpec, ...]:
    """The generated models to add to the given ones (ModelInfo) so that there are two
    of different shape: with one given model, the generated model whose blocks-per-byte
    differs most from it, of the given model's size class (so both sit past the same
    caches); without one, the pair for the device kind."""
    if len(given) >= 2:
        return ()
    if not given:
        return GENERATED.get(kind, GENERATED["cpu"])
    m = given[0]
    pair = GENERATED["gpu" if m.total_bytes > 300e6 else "cpu"]
    r = math.log(_blocks_per_byte(m))
    return (max(pair, key=lambda spec: abs(math.log(_spec_blocks_per_byte(spec)) - r)),)


# A given model whose quantized weights are at least this share of the bytes it reads per
# token is timed for its types' read rate, not for the two-term solve (linkctl.calibrate.
# solve): the solve's one bandwidth is the F32 one.
QUANTIZED_SHARE = 0.2


def reads_quantized(model) -> bool:
    """Whether a model (ModelInfo) reads mostly quantized weights per token."""
    from linkctl.estimate.features import decode_features

    f = decode_features(model, list(range(model.block_count)), True, 0.0)
    return f[2] >= QUANTIZED_SHARE * (f[2] + f[3]) > 0


def generated_path(workdir: Path, spec: TinySpec) -> Path:
    return workdir / f"tiny-{spec.n_layer}L-{spec.n_embd}d.gguf"


def cpu_quota() -> CpuQuota | None:
    """The tightest CPU quota on this process's cgroup or a parent of it (cgroup v2
    ``cpu.max``, v1 ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us``; kernel
    Documentation/admin-guide/cgroup-v2.rst and scheduler/sched-bwc.rst), which the
    servers started here inherit. None when no such file is readable here: unknown,
    not unlimited (macOS; inside `ip netns exec`, whose own /sys lacks the cgroup tree)."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    found: list[CpuQuota] = []
    for line in lines:
        _, controllers, rel = line.split(":", 2)
        if controllers == "":
            roots, v2 = [Path("/sys/fs/cgroup"), Path("/sys/fs/cgroup/unified")], True
        elif "cpu" in controllers.split(","):
            roots, v2 = [Path("/sys/fs/cgroup") / controllers, Path("/sys/fs/cgroup/cpu")], False
        else:
            continue
        for root in roots:
            d = root / rel.lstrip("/")
            while d.is_relative_to(root):
                q = _quota_of(d, v2)
                if q:
                    found.append(q)
                if d == root:
                    break
                d = d.parent
    limited = [q for q in found if q.cpus is not None]
    return min(limited, key=lambda q: q.cpus or 0) if limited else next(iter(found), None)


def _quota_of(d: Path, v2: bool) -> CpuQuota | None:
    try:
        if v2:
            f = d / "cpu.max"
            quota, period = f.read_text().split()
        else:
            f = d / "cpu.cfs_quota_us"
            quota, period = f.read_text().strip(), (d / "cpu.cfs_period_us").read_text().strip()
    except (OSError, ValueError):
        return None
    cpus = None if quota in ("max", "-1") else int(quota) / int(period)
    return CpuQuota(cpus=cpus, source=f"{f}: {quota} / {period} us")


def plan(
    prof: Profile,
    model_paths: list[Path] | None = None,
    *,
    host: str | None,
    tokens: int = 64,
    runs: int = 5,
    threads: int | None = None,
    rpc: bool = False,
    bin_dir: str | None = None,
    runner: Runner | None = None,
) -> CalibrationPlan:
    from linkctl.core.paths import state_dir
    from linkctl.core.records import calibration_path, kept_calibrations
    from linkctl.estimate.catalog import get_device, load_catalog
    from linkctl.gguf.info import read_model
    from linkctl.llama.bins import find_bins, free_port, server_version

    if tokens < 8 or runs < 1:
        raise InputError(
            f"--tokens {tokens} --runs {runs}: need tokens >= 8 and runs >= 1",
            "e.g. --tokens 64 --runs 3",
        )
    # Before anything is measured: a run that would end refusing to store its result
    # (records.save_calibration) must not start.
    kept_calibrations()
    if host is None:
        from linkctl.net.backend import get_backend
        from linkctl.net.link import identify_host

        host = identify_host(prof, get_backend(), None).name
    h = prof.host(host)
    dev = get_device(load_catalog(), h.device, f"host {h.name}")
    given = [(Path(mp), read_model(mp)) for mp in model_paths or []]
    for mp, info in given:
        if not info.data_present:
            raise InputError(
                f"{mp}: header only, tensor data absent", "calibrate needs a real model file"
            )
    bins = find_bins(bin_dir or h.llama_bin_dir, runner, versions=False)
    if bins.llama_server is None or (rpc and bins.rpc_server is None):
        raise InputError(
            f"llama.cpp binaries not found (tried {', '.join(bins.tried)})",
            "run scripts/build-llama.sh or pass --llama-bin-dir DIR",
        )
    workdir = state_dir() / "calibrate"
    # Quantized given models are timed for their types' rates; the two-term solve takes
    # the unquantized ones, and generated F32 models until there are two.
    plain = [info for _, info in given if not reads_quantized(info)]
    specs = extra_models(plain, dev.kind)
    models = [PlannedModel(path=str(mp), quantized=reads_quantized(i)) for mp, i in given] + [
        PlannedModel(
            path=str(generated_path(workdir, s)),
            spec=s,
            to_write=not generated_path(workdir, s).is_file(),
        )
        for s in specs
    ]
    ctx = min(
        [min(MAX_CONTEXT, info.context_length or MAX_CONTEXT) for _, info in given]
        + [min(MAX_CONTEXT, s.n_ctx) for s in specs]
    )
    if ctx - tokens - 16 < 16:
        raise InputError(
            f"--tokens {tokens} does not fit the model's context {ctx}", "use fewer --tokens"
        )

    server = bins.llama_server.path

    def on_loopback(model: str, log: str, **more: Any) -> Server[ServerInvocation]:
        inv = ServerInvocation(
            server, model, "127.0.0.1", free_port(), ngl=99, ctx=ctx, slots=1, threads=threads
        )
        return Server[ServerInvocation](invocation=replace(inv, **more), log=log)

    servers = [
        on_loopback(m.path, str(workdir / f"llama-server-{i}.log")) for i, m in enumerate(models)
    ]
    rpc_server = rpc_head = None
    if rpc and bins.rpc_server:
        rs = RpcServerInvocation(bins.rpc_server.path, "127.0.0.1", free_port(), threads=threads)
        rpc_server = Server[RpcServerInvocation](invocation=rs, log=str(workdir / "rpc-server.log"))
        # All layers on the RPC device: a GPU build would otherwise keep them local. The
        # device is named RPC0 (`llama-server --rpc H:P --list-devices` at b11434:
        # "RPC0: 127.0.0.1:50999"); "RPC0[H:P]" is its buffer's name, which --device
        # refuses ("invalid device").
        rpc_head = on_loopback(
            models[0].path,
            str(workdir / "llama-server-rpc.log"),
            rpc=(rs.endpoint,),
            devices=("RPC0",) if dev.kind == "gpu" else (),
        )
    return CalibrationPlan(
        host=h.name,
        device=dev.key,
        device_kind=dev.kind,
        models=models,
        tokens=tokens,
        runs=runs,
        threads=threads,
        rpc=rpc,
        context=ctx,
        prompt_tokens=max(16, min(256, ctx - tokens - 16)),
        cpu_quota=cpu_quota(),
        servers=servers,
        rpc_server=rpc_server,
        rpc_head=rpc_head,
        llama_server=server,
        build=server_version(server, runner),
        workdir=str(workdir),
        saves_to=str(calibration_path()),
        catalog_layer_us=dev.decode.layer_us,
        catalog_effective_bandwidth_gbs=dev.decode.bw_gbs,
    )


def render_plan(p: CalibrationPlan) -> None:
    """The plan as comment lines, then the commands exactly as they will run."""
    from rich.markup import escape

    from linkctl.core.output import console

    threads = p.threads or "llama.cpp's default"
    q = p.cpu_quota
    quota = "unknown (no cgroup cpu files readable here)"
    if q:
        quota = f"{f'{q.cpus:.2f} CPU' if q.cpus else 'none'} ({q.source})"
    lines = [
        f"calibrate {p.host} ({p.device}, {p.device_kind}): {len(p.models)} models, "
        f"{p.runs} timed runs x {p.tokens} tokens each, prompt {p.prompt_tokens} tokens, "
        f"context {p.context}, threads {threads}, CPU quota {quota}"
        + (", then the first model behind a loopback ggml-rpc-server" if p.rpc else ""),
    ]
    for m in p.models:
        if m.spec:
            what = "write" if m.to_write else "reuse"
            lines.append(
                f"  {m.path}: generated ({what}), {m.spec.n_layer} blocks x "
                f"{m.spec.n_embd} wide, {m.spec.wtype}"
            )
        else:
            why = " (quantized: timed for its weight types' read rate)" if m.quantized else ""
            lines.append(f"  {m.path}: given{why}")
    lines.append(f"result to {p.saves_to} (host {p.host}), logs in {p.workdir}")
    for line in lines:
        console.print(escape(f"# {line}"))
    for argv in p.commands:
        console.print(escape(" ".join(argv)))
