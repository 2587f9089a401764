"""linkctl.host: what `pair` announces of this machine. Linux for real (this machine's
/proc/meminfo, no nvidia-smi here) and on a DGX Spark's recorded nvidia-smi output
(tests/fixtures/linux/SOURCES.md); macOS in tests/pair/test_pair_macos.py."""

from __future__ import annotations

import shutil
from dataclasses import dataclass, field
from pathlib import Path

from linkctl.core.runner import Result, Runner
from linkctl.host import linux, machine_facts
from support.paths import FIXTURES

GB10 = "nvidia-smi-query-gpu-name-compute_cap-memory.total-format-csv-noheader-gb10-asus-gx10.txt"


def test_this_linux_machine():
    m = machine_facts("linux")
    text = Path("/proc/meminfo").read_text()
    total_kib = int(next(ln for ln in text.splitlines() if ln.startswith("MemTotal:")).split()[1])
    assert m.os == "linux" and m.memory_gb == round(total_kib / 2**20, 1) > 0
    if shutil.which("nvidia-smi") is None:
        assert m.accelerator == "" and m.usable_gb == m.memory_gb


@dataclass
class OneAnswer(Runner):
    """nvidia-smi answering as a DGX Spark did (the recorded output)."""

    stdout: str = ""
    seen: list[tuple[str, ...]] = field(default_factory=list)

    def which(self, name: str) -> str | None:
        return "/usr/bin/nvidia-smi" if name == "nvidia-smi" else None

    def run(self, argv, **_kw) -> Result:  # type: ignore[override]
        self.seen.append(tuple(argv))
        return Result(tuple(argv), 0, self.stdout, "")


def test_a_dgx_spark_is_a_gb10_with_unified_memory(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text(Path("/proc/meminfo").read_text())
    r = OneAnswer(stdout=(FIXTURES / "linux" / GB10).read_text())
    m = linux.facts(r, "spark", meminfo)
    assert r.seen == [tuple(linux.NVIDIA_SMI)]
    assert m.accelerator == "NVIDIA GB10" and m.accelerator_memory_gb is None
    assert m.usable_gb == m.memory_gb  # unified: the system's memory is the GPU's
    assert linux.parse_nvidia_smi("NVIDIA GB10, 12.1, [N/A]") == ("NVIDIA GB10", None)
