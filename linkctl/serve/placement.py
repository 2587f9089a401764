"""Where verify puts the model's layers: the reference placement against the split serve
runs, and the tolerance the backends allow.

    reference  the head alone, when the model fits it (estimate's memory model, or
               --reference head); else another split of the same model: the same
               devices with the layers placed differently (a different -ts over the
               split devices, or a different -ngl when the head has no split device).
               Both compute the same function, so a device or a transfer that
               computes wrong makes the two disagree.
    split      exactly the llama-server placement `linkctl serve` runs (the head's
               invocation: --rpc, -ngl, -ts, threads, extra args), with a small context.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from linkctl.core.errors import InputError
from linkctl.core.profile import Profile
from linkctl.llama.invocation import ServerInvocation
from linkctl.serve.logprobs import TOLERANCES, Tolerance

CTX = 512  # both placements; the prompts and their continuations fit easily


# The ggml backend llama.cpp computes on for each catalog device family.
BACKEND_OF_FAMILY = {"apple": "metal", "nvidia": "cuda", "cpu": "cpu"}


@dataclass
class Placement:
    role: str  # "reference" or "split"
    kind: str  # "head alone" or "split"
    invocation: ServerInvocation  # on 127.0.0.1, a port free when the plan was made
    hosts: list[str]  # profile hosts whose devices compute in it
    assignment: str  # where the layers are, as llama.cpp places them
    buffers_mib: dict[str, float] = field(default_factory=dict)  # from llama-server's log

    def as_dict(self) -> dict[str, Any]:
        return {
            "role": self.role,
            "kind": self.kind,
            "argv": self.invocation.argv(),
            "hosts": self.hosts,
            "assignment": self.assignment,
            "buffers_mib": self.buffers_mib,
        }


def model_buffers(log: str) -> dict[str, float]:
    """'load_tensors: RPC0[198.18.100.2:50052] model buffer size = 1.5 MiB' lines of
    llama-server's log (src/llama-model.cpp): where the weights really went."""
    out: dict[str, float] = {}
    for m in re.finditer(r"load_tensors:\s+(\S+) model buffer size =\s*([\d.]+) MiB", log):
        out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(2))
    return out


def _describe(slots: list[int | None], names: list[str]) -> str:
    """'slots 0-2 on CPU (head), 3-6 on RPC0' from per-slot device indices."""
    runs: list[tuple[str, int, int]] = []
    for i, d in enumerate(slots):
        name = "head CPU" if d is None else names[d]
        if runs and runs[-1][0] == name and runs[-1][2] == i - 1:
            runs[-1] = (name, runs[-1][1], i)
        else:
            runs.append((name, i, i))
    last = len(slots) - 1
    parts = [f"{a}-{b}" if a != b else f"{a}" for _, a, b in runs]
    return (
        ", ".join(f"slots {p} on {n}" for p, (n, _, _) in zip(parts, runs, strict=True))
        + f" (slot {last} = output layer)"
    )


@dataclass
class Device:
    name: str  # llama.cpp device name, e.g. RPC0, Metal
    description: str
    free_mib: int


def parse_list_devices(text: str) -> list[Device]:
    """``llama-server --list-devices`` (common/arg.cpp common_print_available_devices):
    '  NAME: DESCRIPTION (TOTAL MiB, FREE MiB free)' per non-CPU device, in llama.cpp's
    device order."""
    out = []
    for line in text.splitlines():
        m = re.match(r"^\s+(\S+): (.*) \((\d+) MiB, (\d+) MiB free\)\s*$", line)
        if m:
            out.append(Device(m.group(1), m.group(2), int(m.group(4))))
    return out


def another_split(
    split: ServerInvocation, n_layer: int, devices: list[Device]
) -> tuple[ServerInvocation, str, str]:
    """The reference for a model that does not fit the head: the same devices, the
    layers elsewhere. Returns (reference, reference assignment, split assignment)."""
    from linkctl.estimate.layers import llama_slot_devices

    ngl = 99 if split.ngl is None else split.ngl  # llama-server's default: every layer
    names = [d.name for d in devices]
    if not devices:
        raise InputError(
            "llama-server --list-devices shows no split device with the profile's --rpc",
            "check that every rpc host runs `linkctl serve`",
        )
    ts = split.tensor_split
    weights = list(ts) if ts else [float(d.free_mib) for d in devices]
    weights = (weights + [0.0] * len(devices))[: len(devices)]
    split_slots = llama_slot_devices(n_layer, weights, ngl)
    if all(s is None for s in split_slots):
        raise InputError(
            f"-ngl {ngl} puts no layer on a split device: the split is the head alone",
            "set serve.ngl > 0",
        )
    total = n_layer + 1
    if len(devices) == 1:
        # One split device and the head's CPU: move the boundary by changing -ngl.
        act = sum(s is not None for s in split_slots)
        ref_ngl = act - max(1, act // 2) if act > 1 else act + max(1, (total - act) // 2)
        ref_slots = llama_slot_devices(n_layer, weights, ref_ngl)
        ref_inv = split.changed(ngl=ref_ngl)
    else:
        counts = [sum(s == i for s in split_slots) for i in range(len(devices))]
        big = max(range(len(counts)), key=lambda i: counts[i])
        move = max(1, counts[big] // 2)
        ref = list(counts)
        ref[big] -= move
        ref[(big + 1) % len(ref)] += move
        ref_slots = llama_slot_devices(n_layer, [float(c) for c in ref], ngl)
        ref_inv = split.changed(tensor_split=tuple(float(c) for c in ref))
    if ref_slots == split_slots:
        raise InputError(
            "could not find another placement of the model's layers to compare against",
            "pass --reference head if the model fits the head",
        )
    return ref_inv, _describe(ref_slots, names), _describe(split_slots, names)


def head_fits(prof: Profile, model_path: str) -> tuple[bool, str]:
    """Does the model fit the head alone, by estimate's memory model (weights + KV at
    CTX + llama.cpp's buffers, against the profile's memory_gb x usable fraction)?"""
    from linkctl.estimate.cost import GIB, scenario
    from linkctl.estimate.layers import llama_slot_devices
    from linkctl.estimate.run import participants
    from linkctl.gguf.info import read_model

    model = read_model(model_path)
    parts, _notes = participants(prof)
    head = next(p for p in parts if p.role == "head")
    n = model.block_count
    slots: list[int | None] = (
        llama_slot_devices(n, [1.0], prof.serve.ngl)
        if head.device.kind == "gpu"
        else [None] * (n + 1)
    )
    sc = scenario("local", model, [head], slots, CTX, None)
    need = sc.devices[0].need_bytes
    return sc.fits, (
        f"needs {need / GIB:.2f} GiB at ctx {CTX}, the head holds {head.free_bytes / GIB:.2f} GiB "
        f"({head.free_source})"
    )


def backend_class(prof: Profile, hosts: list[str], choice: str) -> tuple[Tolerance, str]:
    if choice != "auto":
        return TOLERANCES[choice], f"--backends {choice}"
    from linkctl.estimate.catalog import load_catalog

    cat = load_catalog()
    kinds = {}
    for name in hosts:
        dev = prof.host(name).device
        kinds[name] = BACKEND_OF_FAMILY.get(cat[dev].family) if dev in cat else None
    if None not in kinds.values() and len(set(kinds.values())) == 1:
        return TOLERANCES["same"], f"every host computes on {next(iter(kinds.values()))}"
    shown = ", ".join(f"{h}: {k or 'unknown'}" for h, k in kinds.items())
    return TOLERANCES["mixed"], f"backends differ or are unknown ({shown})"


def predicted_devices(prof: Profile) -> list[Device]:
    """The split devices as the profile describes them (for --dry-run, which contacts
    nothing): each rpc host's device, then the head's when the catalog calls it a GPU."""
    from linkctl.estimate.catalog import load_catalog

    cat = load_catalog()
    out = [Device(f"RPC{i}", h.rpc_endpoint, 1) for i, h in enumerate(prof.rpc_hosts)]
    dev = cat.get(prof.head.device or "")
    if dev is not None and dev.kind == "gpu":
        out.append(Device(BACKEND_OF_FAMILY.get(dev.family, "GPU").capitalize(), dev.name, 1))
    return out
