"""What the two servers of disaggregated serving must share to pass a slot between
them: the same model file and the same KV cache layout. One typed record per side,
compared as a whole, each difference named.

The file's identity is cheap on purpose: its size and the SHA-256 of its first and last
16 MiB (the GGUF header and both ends of the tensor data); `model sync` checks every
byte, this is the check route makes at start and doctor makes any time.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from linkctl.llama.invocation import FieldDiff, KvLayout, diff_fields

SPAN = 16 * 1024 * 1024
MODEL_FILE = "model file"  # the name of a file difference in ModelFingerprint.diff


@dataclass(frozen=True)
class ModelFingerprint:
    path: str
    size: int | None  # None: the file could not be read (``error`` says why)
    sha256: str | None
    # The KV layout of the llama-server that serves it; None from a side that does not
    # say (an agent from before the field existed): then it is not compared.
    kv: KvLayout | None = None
    error: str | None = None

    @property
    def readable(self) -> bool:
        return self.size is not None

    def same_file(self, other: ModelFingerprint) -> bool:
        return self.readable and (self.size, self.sha256) == (other.size, other.sha256)

    def diff(self, other: ModelFingerprint) -> list[FieldDiff]:
        """Every difference that makes a slot from one side unusable on the other: the
        file (by size and hash, not path: the hosts keep it in different places) and,
        where both sides report it, each KV layout field."""
        out = []
        if not self.same_file(other):
            out.append(FieldDiff(MODEL_FILE, self.describe(), other.describe()))
        if self.kv is not None and other.kv is not None:
            out += diff_fields(self.kv, other.kv, prefix="KV cache ")
        return out

    def describe(self) -> str:
        if not self.readable:
            return f"{self.path} (unreadable: {self.error})"
        return f"{self.path} ({self.size} bytes, sha256 {str(self.sha256)[:12]})"

    def as_wire(self) -> dict[str, Any]:
        """The kv-agent's answer to {"op": "model"}."""
        d: dict[str, Any] = {"path": self.path, "size": self.size, "sha256": self.sha256}
        if self.kv is not None:
            d["kv_layout"] = self.kv.as_dict()
        if self.error is not None:
            d["error"] = self.error
        return d

    @classmethod
    def from_wire(cls, d: dict[str, Any]) -> ModelFingerprint:
        kv = d.get("kv_layout")
        size = d.get("size")
        return cls(
            path=str(d.get("path")),
            size=int(size) if isinstance(size, int) else None,
            sha256=d.get("sha256") if isinstance(d.get("sha256"), str) else None,
            kv=KvLayout.from_dict(kv) if isinstance(kv, dict) else None,
            error=d.get("error") if isinstance(d.get("error"), str) else None,
        )


def fingerprint(path: str | Path, kv: KvLayout | None = None) -> ModelFingerprint:
    """The fingerprint of the file at ``path`` served with ``kv``."""
    p = Path(path)
    try:
        size = p.stat().st_size
        h = hashlib.sha256()
        with open(p, "rb") as f:
            h.update(f.read(SPAN))
            if size > 2 * SPAN:
                f.seek(size - SPAN)
                h.update(f.read(SPAN))
            elif size > SPAN:
                h.update(f.read())
    except OSError as e:
        return ModelFingerprint(str(p), None, None, kv, error=str(e))
    return ModelFingerprint(str(p), size, h.hexdigest(), kv)
