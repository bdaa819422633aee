"""The user's files behind a run, fingerprinted so that DVC re-runs what they feed when one changes.

`data.path` and `donor.path` are strings in params.yaml: DVC sees a change of the string, not an
edit of the file. The `inputs` stage runs every time (it only hashes) and writes what the files
hold now to `data/inputs/corpus.json` and `data/inputs/donor.json`; pack and the stages after it
depend on those records. Editing `corpus.txt` in place or replacing the donor GGUF changes a record
and re-runs pack (and what follows); unchanged files leave the records byte-identical, so nothing
re-runs. The built-in sources record the stdlib module they are read from.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pipeline.config import DataConfig
from pipeline.data.corpus import source_files
from pipeline.errors import DataError, GGUFError, problem
from pipeline.io.files import atomic_dir, sha256_file, write_json

CORPUS_RECORD = "corpus.json"
DONOR_RECORD = "donor.json"
_RERUN = "run: dvc repro inputs"


def describe_file(path: Path, name: str) -> dict[str, Any]:
    return {"name": name, "bytes": path.stat().st_size, "sha256": sha256_file(path)}


def corpus_record(data: DataConfig) -> dict[str, Any]:
    """What the configured corpus is made of now: each file's name (relative to a directory source),
    size and sha256. Names, not absolute paths, so a temp copy of the project records the same."""
    root, files = source_files(data)
    described = [describe_file(f, str(f.relative_to(root)) if root else f.name) for f in files]
    return {"source": data.source, "path": data.path, "glob": data.glob if root else None, "files": described}


def donor_record(value: str, resolved: Path) -> dict[str, Any]:
    return {"path": value, "file": describe_file(resolved, resolved.name)}


def check_donor_file(value: str, resolved: Path, outputs: list[Path]) -> None:
    """The donor is a file, and not inside a stage's output folder (`outputs`): DVC deletes those before
    re-running their stage, so an exported GGUF used as the donor would vanish mid-pipeline."""
    where = f"donor.path={value}"
    if not resolved.exists():
        raise GGUFError(problem(where, "an existing GGUF file", f"no such file ({resolved})", "check the path"))
    if not resolved.is_file():
        raise GGUFError(problem(where, "a GGUF file", f"a directory or special file ({resolved})", "check the path"))
    for out in outputs:
        if resolved.is_relative_to(out.resolve()):
            raise GGUFError(
                problem(
                    where,
                    "a GGUF outside the stages' output folders (DVC deletes them before re-running a stage)",
                    f"a file in {out.name}/ ({resolved})",
                    f"copy it out first, e.g. mkdir -p donors && cp {resolved} donors/ and set donor.path=donors/"
                    f"{resolved.name}",
                )
            )


def run_inputs(
    data: DataConfig, donor_value: str, donor_file: Path, out_dir: Path, outputs: list[Path] = ()
) -> dict[str, Any]:
    """Write both records into `out_dir` (atomically, as one directory) and return them; `outputs`: the
    stages' output folders, where the donor must not be."""
    corpus = corpus_record(data)
    check_donor_file(donor_value, donor_file, list(outputs))
    records = {CORPUS_RECORD: corpus, DONOR_RECORD: donor_record(donor_value, donor_file)}
    with atomic_dir(out_dir) as tmp:
        for name, record in records.items():
            write_json(tmp / name, record)
    return records


def read_record(inputs_dir: Path, name: str = DONOR_RECORD) -> dict[str, Any]:
    """A record the inputs stage wrote (`donor.json`: what the donor file is), with a named error when absent."""
    path = Path(inputs_dir) / name
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise DataError(problem(str(path), "the inputs stage's record", "no such file", _RERUN)) from None
    except ValueError as e:
        raise DataError(problem(str(path), "a JSON record", f"unreadable ({e})", _RERUN)) from None
