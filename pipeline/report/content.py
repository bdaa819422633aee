"""What a report is made of, apart from how it is written: sections of text, tables, figures and
preformatted blocks. `render` writes the same content as Markdown (the text, for git diffs) and as
one self-contained HTML page (the figures embedded)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass
class Table:
    headers: list[str]
    rows: list[list[str]]
    highlight: list[int] = field(default_factory=list)  # rows to set apart (this run among others)


@dataclass
class Figure:
    """A chart as PNG bytes; `name` is its stable identifier (also the alt text's start)."""

    name: str
    title: str
    png: bytes


@dataclass
class Block:
    """Preformatted text (a sample) under a label."""

    label: str
    text: str


@dataclass
class Section:
    title: str
    text: list[str] = field(default_factory=list)
    tables: list[Table] = field(default_factory=list)
    figures: list[Figure] = field(default_factory=list)
    blocks: list[Block] = field(default_factory=list)


@dataclass
class Report:
    title: str
    sections: list[Section]

    @property
    def figures(self) -> list[Figure]:
        return [f for s in self.sections for f in s.figures]


def fmt(value: object) -> str:
    """A number as people read it in a table: integers whole, losses to 4 decimals, tiny values in g."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return "" if value is None else str(value)
    v = float(value)
    if not math.isfinite(v):
        return str(v)
    if v.is_integer() and abs(v) < 1e15:
        return f"{int(v):,}"
    if abs(v) >= 1000:
        return f"{v:,.0f}"
    return f"{v:.4f}" if abs(v) >= 0.01 else f"{v:.3g}"


def key_value_table(values: dict[str, object], headers: tuple[str, str] = ("key", "value")) -> Table:
    return Table(list(headers), [[k, fmt(v)] for k, v in values.items()])
