"""The documentation stays navigable: README.md is the short front door and docs/*.md hold the depth.

A page moved or a heading renamed silently breaks the links that point at it, and a README that grows
back into a manual stops being read. So: every relative link and image in README.md, docs/*.md and the
dated result pages (benchmarks/results/*.md) must name a file that exists and, for `page.md#anchor` or
`#anchor`, a heading of that page (GitHub's slugs); README.md stays within 300 lines; and every docs page
is reachable from README.md.
"""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import unquote

import pytest

from tests.conftest import ROOT

README = ROOT / "README.md"
DOCS = ROOT / "docs"
README_MAX_LINES = 300

FENCE = re.compile(r"^\s*(```|~~~)")
INLINE_CODE = re.compile(r"(`+)(?:(?!\1).)+?\1")
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^ {0,3}#{1,6}\s+(.*?)\s*#*\s*$")
EXTERNAL = ("http://", "https://", "mailto:")


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
        if anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            problems.append(f"{target}: no heading with anchor #{anchor} in {dest}")
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
