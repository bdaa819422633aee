"""Corpus sources: the built-in Python language reference, text files, directories, JSONL (plain,
gzip, zstd) and parquet.

Each source yields named documents lazily in a deterministic order, so packing is reproducible, the
train/val split is by document, and a corpus of any size is read one document at a time.
"""

from __future__ import annotations

import hashlib
import importlib.util
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from pipeline.config import DataConfig
from pipeline.data.readers import iter_lines, iter_parquet, load_json_line, read_text
from pipeline.errors import DataError, problem


@dataclass(frozen=True)
class Document:
    name: str
    text: str


def iter_documents(cfg: DataConfig) -> Iterator[Document]:
    """The non-empty documents of the configured source, in a stable order, read lazily."""
    loaders = {"pydoc": _pydoc, "text": _text_file, "dir": _directory, "jsonl": _jsonl, "parquet": _parquet}
    return (d for d in loaders[cfg.source](cfg) if d.text.strip())


def too_few_documents(cfg: DataConfig, found: int) -> DataError:
    """The error for a corpus with fewer than 2 documents (pack needs one for each split)."""
    return DataError(
        problem(
            f"data.source={cfg.source} {cfg.path}".strip(),
            "at least 2 non-empty documents (one for train, one for val)",
            f"{found}",
            "point data.path at a larger corpus",
        )
    )


def load_documents(cfg: DataConfig) -> list[Document]:
    """All documents of the configured source in memory: for small corpora and tests; pack streams."""
    docs = list(iter_documents(cfg))
    if len(docs) < 2:
        raise too_few_documents(cfg, len(docs))
    return docs


class CorpusHash:
    """The corpus fingerprint (names and texts), updated one document at a time."""

    def __init__(self) -> None:
        self._h = hashlib.sha256()

    def update(self, name: str, text: bytes) -> None:
        for b in (name.encode("utf-8"), text):
            self._h.update(len(b).to_bytes(8, "little"))
            self._h.update(b)

    def hexdigest(self) -> str:
        return self._h.hexdigest()


def corpus_sha256(docs: Iterable[Document]) -> str:
    """A fingerprint of the corpus content (names and texts), for provenance and DVC metadata."""
    h = CorpusHash()
    for d in docs:
        h.update(d.name, d.text.encode("utf-8"))
    return h.hexdigest()


def source_files(cfg: DataConfig) -> tuple[Path | None, list[Path]]:
    """(root, files) the configured source reads: the user's files, or the stdlib module behind
    the built-in sources. A missing path is the same named error pack would give."""
    if not cfg.path and cfg.source in ("pydoc", "instruct"):
        spec = importlib.util.find_spec("pydoc_data.topics")
        return None, [Path(spec.origin)] if spec and spec.origin else []
    if cfg.source == "digits":  # scikit-learn's bundled file, found without importing scikit-learn
        spec = importlib.util.find_spec("sklearn.datasets")
        return None, [Path(spec.origin).parent / "data" / "digits.csv.gz"] if spec and spec.origin else []
    if cfg.source == "images":
        root = _existing(cfg.path, "directory")
        return root, sorted(p for p in root.glob("*/*") if p.is_file() and not p.name.startswith("."))
    if cfg.source == "dir":
        root = _existing(cfg.path, "directory")
        return root, sorted(p for p in root.glob(cfg.glob) if p.is_file())
    return None, [_existing(cfg.path, "file")]


def _pydoc(cfg: DataConfig) -> Iterator[Document]:
    """CPython's language reference (`pydoc_data.topics`), one document per topic."""
    from pydoc_data.topics import topics  # stdlib, but a large module: only when this source is asked for

    return (Document(name, topics[name]) for name in sorted(topics))


def _existing(path: str, kind: str) -> Path:
    """`data.path` as a file or directory (`kind`); the error says what is there instead, and the fix."""
    p = Path(path).expanduser()
    if p.is_file() if kind == "file" else p.is_dir():
        return p
    raise DataError(problem(f"data.path={path}", f"an existing {kind}", *_instead(p, kind)))


def _instead(p: Path, kind: str) -> tuple[str, str]:
    """(what is at `p`, the fix) when it is not the `kind` (file or directory) a source reads."""
    if p.is_dir():
        return "a directory", "use data=dir for a folder of documents, or point data.path at one file"
    if p.exists():
        return "a file", "use data=text (or jsonl/parquet) for one file, or point data.path at a folder"
    where = p.resolve()
    hint = "queued and --temp experiments see only files in git or dvc add-ed"
    return f"nothing at {where}", f"check data.path (relative to the project root; {hint})"


def _text_file(cfg: DataConfig) -> Iterator[Document]:
    """A text file (plain, gzip or zstd); documents are separated by lines holding only `---` or by
    form feeds, else the whole file. Names count empty parts too, as they always have."""
    p = _existing(cfg.path, "file")
    current: list[str] = []
    index = 0
    for _, raw in iter_lines(p):
        for line in raw.replace("\f", "\n---\n").splitlines(keepends=True):
            if line.strip() == "---":
                yield Document(f"{p.name}#{index}", "".join(current).strip("\n"))
                index, current = index + 1, []
            else:
                current.append(line)
    yield Document(f"{p.name}#{index}", "".join(current).strip("\n"))


def _directory(cfg: DataConfig) -> Iterator[Document]:
    """Every file matching `data.glob` under `data.path`, one document each, sorted by path."""
    root = _existing(cfg.path, "directory")
    files = sorted(p for p in root.glob(cfg.glob) if p.is_file())
    if not files:
        raise DataError(
            problem(f"data.path={cfg.path}", f"files matching data.glob={cfg.glob}", "none", "check data.glob")
        )
    return (Document(str(p.relative_to(root)), read_text(p)) for p in files)


def _jsonl(cfg: DataConfig) -> Iterator[Document]:
    """One JSON object per line (plain, gzip or zstd) with the document in `data.text_field`; a bad
    line is an error naming it."""
    p = _existing(cfg.path, "file")
    for lineno, line in iter_lines(p):
        if not line.strip():
            continue
        obj = load_json_line(line, f"{p} line {lineno}")
        if not isinstance(obj, dict) or not isinstance(obj.get(cfg.text_field), str):
            raise DataError(
                problem(
                    f"{p} line {lineno}",
                    f"an object with a string field {cfg.text_field!r}",
                    f"keys {sorted(obj) if isinstance(obj, dict) else type(obj).__name__}",
                    "set data.text_field to the field holding the text",
                )
            )
        yield Document(f"{p.name}:{lineno}", obj[cfg.text_field])


def _parquet(cfg: DataConfig) -> Iterator[Document]:
    """The `data.text_field` column of a parquet file, one document per row, read a batch at a time."""
    p = _existing(cfg.path, "file")
    for row, text in iter_parquet(p, cfg.text_field):
        if text is None:
            raise DataError(
                problem(f"{p} row {row}", f"a string in column {cfg.text_field!r}", "null", "drop or fill null rows")
            )
        yield Document(f"{p.name}:{row}", text)
