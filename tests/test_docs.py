"""The documentation stays navigable and every figure in it true and traceable.

Navigable: README.md is the short front door and docs/*.md hold the depth. A page moved or a heading
renamed silently breaks the links that point at it, and a README that grows back into a manual stops
being read. So: every relative link and image in README.md, docs/*.md and the result pages
(benchmarks/results/*.md) must name a file that exists and, for `page.md#anchor` or `#anchor`, a heading
of that page (GitHub's slugs); README.md stays within 300 lines; and every docs page is reachable from
README.md.

Traceable: one source per number. A measured figure (a speed, a ratio, an MFU, a wall time, a peak RSS,
a loss, a share of a gap) is quoted in README.md and docs/*.md only as a link to its named value in a
results file, `[1.33x](../benchmarks/results/draft_speed.json#ours_fp32_k2_vs_own_alone)`, and the link's
text must be that value; every results file records the conditions it was measured under; the README's
Measured table is the one `benchmarks/results_table.py` generates from them (`make results`).
"""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import unquote

import pytest

from benchmarks.results_table import BEGIN, CONDITIONS, END, read_record, render, results_files
from tests.conftest import ROOT

README = ROOT / "README.md"
DOCS = ROOT / "docs"
RESULTS_DIR = ROOT / "benchmarks" / "results"
README_MAX_LINES = 300

FENCE = re.compile(r"^\s*(```|~~~)")
INLINE_CODE = re.compile(r"(`+)(?:(?!\1).)+?\1")
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^ {0,3}#{1,6}\s+(.*?)\s*#*\s*$")
EXTERNAL = ("http://", "https://", "mailto:")
# a link to a named figure of a results file: [text](path/benchmarks/results/<file>#<figure>)
FIGURE_LINK = re.compile(r"\[([^\[\]]+)\]\(\s*<?((?:[^)\s>#]*/)?benchmarks/results/[^)\s>#/]+)#(\w+)>?\s*\)")
# what reads as a measured figure: speeds, ratios, MFU, wall times, peak memory, losses, shares of a gap
MEASURE = re.compile(
    r"\d[\d,.]*k?\s?(?:tok/s|tokens/s|tokens per second|docs/s|positions/s|steps/s|s/step|ms/step|GFLOP/s)"
    r"|(?<![\w.])\d+(?:\.\d+)?x(?![\w])"
    r"|\d+(?:\.\d+)?% MFU"
    r"|\b\d+ min \d+ s\b"
    r"|\b\d[\d,.]* ?(?:MiB|GiB|MB|GB)\b(?=[^.|;]*(?:RSS|memory|peak))"
    r"|(?:RSS|memory|peak)[^.|;\]]{0,40}?\b\d[\d,.]* ?(?:MiB|GiB|MB|GB)\b"
    r"|(?<![\w.])[1-9]\.\d{3,}(?![\w.])|(?<![\w.])[+-]\d\.\d{3,}(?![\w.])|\b\d+(?:\.\d+)? nats\b"
    r"|\b\d+(?:\.\d+)?% (?:of the gap|of (?:the )?(?:drafts|what it proposes)|accepted|(?:val )?accuracy)"
)
# a target an issue set or a bound a test holds, not a measurement: "the bar 1.5x", "at most 0.05 nats"
BAR = re.compile(r"\b(?:bars?(?: of| at most| at least)?|at most|at least|bound(?: of)?) $")


def pages() -> list[Path]:
    """The Markdown pages whose links are checked."""
    return [README, *sorted(DOCS.glob("*.md")), *sorted((ROOT / "benchmarks" / "results").glob("*.md"))]


def prose_lines(page: Path) -> list[str]:
    """The page's lines outside fenced code blocks."""
    lines, fenced = [], False
    for line in page.read_text(encoding="utf-8").splitlines():
        if FENCE.match(line):
            fenced = not fenced
        elif not fenced:
            lines.append(line)
    return lines


def links(page: Path) -> list[str]:
    """Every link and image target of the page, in order (none inside code)."""
    return [m.group(1) for line in prose_lines(page) for m in LINK.finditer(INLINE_CODE.sub("", line))]


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lowercase, punctuation dropped (except - and _), spaces to -."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading anchors by its text
    text = text.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """The anchors GitHub gives the page's headings (a repeated slug gets -1, -2, ...)."""
    seen: dict[str, int] = {}
    out: set[str] = set()
    for line in prose_lines(page):
        m = HEADING.match(line)
        if not m:
            continue
        base = slug(m.group(1))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def broken_links(page: Path) -> list[str]:
    """The page's relative links whose file or heading does not exist, as readable lines."""
    problems = []
    for target in links(page):
        if target.startswith(EXTERNAL):
            continue
        path_part, _, anchor = target.partition("#")
        dest = (page.parent / unquote(path_part)).resolve() if path_part else page
        if not dest.exists():
            problems.append(f"{target}: no such file {dest}")
            continue
        if anchor and dest.parent == RESULTS_DIR and anchor in read_record(dest).get("figures", {}):
            continue  # a named figure (its value is checked by test_every_quoted_figure_is_its_results_files)
        if anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            problems.append(f"{target}: no heading with anchor #{anchor} in {dest}")
        elif anchor and dest.suffix == ".json":
            problems.append(f"{target}: no figure named {anchor} in {dest}")
    return problems


@pytest.mark.parametrize("page", pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page: Path) -> None:
    assert broken_links(page) == []


def test_readme_is_a_front_door() -> None:
    n = len(README.read_text(encoding="utf-8").splitlines())
    assert n <= README_MAX_LINES, f"README.md has {n} lines; move depth into docs/ (at most {README_MAX_LINES})"


def test_every_docs_page_is_linked_from_the_readme() -> None:
    linked = {
        (README.parent / unquote(t.partition("#")[0])).resolve()
        for t in links(README)
        if not t.startswith(EXTERNAL) and t.partition("#")[0]
    }
    missing = [p.name for p in sorted(DOCS.glob("*.md")) if p.resolve() not in linked]
    assert missing == [], f"docs pages not linked from README.md: {missing}"


def test_the_checks_see_what_github_sees(tmp_path: Path) -> None:
    """The parsing rules themselves: slugs, fenced blocks and code spans."""
    assert slug("Config: Hydra, `params.yaml` and DVC") == "config-hydra-paramsyaml-and-dvc"
    assert slug("Speed against transformers + PEFT") == "speed-against-transformers--peft"
    assert slug("Optional: llama.cpp (`make llamacpp`)") == "optional-llamacpp-make-llamacpp"
    probe = tmp_path / "probe.md"
    probe.write_text('[a](x.md) `[b](y.md)`\n```\n[c](z.md)\n```\n![d](e.png "title") [f](#g)\n', encoding="utf-8")
    assert links(probe) == ["x.md", "e.png", "#g"]


# ----- one source per number -----


def figure_links(page: Path) -> list[tuple[int, str, Path, str]]:
    """(line, text, results file, figure name) of each link to a named figure, outside code blocks."""
    out = []
    for n, line in enumerate(prose_lines(page), 1):
        for m in FIGURE_LINK.finditer(INLINE_CODE.sub("", line)):
            out.append((n, m.group(1), (page.parent / unquote(m.group(2))).resolve(), m.group(3)))
    return out


def measured(line: str) -> list[str]:
    """The measured figures a line quotes other than as links to their named values (code spans aside)."""
    bare = FIGURE_LINK.sub("", INLINE_CODE.sub("", line))
    return [m.group(0) for m in MEASURE.finditer(bare) if not BAR.search(bare[: m.start()][-16:])]


def unsourced(page: Path) -> list[str]:
    """Lines quoting a measured figure that is not a link to its results file's named value."""
    problems = []
    for line in prose_lines(page):
        found = measured(line)
        if found:
            problems.append(f"{page.relative_to(ROOT)}: {found} in: {line.strip()[:140]}")
    return problems


@pytest.mark.parametrize("path", results_files(), ids=lambda p: p.name)
def test_every_results_file_records_its_conditions(path: Path) -> None:
    """Command, commit, date, machine (CPU, cores, GPU), load and allocator beside named figures."""
    record = read_record(path)
    conditions = record.get("conditions", {})
    missing = [key for key in CONDITIONS if not conditions.get(key)]
    assert not missing, f"{path.name}: conditions lack {missing}"
    assert {"cpu", "cores", "gpu"} <= set(conditions["machine"]), f"{path.name}: machine needs cpu, cores, gpu"
    assert isinstance(record.get("figures"), dict), f"{path.name}: no figures"
    assert all(isinstance(v, str) for v in record["figures"].values()), f"{path.name}: figures are quoted text"


@pytest.mark.parametrize("page", pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_quoted_figure_is_its_results_files(page: Path) -> None:
    """A link to a named figure says exactly what its results file holds."""
    wrong = []
    for n, text, path, name in figure_links(page):
        figures = read_record(path).get("figures", {}) if path.is_file() else {}
        if figures.get(name) != text:
            wrong.append(f"line {n}: [{text}] but {path.name}#{name} is {figures.get(name)!r}")
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize("page", [README, *sorted(DOCS.glob("*.md"))], ids=lambda p: str(p.relative_to(ROOT)))
def test_every_measured_figure_names_its_results_file(page: Path) -> None:
    """No measured figure without its source: quote it as a link to its named value (see the module
    docstring), or move it, with its table, into the results file it came from."""
    problems = unsourced(page)
    assert not problems, "\n".join(problems)


def test_every_benchmark_script_is_listed() -> None:
    """docs/benchmarks.md says what each script in benchmarks/ measures and where its results live."""
    listed = (DOCS / "benchmarks.md").read_text(encoding="utf-8")
    scripts = sorted(p.name for p in (ROOT / "benchmarks").iterdir() if p.suffix in (".py", ".sh"))
    assert [s for s in scripts if f"`{s}`" not in listed] == [], "add them to docs/benchmarks.md's table"


def test_the_readme_measured_table_is_the_generated_one() -> None:
    text = README.read_text(encoding="utf-8")
    rows = text[text.index(BEGIN) + len(BEGIN) : text.index(END)].strip()
    assert rows == render(), "README.md's Measured table is stale: run `make results`"


def test_the_figure_checks_catch_what_they_must(tmp_path: Path) -> None:
    """The rules themselves: a bare measured figure is caught, a linked one is not, a bar is not a figure."""
    probe = tmp_path / "probe.md"
    probe.write_text(
        "ours 117.8 tok/s, 1.33x faster, val loss 2.5740, peak RSS 1.4 GB\n"
        "[1.33x](../benchmarks/results/x.json#speedup) the bar 1.5x; 4 x 256 rows; lr 0.003\n",
        encoding="utf-8",
    )
    assert [measured(line) for line in prose_lines(probe)] == [
        ["117.8 tok/s", "1.33x", "2.5740", "peak RSS 1.4 GB"],
        [],
    ]
    assert [(t, name) for _, t, _, name in figure_links(probe)] == [("1.33x", "speedup")]
