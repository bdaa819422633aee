"""The README's Measured table, generated from the results files, and the reader of those files that
`tests/test_docs.py` checks every quoted figure with.

    python3 benchmarks/results_table.py            # print the table
    python3 benchmarks/results_table.py --write README.md   # replace the README's rows (`make results`)

A results file is `benchmarks/results/<name>.json`, or `<name>.md` whose first fenced `json` block is
the same record (the page's tables below it):

- `conditions`: what `benchmarks/harness.py` records: `command`, `commit`, `date`, `machine` (`cpu`,
  `cores`, `gpu`), `load` and `allocator` (and `torch`, `note` where known);
- `figures`: the named figures the docs quote, each as the text they quote it with; a page quotes one
  as a link to it: `[1.33x](../benchmarks/results/draft_speed.json#ours_fp32_k2_vs_own_alone)`;
- `measured` (optional): its row of the README's Measured table: `topic`, `order`, `headline` (text in
  which `{name}` stands for a figure, rendered as its link) and `table` (the docs section with the
  whole table, a path from the project root).

Standard library only: it runs before set-up too.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
CONDITIONS = ("command", "commit", "date", "machine", "load", "allocator")
BEGIN = "<!-- rows generated from benchmarks/results/ by benchmarks/results_table.py (make results) -->"
END = "<!-- end of the generated rows -->"
HEADER = "| topic | headline | when, where |\n|---|---|---|"
JSON_BLOCK = re.compile(r"^```json\n(.*?)\n```$", re.S | re.M)
FIGURE = re.compile(r"\{(?:([\w.\-]+):)?(\w+)\}")  # {figure}, or {other_file.json:figure}


def results_files() -> list[Path]:
    """Every results file (the dated folders beside them hold raw logs, which results files cite)."""
    return sorted(p for p in RESULTS.iterdir() if p.suffix in (".json", ".md") and p.is_file())


def read_record(path: Path) -> dict[str, Any]:
    """A results file's record; a Markdown page's first fenced `json` block."""
    text = Path(path).read_text(encoding="utf-8")
    if Path(path).suffix == ".md":
        block = JSON_BLOCK.search(text)
        if block is None:
            raise ValueError(f"{path}: no ```json block with the page's conditions and figures")
        text = block.group(1)
    return json.loads(text)


def where(conditions: dict[str, Any]) -> str:
    """'when, where' of a row: the date, the machine (cores, CPU, GPU), the allocator and a load above 1.5."""
    m = conditions["machine"]
    place = m["gpu"] if m.get("gpu", "none") != "none" else f"{m['cores']}-core {m['cpu']}"
    out = f"{conditions['date']}, {place}"
    if m.get("gpu", "none") == "none":
        out += f", {conditions['allocator']}"
    load = conditions["load"]
    peak = max(load.values()) if isinstance(load, dict) else None
    if peak is not None and peak > 1.5:
        out += f", load {peak:g}"
    elif isinstance(load, str) and "loaded" in load:
        out += ", loaded"
    return out


def link(name: str, figure: str, value: str, base: str) -> str:
    return f"[{value}]({base}{name}#{figure})"


def headline(path: Path, record: dict[str, Any], base: str) -> str:
    """The row's headline with each `{figure}` (or `{file:figure}` of another results file) as a link to
    it, and the docs table after it."""

    def figure(m: re.Match) -> str:
        name = m.group(1) or path.name
        figures = record["figures"] if name == path.name else read_record(RESULTS / name)["figures"]
        return link(name, m.group(2), figures[m.group(2)], base)

    text = FIGURE.sub(figure, record["measured"]["headline"])
    table = record["measured"].get("table")
    return f"{text} ([table]({table}))" if table else text


def render(base: str = "benchmarks/results/") -> str:
    """The Measured table's rows in their `order`: per topic, the newest results file with a `measured`
    entry for it (a re-measurement supersedes the older file's row by itself)."""
    newest: dict[str, tuple[str, Path, dict[str, Any]]] = {}
    for path in results_files():
        record = read_record(path)
        topic = record.get("measured", {}).get("topic")
        if topic and (topic not in newest or record["conditions"]["date"] >= newest[topic][0]):
            newest[topic] = (record["conditions"]["date"], path, record)
    rows = []
    for _, path, record in newest.values():
        m = record["measured"]
        rows.append((m["order"], f"| {m['topic']} | {headline(path, record, base)} | {where(record['conditions'])} |"))
    return "\n".join([HEADER, *(row for _, row in sorted(rows))])


def replace_rows(text: str, rows: str) -> str:
    """`text` (the README) with the lines between BEGIN and END replaced by `rows`."""
    start, end = text.index(BEGIN) + len(BEGIN), text.index(END)
    return f"{text[:start]}\n{rows}\n{text[end:]}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--write", type=Path, help="the README whose generated rows to replace")
    args = ap.parse_args()
    rows = render()
    if args.write is None:
        print(rows)
        return
    text = args.write.read_text(encoding="utf-8")
    if BEGIN not in text or END not in text:
        sys.exit(f"{args.write}: expected the markers {BEGIN!r} and {END!r} around the Measured table; add them")
    args.write.write_text(replace_rows(text, rows), encoding="utf-8")


if __name__ == "__main__":
    main()
