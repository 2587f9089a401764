"""The notes an estimate carries next to its figures, each with a kind, so that a
reader selects them by what they are about, never by their words. JSON keeps the
text only (`estimate --json` "warnings", "serving" -> "notes")."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class NoteKind(StrEnum):
    MODEL = "model"  # what the GGUF header lacks and the reader assumed instead
    CALIBRATION = "calibration"  # a host runs on catalog terms, or its RPC cost is uncounted
    DISAGGREGATED = "disaggregated"  # why the disaggregated plan is missing, or will not hold


@dataclass(frozen=True)
class Note:
    kind: NoteKind
    text: str


def texts(notes: list[Note]) -> list[str]:
    """The notes as JSON carries them."""
    return [n.text for n in notes]
