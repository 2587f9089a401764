"""The public llama-bench rows the device catalog is fitted to (data/published_bench.toml):
loaded and checked, each with its source, and the model shape it ran
(linkctl.gguf.shapes) and its published time.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass
from functools import cache
from importlib import resources
from pathlib import Path

from linkctl.core.errors import InputError
from linkctl.gguf.info import ModelInfo


def data_path() -> Path:
    return Path(str(resources.files("linkctl") / "data" / "published_bench.toml"))


@dataclass(frozen=True)
class Row:
    index: int
    device: str
    model: str
    quant: str
    test: str  # ppN / tgN
    depth: int
    tok_s: float
    ubatch: int
    size_gib: float
    source: str
    url: str
    date: str
    read: str
    params_b: float | None = None
    exclude: str | None = None
    # The build a row's source ran, where it is not the current one its device's other
    # rows ran (source `fit_group`): such rows are fitted as their own unit, never mixed
    # into the device's catalog terms (one set of terms cannot be two builds).
    group: str = ""
    # The llama.cpp build the source ran, as it names it (source `build`).
    build: str = ""
    # Whether the source's build ran flash attention (llama-bench -fa): without it the
    # decode attention reads K and V once per query head (ModelInfo.attn_bytes_per_position).
    flash_attn: bool = True

    @property
    def kind(self) -> str:
        return "decode" if self.test.startswith("tg") else "prefill"

    @property
    def n(self) -> int:
        return int(self.test[2:])

    @property
    def label(self) -> str:
        d = f" @d{self.depth}" if self.depth else ""
        return f"{self.device} {self.model} {self.quant.split('+')[0]} {self.test}{d}"


def load_rows(path: Path | None = None) -> list[Row]:
    path = path or data_path()
    try:
        data = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise InputError(f"benchmark data {path}: {e}", "restore the file") from None
    rows: list[Row] = []
    for src in data.get("source", []):
        if not isinstance(src.get("flash_attn"), bool):
            raise InputError(
                f"{path}: source {src.get('id')!r}: flash_attn {src.get('flash_attn')!r}",
                "state whether its build ran flash attention (llama-bench -fa): true or false",
            )
        for r in src.get("rows", []):
            test = str(r["test"])
            if not (test[:2] in ("pp", "tg") and test[2:].isdigit()):
                raise InputError(f"{path}: row {r}: test {test!r}", "write ppN or tgN")
            rows.append(
                Row(
                    index=len(rows),
                    device=r.get("device", src.get("device")),
                    model=r["model"],
                    quant=r["quant"],
                    test=test,
                    depth=int(r.get("depth", 0)),
                    tok_s=float(r["tok_s"]),
                    ubatch=int(r.get("ubatch", src.get("ubatch", 512))),
                    size_gib=float(r["size_gib"]),
                    params_b=r.get("params_b"),
                    source=src["id"],
                    url=src["url"],
                    date=str(src.get("date", "")),
                    read=src.get("read", "source"),
                    exclude=r.get("exclude"),
                    group=str(src.get("fit_group", "")),
                    flash_attn=src["flash_attn"],
                    build=str(r.get("build", src.get("build", ""))),
                )
            )
    return rows


@cache
def _model(key: str, quant: str) -> ModelInfo:
    from linkctl.gguf.shapes import model_info

    return model_info(key, quant)


def row_model(row: Row) -> ModelInfo:
    return _model(row.model, row.quant)


def row_time_us(row: Row) -> float:
    """The published time: per generated token (tg) or per whole prompt (pp)."""
    return 1e6 / row.tok_s if row.kind == "decode" else row.n / row.tok_s * 1e6
