"""Files written whole or not at all, and the one way we fingerprint them.

Every output goes to a temp sibling and is renamed into place, so a crash or a user error never
leaves half a file or half a directory where a stage (or DVC) would take it for a result.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any


def _temp_sibling(path: Path, kind: str, suffix: str = "") -> Path:
    return path.with_name(f".{path.name}.{kind}-{os.getpid()}{suffix}")


@contextmanager
def atomic_file(path: str | os.PathLike[str], suffix: str = "") -> Iterator[Path]:
    """Yield a temp path to write; it replaces `path` only if the block succeeds.

    `suffix` is for writers that insist on a file extension (numpy's `savez` adds `.npz`).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _temp_sibling(path, "tmp", suffix)
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


@contextmanager
def atomic_dir(path: str | os.PathLike[str]) -> Iterator[Path]:
    """Yield an empty temp directory that replaces `path` only if the block succeeds."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _temp_sibling(path, "tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        yield tmp
        old = _temp_sibling(path, "old")
        if path.exists():
            os.replace(path, old)
        os.replace(tmp, path)
        shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def write_text(path: str | os.PathLike[str], text: str) -> Path:
    """Write a text file atomically."""
    with atomic_file(path) as tmp:
        tmp.write_text(text)
    return Path(path)


def write_json(path: str | os.PathLike[str], obj: Any) -> Path:
    """Write JSON atomically, pretty-printed so DVC and humans can diff it."""
    return write_text(path, json.dumps(obj, indent=2, sort_keys=True) + "\n")


def sha256_file(path: str | os.PathLike[str]) -> str:
    """The sha256 of a file's bytes, read in 1 MiB pieces."""
    h = hashlib.sha256()
    with Path(path).open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def fingerprint(paths: Iterable[str | os.PathLike[str]]) -> str:
    """sha256 (first 16 hex) over files' names and contents: what identifies weights, data and inputs.

    A directory stands for every file under it, named by its path relative to the directory.
    """
    h = hashlib.sha256()
    for p in map(Path, paths):
        files = [(p.name, p)] if p.is_file() else [(str(f.relative_to(p)), f) for f in _files_under(p)]
        for name, f in files:
            h.update(name.encode())
            h.update(sha256_file(f).encode())
    return h.hexdigest()[:16]


def _files_under(root: Path) -> list[Path]:
    return sorted(f for f in root.rglob("*") if f.is_file())


def flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"a": {"b": 1}} -> {"a.b": 1}: MLflow params, checkpoint keys and config diffs."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out
