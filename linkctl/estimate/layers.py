"""llama.cpp's layer assignment (llama-model.cpp load_tensors): the split devices are
the RPC servers first (in --rpc order), then the head's local GPU; the n_layer blocks
plus the output layer are dealt out in proportion to each device's free memory (or
--split weights), with llama.cpp's float32 split points; a CPU-only head takes
no layers (only the input embeddings, which stay on the CPU).
"""

from __future__ import annotations

import struct
from typing import Protocol, TypeVar

from linkctl.core.errors import InputError
from linkctl.estimate.catalog import Device


def _f32(x: float) -> float:
    """x rounded to float32: llama.cpp computes the split points in float."""
    return struct.unpack("f", struct.pack("f", x))[0]


def llama_slot_devices(n_layer: int, weights: list[float], ngl: int = 99) -> list[int | None]:
    """Device index (None = CPU) of each slot 0..n_layer (slot n_layer = output layer),
    as llama.cpp's load_tensors computes it (float32 cumulative split points)."""
    n = len(weights)
    if n == 0 or ngl <= 0:
        return [None] * (n_layer + 1)
    splits, acc = [], _f32(0.0)
    for w in weights:
        acc = _f32(acc + _f32(w))
        splits.append(acc)
    if acc <= 0:
        raise InputError("--split weights are all zero", "give at least one weight > 0")
    splits = [_f32(s / acc) for s in splits]
    i_gpu_start = max(n_layer + 1 - ngl, 0)
    act = min(ngl, n_layer + 1)
    out: list[int | None] = []
    for il in range(n_layer + 1):
        if il < i_gpu_start or il - i_gpu_start >= act:
            out.append(None)
            continue
        x = _f32((il - i_gpu_start) / act)
        idx = next((i for i, s in enumerate(splits) if s > x), n - 1)  # upper_bound
        out.append(idx)
    return out


def slots_from_counts(counts: list[int]) -> list[int | None]:
    """The slots dealt out in order: counts[i] consecutive slots to split device i."""
    return [i for i, c in enumerate(counts) for _ in range(c)]


class SplitMember(Protocol):
    """What the split order reads of a participant (linkctl.estimate.cost.Participant)."""

    @property
    def role(self) -> str: ...

    @property
    def device(self) -> Device: ...


M = TypeVar("M", bound=SplitMember)


def split_devices(parts: list[M]) -> list[M]:
    """llama.cpp's split device order: RPC servers first, then the head's GPU."""
    rpc = [p for p in parts if p.role == "rpc"]
    head = [p for p in parts if p.role == "head" and p.device.kind == "gpu"]
    return rpc + head
