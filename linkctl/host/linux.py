"""Linux: system memory from /proc/meminfo, an NVIDIA accelerator from nvidia-smi."""

from __future__ import annotations

from pathlib import Path

from linkctl.core.runner import Runner
from linkctl.host.facts import MachineFacts

# The query DGX Spark owners post (tests/fixtures/linux/SOURCES.md): name, compute
# capability, memory with its unit ("24564 MiB"), "[N/A]" on GB10's unified memory.
NVIDIA_SMI = ["nvidia-smi", "--query-gpu=name,compute_cap,memory.total", "--format=csv,noheader"]


def parse_meminfo(text: str) -> float:
    """MemTotal in GiB (a "128 GB" machine's memory_gb is 128), from /proc/meminfo."""
    for line in text.splitlines():
        if line.startswith("MemTotal:"):
            return round(int(line.split()[1]) / 2**20, 1)
    raise ValueError("no MemTotal line in /proc/meminfo")


def parse_nvidia_smi(text: str) -> tuple[str, float | None]:
    """The first GPU's name and memory in GiB (None where the driver prints "[N/A]" or
    "[Not Supported]")."""
    line = next((ln for ln in text.splitlines() if ln.strip()), "")
    fields = [f.strip() for f in line.split(",")]
    name, mem = fields[0], fields[-1] if len(fields) > 1 else ""
    number, _, unit = mem.partition(" ")
    try:
        gb: float | None = round(float(number) / 1024, 1) if unit == "MiB" else None
    except ValueError:
        gb = None
    return name, gb


def facts(runner: Runner, hostname: str, meminfo: Path = Path("/proc/meminfo")) -> MachineFacts:
    memory = parse_meminfo(meminfo.read_text())
    name, gpu_gb = "", None
    if runner.which("nvidia-smi"):
        r = runner.run(NVIDIA_SMI, check=False, timeout=20)
        if r.ok:
            name, gpu_gb = parse_nvidia_smi(r.stdout)
    # GB10 is unified (the GPU's share is the system's): its GPU memory line is not apart.
    unified = gpu_gb is None or gpu_gb >= 0.9 * memory
    return MachineFacts(hostname, "linux", name, memory, None if unified else gpu_gb)
