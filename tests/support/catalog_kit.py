"""A catalog device with chosen terms, for estimate tests."""

from __future__ import annotations

from linkctl.estimate.catalog import DecodeTerms, Device, PrefillTerms


def dev(
    key: str, bw_gbs: float, kind: str = "gpu", tflops: float = 10.0, layer_us: float = 0.0
) -> Device:
    return Device(
        key=key,
        name=key,
        kind=kind,
        family="cpu",
        memory_gb=1,
        mem_bandwidth_gbs=bw_gbs,
        fp16_tflops=tflops,
        usable_fraction=1.0,
        efficiency=1.0,
        compute_efficiency=1.0,
        decode=DecodeTerms(layer_us, 0.0, bw_gbs, bw_gbs, bw_gbs),
        prefill=PrefillTerms(0.0, 0.0, tflops, tflops, tflops, tflops),
    )
