"""JSON records checked against the dataclass they were written from, so a hand-edited or foreign
`train_state.json` / checkpoint `state.json` is a named error and never a TypeError deep inside a
stage (`"steps": "abc"` would otherwise surface as a crash in export or at resume)."""

from __future__ import annotations

from dataclasses import MISSING, fields
from typing import Any

_CHECKS = {
    "bool": lambda v: isinstance(v, bool),
    "int": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "float": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "str": lambda v: isinstance(v, str),
    "list": lambda v: isinstance(v, list),
    "dict": lambda v: isinstance(v, dict),
}


def field_problems(record: dict[str, Any], schema: type) -> list[str]:
    """`key: expected T, found ...` for each field of the dataclass `schema` that `record` lacks
    (without a default) or holds with another JSON type; [] when the record fits."""
    out = []
    for f in fields(schema):
        annotation = str(f.type)
        if f.name not in record:
            if f.default is MISSING and f.default_factory is MISSING:
                out.append(f"{f.name}: missing")
            continue
        value = record[f.name]
        optional = annotation.endswith("| None")
        base = annotation.removesuffix(" | None").split("[")[0]
        if value is None and optional or base not in _CHECKS:
            continue
        if value is None or not _CHECKS[base](value):
            shown = f"{type(value).__name__} {value!r}"[:60]
            out.append(f"{f.name}: expected {annotation.replace(' | None', ' or null')}, found {shown}")
        elif base == "int" and value < 0:  # the records' integers are all counts and steps
            out.append(f"{f.name}: expected a count (>= 0), found {value!r}")
    return out
