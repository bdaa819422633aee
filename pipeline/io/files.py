"""Files written whole or not at all, and the one way we fingerprint them.

Every output goes to a temp sibling and is renamed into place, so a crash or a user error never
leaves half a file or half a directory where a stage (or DVC) would take it for a result. A temp
name carries its writer's pid; the next write of the same path removes the temps of writers that
no longer run (a SIGKILL leaves them behind), and never those of a live one.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from pipeline.errors import PipelineError, one_line, problem


def _temp_sibling(path: Path, kind: str, suffix: str = "") -> Path:
    return path.with_name(f".{path.name}.{kind}-{os.getpid()}{suffix}")


def pid_alive(pid: int) -> bool:
    """Whether another process with this pid runs here (our own pid: a leftover of a dead one's)."""
    if pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        return True  # another user's process, or a number we cannot check: leave its file alone
    return True


def remove_stale_temps(path: str | os.PathLike[str]) -> list[Path]:
    """Remove the temp siblings of `path` (`.name.tmp-PID`, `.name.old-PID`, with any extension)
    whose writer no longer runs; returns what was removed."""
    path = Path(path)
    pattern = re.compile(rf"^\.{re.escape(path.name)}\.(?:tmp|old)-(\d+)(?:\.[A-Za-z0-9]+)?$")
    if not path.parent.is_dir():
        return []
    removed = []
    for p in path.parent.iterdir():
        m = pattern.match(p.name)
        if m and not pid_alive(int(m.group(1))):
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p, ignore_errors=True)
            else:
                p.unlink(missing_ok=True)
            removed.append(p)
    return removed


@contextmanager
def writable_output(path: Path) -> Iterator[None]:
    """Turn an OSError from creating, or renaming into place, the output `path` (a read-only
    directory or file system, a parent that is a file, a full disk) into one named line: without it
    the stage ended with a traceback. Only our own steps go through it, never the writer's body,
    whose OSErrors (a missing input, say) are not about the output."""
    try:
        yield
    except OSError as e:
        where = path.parent if path.parent.is_dir() else path
        raise PipelineError(
            problem(
                str(path),
                "an output path this process can create and replace",
                one_line(e),
                f"make {where} writable (or free space there), or run from a writable copy of the project",
            )
        ) from e


@contextmanager
def atomic_file(path: str | os.PathLike[str], suffix: str = "") -> Iterator[Path]:
    """Yield a temp path to write; it replaces `path` only if the block succeeds.

    `suffix` is for writers that insist on a file extension (numpy's `savez` adds `.npz`).
    """
    path = Path(path)
    with writable_output(path):
        path.parent.mkdir(parents=True, exist_ok=True)
        remove_stale_temps(path)
    tmp = _temp_sibling(path, "tmp", suffix)
    try:
        yield tmp
        with writable_output(path):
            os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


@contextmanager
def atomic_dir(path: str | os.PathLike[str]) -> Iterator[Path]:
    """Yield an empty temp directory that replaces `path` only if the block succeeds."""
    path = Path(path)
    tmp = _temp_sibling(path, "tmp")
    with writable_output(path):
        path.parent.mkdir(parents=True, exist_ok=True)
        remove_stale_temps(path)
        tmp.mkdir()
    try:
        yield tmp
        old = _temp_sibling(path, "old")
        with writable_output(path):
            if path.exists():
                os.replace(path, old)
            os.replace(tmp, path)
        shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def default_mode(path: str | os.PathLike[str]) -> Path:
    """Give `path` the permissions a plain `open()` would (0o666 less the umask). safetensors writes
    through a private temp file and keeps its 0o600, so a copied `peft/` folder or model dir was
    unreadable to anyone else (a server run as another user could not load the adapter)."""
    mask = os.umask(0)
    os.umask(mask)
    os.chmod(path, 0o666 & ~mask)
    return Path(path)


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
    named = []
    for p in map(Path, paths):
        files = [(p.name, p)] if p.is_file() else [(str(f.relative_to(p)), f) for f in _files_under(p)]
        named += [(name, sha256_file(f)) for name, f in files]
    return fingerprint_of(named)


def fingerprint_of(named: Iterable[tuple[str, str]]) -> str:
    """`fingerprint` from (name, sha256) pairs already computed: a caller that needs a file's sha256
    too reads the file once."""
    h = hashlib.sha256()
    for name, digest in named:
        h.update(name.encode())
        h.update(digest.encode())
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
