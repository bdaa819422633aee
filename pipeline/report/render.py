"""A report as Markdown (text and tables: what git diffs between experiments) and as one
self-contained HTML page (the same, with every chart embedded as a base64 PNG: no file beside it,
no network)."""

from __future__ import annotations

import base64
import html

from pipeline.report.content import Block, Figure, Report, Section, Table

STYLE = """
body { font-family: system-ui, -apple-system, "Segoe UI", sans-serif; max-width: 1100px; margin: 2em auto;
       padding: 0 1em; color: #1b1b1b; line-height: 1.45; }
h1 { border-bottom: 2px solid #ddd; padding-bottom: .3em; }
h2 { margin-top: 2em; border-bottom: 1px solid #eee; }
table { border-collapse: collapse; margin: 1em 0; font-size: 14px; }
th, td { border: 1px solid #ddd; padding: 4px 8px; text-align: left; vertical-align: top; }
th { background: #f5f5f5; }
tr.this td { background: #fdecea; font-weight: 600; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
figure { margin: 1em 0; }
figure img { max-width: 100%; border: 1px solid #eee; }
figcaption { font-size: 13px; color: #555; }
pre { background: #f7f7f7; padding: .6em; white-space: pre-wrap; border-radius: 4px; }
nav a { margin-right: 1em; }
code { background: #f3f3f3; padding: 0 .25em; border-radius: 3px; }
.tables { display: flex; flex-wrap: wrap; gap: 0 1.5em; align-items: flex-start; }
"""


def markdown(report: Report) -> str:
    lines = [f"# {report.title}", "", "Charts: `report.html` beside this file (self-contained).", ""]
    for section in report.sections:
        lines += [f"## {section.title}", ""]
        for text in section.text:
            lines += [text, ""]
        for table in section.tables:
            lines += _md_table(table) + [""]
        for fig in section.figures:
            lines += [f"- chart: {fig.title} (report.html)"]
        if section.figures:
            lines.append("")
        for block in section.blocks:
            lines += [f"**{block.label}**", "", "```text", block.text.replace("```", "'''"), "```", ""]
    return "\n".join(lines).rstrip() + "\n"


def _md_cell(value: str) -> str:
    return value.replace("|", "\\|").replace("\n", " ")


def _md_table(table: Table) -> list[str]:
    out = ["| " + " | ".join(_md_cell(h) for h in table.headers) + " |", "|" + "---|" * len(table.headers)]
    for i, row in enumerate(table.rows):
        cells = [_md_cell(c) for c in row]
        if i in table.highlight:
            cells = [f"**{c}**" if c else c for c in cells]
        out.append("| " + " | ".join(cells) + " |")
    return out


def page(report: Report) -> str:
    e = html.escape
    nav = " ".join(f'<a href="#{_anchor(s)}">{e(s.title)}</a>' for s in report.sections)
    body = "\n".join(_html_section(s) for s in report.sections)
    return (
        '<!DOCTYPE html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n'
        f"<title>{e(report.title)}</title>\n<style>{STYLE}</style>\n</head>\n<body>\n"
        f"<h1>{e(report.title)}</h1>\n<nav>{nav}</nav>\n{body}\n</body>\n</html>\n"
    )


def _anchor(section: Section) -> str:
    return "s-" + "".join(c if c.isalnum() else "-" for c in section.title.lower())


def _html_section(section: Section) -> str:
    parts = [f'<section id="{_anchor(section)}">', f"<h2>{html.escape(section.title)}</h2>"]
    parts += [f"<p>{_inline(t)}</p>" for t in section.text]
    parts += [_html_figure(f) for f in section.figures]
    if section.tables:
        parts += ['<div class="tables">', *(_html_table(t) for t in section.tables), "</div>"]
    parts += [_html_block(b) for b in section.blocks]
    return "\n".join(parts + ["</section>"])


def _inline(text: str) -> str:
    """Escaped text with Markdown's `code` spans as <code>."""
    pieces = html.escape(text).split("`")
    return "".join(f"<code>{p}</code>" if i % 2 else p for i, p in enumerate(pieces))


def _html_figure(fig: Figure) -> str:
    data = base64.b64encode(fig.png).decode("ascii")
    name, title = html.escape(fig.name), html.escape(fig.title)
    return (
        f'<figure id="fig-{name}"><img src="data:image/png;base64,{data}" alt="{name}: {title}">'
        f"<figcaption>{title}</figcaption></figure>"
    )


def _is_number(cell: str) -> bool:
    try:
        float(cell.replace(",", ""))
    except ValueError:
        return False
    return True


def _html_table(table: Table) -> str:
    e = html.escape
    head = "".join(f"<th>{e(h)}</th>" for h in table.headers)
    rows = []
    for i, row in enumerate(table.rows):
        cells = "".join(f'<td class="num">{e(c)}</td>' if _is_number(c) else f"<td>{e(c)}</td>" for c in row)
        rows.append(f'<tr class="this">{cells}</tr>' if i in table.highlight else f"<tr>{cells}</tr>")
    return f"<table>\n<thead><tr>{head}</tr></thead>\n<tbody>\n" + "\n".join(rows) + "\n</tbody>\n</table>"


def _html_block(block: Block) -> str:
    return f"<p><strong>{html.escape(block.label)}</strong></p>\n<pre>{html.escape(block.text)}</pre>"
