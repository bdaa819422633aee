"""The built-in instruction set: question/answer pairs from the sections of CPython's language
reference (`pydoc_data.topics`), present on every machine, split by topic."""

from __future__ import annotations

import json
import os
import re
import textwrap
from pathlib import Path

from pipeline.data.split import split_indices
from pipeline.io.files import write_text

_UNDERLINE = re.compile(r"^([*=\-~^])\1{2,}$")
_NOTE = ("New in version", "Added in version", "Changed in version", "Deprecated since")


def _sections(text: str) -> list[tuple[str, list[str]]]:
    """(title, body lines) for each underlined heading of a pydoc topic."""
    lines = text.split("\n")
    heads = [
        i
        for i in range(len(lines) - 1)
        if lines[i].strip()
        and _UNDERLINE.match(lines[i + 1].strip())
        and len(lines[i + 1].strip()) == len(lines[i].strip())
    ]
    out = []
    for n, i in enumerate(heads):
        end = heads[n + 1] if n + 1 < len(heads) else len(lines)
        out.append((lines[i].strip(), lines[i + 2 : end]))
    return out


def _paragraphs(body: list[str]) -> list[str]:
    """Blank-line separated paragraphs; prose re-flowed onto one line, indented blocks kept."""
    paras, cur = [], []
    for line in [*body, ""]:
        if line.strip():
            cur.append(line)
        elif cur:
            if cur[0].startswith(" "):
                paras.append(textwrap.dedent("\n".join(cur)).rstrip())
            else:
                paras.append(" ".join(s.strip() for s in cur))
            cur = []
    return [p for p in paras if not p.startswith(_NOTE)]


def _cap(paras: list[str], max_chars: int) -> str:
    """Whole paragraphs up to `max_chars`; the first one cut at a word boundary if it alone is longer."""
    out = ""
    for p in paras:
        joined = f"{out}\n\n{p}" if out else p
        if len(joined) > max_chars:
            break
        out = joined
    if not out and paras:
        out = paras[0][:max_chars].rsplit(" ", 1)[0].rstrip(",;:") + " ..."
    return out


def pydoc_pairs(max_chars: int = 600) -> list[dict[str, str]]:
    """{"id", "prompt", "response"} for every titled section of `pydoc_data.topics`, deterministic."""
    from pydoc_data.topics import topics  # stdlib, but a large module: only when the set is asked for

    pairs, seen = [], set()
    for key in sorted(topics):
        for title, body in _sections(topics[key]):
            answer = _cap(_paragraphs(body), max_chars)
            subject = title[0].lower() + title[1:] if title.startswith(("The ", "A ", "An ")) else title
            prompt = f"What does the Python documentation say about {subject}?"
            if not answer or prompt in seen:
                continue
            seen.add(prompt)
            pairs.append({"id": f"{key}/{title}", "prompt": prompt, "response": answer})
    return pairs


def write_pydoc_instruct(
    out_dir: str | os.PathLike[str], val_fraction: float = 0.1, seed: int = 0, max_chars: int = 600
) -> dict[str, int]:
    """`train.jsonl` / `val.jsonl` of pydoc Q/A pairs; the split is by topic, seeded, never empty."""
    pairs = pydoc_pairs(max_chars)
    topics = sorted({p["id"].split("/", 1)[0] for p in pairs})
    val_topics = {topics[i] for i in split_indices(len(topics), val_fraction, seed)[1]}
    split = {"train": [], "val": []}
    for p in pairs:
        split["val" if p["id"].split("/", 1)[0] in val_topics else "train"].append(p)
    out = Path(out_dir)
    for name, rows in split.items():
        write_text(out / f"{name}.jsonl", "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    return {"train": len(split["train"]), "val": len(split["val"]), "topics": len(topics)}
