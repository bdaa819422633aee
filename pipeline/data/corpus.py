"""Corpus sources: the built-in Python language reference, text files, directories, JSONL.

Each source yields named documents in a deterministic order, so packing is reproducible and the
train/val split is by document.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path

from pipeline.config import DataConfig
from pipeline.errors import DataError, problem


@dataclass(frozen=True)
class Document:
    name: str
    text: str


def load_documents(cfg: DataConfig) -> list[Document]:
    """The documents of the configured source, in a stable order, empty ones dropped."""
    loaders = {"pydoc": _pydoc, "text": _text_file, "dir": _directory, "jsonl": _jsonl}
    docs = [d for d in loaders[cfg.source](cfg) if d.text.strip()]
    if len(docs) < 2:
        raise DataError(
            problem(
                f"data.source={cfg.source} {cfg.path}".strip(),
                "at least 2 non-empty documents (one for train, one for val)",
                f"{len(docs)}",
                "point data.path at a larger corpus",
            )
        )
    return docs


def corpus_sha256(docs: list[Document]) -> str:
    """A fingerprint of the corpus content (names and texts), for provenance and DVC metadata."""
    h = hashlib.sha256()
    for d in docs:
        for part in (d.name, d.text):
            b = part.encode("utf-8")
            h.update(len(b).to_bytes(8, "little"))
            h.update(b)
    return h.hexdigest()


def source_files(cfg: DataConfig) -> tuple[Path | None, list[Path]]:
    """(root, files) the configured source reads: the user's files, or the stdlib module behind
    the built-in sources. A missing path is the same named error pack would give."""
    if not cfg.path and cfg.source in ("pydoc", "instruct"):
        spec = importlib.util.find_spec("pydoc_data.topics")
        return None, [Path(spec.origin)] if spec and spec.origin else []
    if cfg.source == "dir":
        root = _existing(cfg.path, "directory")
        return root, sorted(p for p in root.glob(cfg.glob) if p.is_file())
    return None, [_existing(cfg.path, "file")]


def _pydoc(cfg: DataConfig) -> list[Document]:
    """CPython's language reference (`pydoc_data.topics`), one document per topic."""
    from pydoc_data.topics import topics  # stdlib, but a large module: only when this source is asked for

    return [Document(name, topics[name]) for name in sorted(topics)]


def _existing(path: str, kind: str) -> Path:
    p = Path(path).expanduser()
    ok = p.is_file() if kind == "file" else p.is_dir()
    if not ok:
        raise DataError(problem(f"data.path={path}", f"an existing {kind}", "nothing there", "check data.path"))
    return p


def _read_text(p: Path) -> str:
    try:
        return p.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise DataError(
            problem(str(p), "UTF-8 text", f"undecodable bytes at offset {e.start}", "convert the file to UTF-8")
        ) from None


def _text_file(cfg: DataConfig) -> list[Document]:
    """A text file; documents are separated by lines holding only `---` or by form feeds, else the whole file."""
    p = _existing(cfg.path, "file")
    text = _read_text(p).replace("\f", "\n---\n")
    parts = [part.strip("\n") for part in _split_on_rule(text)]
    return [Document(f"{p.name}#{i}", part) for i, part in enumerate(parts)]


def _split_on_rule(text: str) -> list[str]:
    parts, current = [], []
    for line in text.splitlines(keepends=True):
        if line.strip() == "---":
            parts.append("".join(current))
            current = []
        else:
            current.append(line)
    parts.append("".join(current))
    return parts


def _directory(cfg: DataConfig) -> list[Document]:
    """Every file matching `data.glob` under `data.path`, one document each, sorted by path."""
    root = _existing(cfg.path, "directory")
    files = sorted(p for p in root.glob(cfg.glob) if p.is_file())
    if not files:
        raise DataError(
            problem(f"data.path={cfg.path}", f"files matching data.glob={cfg.glob}", "none", "check data.glob")
        )
    return [Document(str(p.relative_to(root)), _read_text(p)) for p in files]


def _jsonl(cfg: DataConfig) -> list[Document]:
    """One JSON object per line with the document in `data.text_field`; a bad line is an error."""
    p = _existing(cfg.path, "file")
    docs = []
    for lineno, line in enumerate(_read_text(p).splitlines(), start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(
                problem(f"{p} line {lineno}", "a JSON object", f"invalid JSON ({e.msg})", "fix or remove the line")
            ) from None
        if not isinstance(obj, dict) or not isinstance(obj.get(cfg.text_field), str):
            raise DataError(
                problem(
                    f"{p} line {lineno}",
                    f"an object with a string field {cfg.text_field!r}",
                    f"keys {sorted(obj) if isinstance(obj, dict) else type(obj).__name__}",
                    "set data.text_field to the field holding the text",
                )
            )
        docs.append(Document(f"{p.name}:{lineno}", obj[cfg.text_field]))
    return docs
