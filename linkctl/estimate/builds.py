"""Which llama.cpp builds the catalog's terms describe, and whether this host's build
is far from them: kernels change between builds (the M2 Ultra's current-build rows run
19-26 % faster prompts than its Nov 2025 ones), so terms fitted on one build describe
another only roughly.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING

from linkctl.estimate.notes import Note, NoteKind

if TYPE_CHECKING:
    from linkctl.estimate.cost import Participant

# Builds apart that count as far: about three months at the 2025-26 pace, b6918 on
# 2025-11-02 (llama.cpp benches/dgx-spark.md) to b7948 on 2026-02-05 (benches/mac-m2-ultra
# /mac-m2-ultra.md): 1030 builds in 95 days.
BUILD_FAR = 1000

_NUMBERED = (
    re.compile(r"\((\d{3,6})\)"),  # "2f68ce7cf (6918)", llama-bench's build column
    re.compile(r"\bb(\d{3,6})\b"),  # "b7948", a release tag
    re.compile(r"^version: (\d{3,6}) \("),  # llama-server --version
    re.compile(r"\(build (\d{3,6}),"),  # "version: 0.6.0-dev (build 11434, commit ...)"
)


def build_numbers(text: str) -> list[int]:
    """The build numbers a build text names (none for a bare commit or a PR head)."""
    out = {int(m) for rx in _NUMBERED for m in rx.findall(text)}
    return sorted(n for n in out if n > 0)


def local_build() -> tuple[int, str] | None:
    """This host's llama.cpp build number, and where it was read: llama-server
    --version, or, for a build of scripts/build-llama.sh from the PyPI source (whose
    --version says "build 0"), the version its cache directory is named by
    (<cache>/llama.cpp/<build>.0.0/bin). None: no llama-server found, or no number."""
    from linkctl.llama.bins import find_bins

    b = find_bins(versions=True).llama_server
    if b is None:
        return None
    got = build_numbers(b.version or "")
    if got:
        return got[0], f"{b.path} --version"
    m = re.search(r"/llama\.cpp/(\d{3,6})\.\d+\.\d+/bin/", str(Path(b.path)))
    return (int(m.group(1)), f"{b.path} (the build cache's version)") if m else None


def far_notes(parts: list[Participant], local: tuple[int, str] | None) -> list[Note]:
    """A note for each host on catalog terms fitted on builds far from this host's."""
    if local is None:
        return []
    n, where = local
    notes = []
    for p in parts:
        d = p.device
        if d.calibrated or not d.build_numbers:
            continue
        gap = min(abs(n - b) for b in d.build_numbers)
        if gap > BUILD_FAR:
            built = ", ".join(f"b{b}" for b in d.build_numbers)
            notes.append(
                Note(
                    NoteKind.CALIBRATION,
                    f"{p.host}: the catalog's {d.key} terms describe llama.cpp {built}; the "
                    f"pair runs b{n} (one version on both ends; read from {where}), {gap} "
                    "builds apart: kernels change between builds; `linkctl calibrate` on "
                    "that host measures this one",
                )
            )
    return notes
