"""Training checkpoints that survive a crash: atomic step directories, checksums, newest-valid lookup.

Layout: `<checkpoint_dir>/<key>/step-<N>/` where `key` hashes everything that must match for a
resume to continue the same run (model shape, initial weights, data, seed, the trajectory-shaping
train/optim settings), so `train.resume=auto` only ever sees compatible checkpoints. A step
directory is written as a temp sibling and renamed into place, and its `state.json` (written
last) lists a sha256 per file: a checkpoint is valid only if every file is there with that hash.
A crash mid-write leaves a temp directory (ignored, removed later) and the previous checkpoints
intact. The directory lives outside DVC's outs, because DVC deletes a stage's outs before it
re-runs the stage.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from pipeline.errors import CheckpointError, problem
from pipeline.io.files import atomic_dir, flatten, pid_alive, sha256_file
from pipeline.io.records import field_problems

FORMAT = 1
STATE_FILE = "state.json"
_STEP_DIR = re.compile(r"^step-(\d+)$")
_TEMP_DIR = re.compile(r"^\.step-\d+\.(?:tmp|old)-(\d+)$")

log = logging.getLogger(__name__)


def config_key(compat: dict[str, Any]) -> str:
    """The directory name for one resumable configuration."""
    return hashlib.sha256(json.dumps(flatten(compat), sort_keys=True).encode()).hexdigest()[:16]


def differences(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """`key (checkpoint X, now Y)` for every flattened key whose value differs."""
    a, b = flatten(saved), flatten(current)
    return [
        f"{k} (checkpoint {a.get(k, '<absent>')!r}, now {b.get(k, '<absent>')!r})"
        for k in sorted(set(a) | set(b))
        if a.get(k) != b.get(k)
    ]


@dataclass
class LoopState:
    """The loop's own counters: with weights, optimizer, sampler and RNGs, what a checkpoint saves."""

    step: int = 0  # optimizer steps done
    history: list[dict[str, float]] = field(default_factory=list)  # one row per logged step
    skipped_steps: int = 0
    seconds: float = 0.0  # training time before this process took over
    initial_val_loss: float | None = None  # instruct rows: val loss before the first step (the base's)
    epoch_losses: list[float] = field(default_factory=list)  # train losses of the epoch in progress
    best_val_loss: float | None = None  # the lowest val loss so far (train.keep_best, early stopping)
    best_step: int = 0  # the step it was measured at
    evals_since_best: int = 0  # evaluations since then (train.early_stop_patience)
    stopped_early: bool = False  # a checkpoint written when early stopping ended the run

    @classmethod
    def from_checkpoint(cls, state: dict[str, Any]) -> LoopState:
        return cls(**{f.name: state[f.name] for f in fields(cls) if f.name in state})


@dataclass
class _Saved:
    """The keys `write` and `save_checkpoint` put in every state besides the loop state's."""

    step: int
    files: dict[str, str]
    mlflow_run_id: str | None = None
    compat: dict[str, Any] | None = None
    sampler: dict[str, Any] | None = None
    rng: dict[str, Any] | None = None


@dataclass(frozen=True)
class Checkpoint:
    """A validated step directory and its state."""

    path: Path
    state: dict[str, Any]

    @property
    def step(self) -> int:
        return int(self.state["step"])

    @property
    def run_id(self) -> str | None:
        return self.state.get("mlflow_run_id")


def step_name(step: int) -> str:
    return f"step-{step:08d}"


def step_dirs(root: Path) -> list[tuple[int, Path]]:
    """(step, dir) of the finished step directories under `root`, newest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if p.is_dir() and (m := _STEP_DIR.match(p.name))]
    return sorted(found, reverse=True)


def validate(path: Path) -> Checkpoint:
    """The checkpoint at `path`, or CheckpointError naming what is wrong with it."""
    path = Path(path)
    state_path = path / STATE_FILE
    try:
        state = json.loads(state_path.read_text())
    except FileNotFoundError:
        raise CheckpointError(problem(str(state_path), "a checkpoint state file", "no such file", _FIX)) from None
    except (OSError, ValueError) as e:
        raise CheckpointError(problem(str(state_path), "valid JSON", f"{type(e).__name__}", _FIX)) from None
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        found = repr(state.get("format")) if isinstance(state, dict) else type(state).__name__
        raise CheckpointError(problem(str(state_path), f"format {FORMAT}", found, _FIX))
    wrong = field_problems(state, _Saved) + field_problems(state, LoopState)
    if wrong:
        raise CheckpointError(problem(str(state_path), "a checkpoint state as train writes it", "; ".join(wrong), _FIX))
    for name, digest in state.get("files", {}).items():
        f = path / name
        if not f.is_file():
            raise CheckpointError(problem(str(f), "a checkpoint file", "no such file", _FIX))
        if sha256_file(f) != digest:
            raise CheckpointError(problem(str(f), f"sha256 {digest[:12]}...", "a different checksum (corrupt)", _FIX))
    return Checkpoint(path, state)


_FIX = (
    "delete that step directory (train.resume=auto skips it and resumes from the one before), "
    "or start over with train.resume=never"
)


def newest_valid(
    root: Path, report: Callable[[str], None] | None = None, if_none: str = "starting from step 0"
) -> Checkpoint | None:
    """The newest checkpoint under `root` that validates; each corrupt newer one is reported, the
    oldest with `if_none` (what happens when nothing validates)."""
    report = report or _warn
    paths = [path for _, path in step_dirs(root)]
    for i, path in enumerate(paths):
        try:
            return validate(path)
        except CheckpointError as e:  # the last one says so: no resume, the run starts at step 0
            then = "trying the one before it" if i + 1 < len(paths) else f"no older checkpoint, {if_none}"
            report(f"corrupt checkpoint skipped, {then}: {e}")
    return None


def resolve(path: Path, report: Callable[[str], None] | None = None) -> Checkpoint:
    """An explicit `train.resume=<dir>`: a step directory, or a config directory (its newest valid)."""
    path = Path(path)
    if (path / STATE_FILE).is_file():
        return validate(path)
    found = newest_valid(path, report, if_none="nothing to resume from")
    if found is None:
        raise CheckpointError(
            problem(
                "config key train.resume",
                "a checkpoint directory (step-N/ with state.json, or a directory of them)",
                str(path),
                "point train.resume at checkpoints/<key>/step-N or use train.resume=auto",
            )
        )
    return found


def _warn(message: str) -> None:
    log.warning(f"warning: {message}")


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write(root: Path, step: int, fill: Callable[[Path], None], state: dict[str, Any], keep: int) -> Path:
    """Write one checkpoint atomically, then keep only the newest `keep` (by step) under `root`.

    `fill` writes the checkpoint's files into the directory it is given; `state` (JSON) is written
    last with a checksum per file, so a directory without a matching state is never taken for a
    checkpoint.
    """
    root = Path(root)
    remove_abandoned_writes(root)
    final = root / step_name(step)
    with atomic_dir(final) as tmp:
        fill(tmp)
        files = {}
        for f in sorted(tmp.iterdir()):
            _fsync(f)
            files[f.name] = sha256_file(f)
        (tmp / STATE_FILE).write_text(json.dumps({**state, "format": FORMAT, "step": step, "files": files}) + "\n")
        _fsync(tmp / STATE_FILE)
    _fsync(root)
    prune(root, keep)
    return final


def prune(root: Path, keep: int) -> None:
    """Remove all but the newest `keep` step directories."""
    for _, path in step_dirs(root)[keep:]:
        shutil.rmtree(path, ignore_errors=True)


def remove_newer(root: Path, step: int) -> None:
    """Drop checkpoints past `step`: a fresh (`resume=never`) run supersedes an older run's."""
    for s, path in step_dirs(root):
        if s > step:
            shutil.rmtree(path, ignore_errors=True)


def remove_abandoned_writes(root: Path) -> None:
    """Temp/old directories left by a process that died mid-write (its pid no longer runs)."""
    if not Path(root).is_dir():
        return
    for p in Path(root).iterdir():
        m = _TEMP_DIR.match(p.name)
        if m and not pid_alive(int(m.group(1))):
            shutil.rmtree(p, ignore_errors=True)
