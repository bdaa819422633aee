"""The pipeline's outputs the report reads: every stage's `metrics/<stage>.json`, the DVC plots
(`plots/<stage>/*.tsv`) and the evaluate samples. All are small text files the stages write."""

from __future__ import annotations

import csv
import json
from dataclasses import dataclass, field
from pathlib import Path

from pipeline.errors import DataError, problem

STAGES = ("pack", "donor", "teach", "realize", "train", "export", "evaluate")
EVALUATE_METRICS = Path("metrics") / "evaluate.json"
SAMPLES = Path("models") / "evaluate" / "samples.json"


@dataclass
class Outputs:
    """What the stages left: metrics by stage (those that ran), plot tables by `<stage>/<name>`, samples."""

    metrics: dict[str, dict[str, float]] = field(default_factory=dict)
    plots: dict[str, list[dict[str, float]]] = field(default_factory=dict)
    samples: list[dict[str, str]] = field(default_factory=list)

    def plot(self, name: str) -> list[dict[str, float]]:
        return self.plots.get(name, [])


def check_ready(root: Path) -> None:
    """The report describes a finished pipeline: without the evaluate stage's metrics there is nothing to report."""
    path = Path(root) / EVALUATE_METRICS
    if not path.is_file():
        raise DataError(
            problem(str(EVALUATE_METRICS), "the evaluate stage's metrics", "no such file", _rerun("evaluate"))
        )


def read_outputs(root: Path) -> Outputs:
    """Every stage's metrics and plots under `root` (a stage that has not run is simply absent)."""
    root = Path(root)
    check_ready(root)
    out = Outputs()
    for stage in STAGES:
        path = root / "metrics" / f"{stage}.json"
        if path.is_file():
            out.metrics[stage] = _read_json(path, root, stage, dict)
    for path in sorted((root / "plots").glob("*/*.tsv")):
        out.plots[f"{path.parent.name}/{path.stem}"] = read_tsv(path, root)
    if (root / SAMPLES).is_file():
        out.samples = _read_json(root / SAMPLES, root, "evaluate", list)
    return out


def read_tsv(path: Path, root: Path) -> list[dict[str, float]]:
    """A plot table: a header row, then numbers (an empty cell is an absent value)."""
    try:
        with open(path, newline="") as f:
            rows = list(csv.DictReader(f, delimiter="\t"))
        return [{k: float(v) for k, v in row.items() if k and v not in (None, "")} for row in rows]
    except (OSError, ValueError, csv.Error) as e:
        where = str(path.relative_to(root))
        raise DataError(
            problem(where, "a tab-separated table of numbers", _short(e), _rerun(path.parent.name))
        ) from None


def _read_json(path: Path, root: Path, stage: str, kind: type) -> dict | list:
    where = str(path.relative_to(root))
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise DataError(problem(where, f"the {stage} stage's JSON", _short(e), _rerun(stage))) from None
    if not isinstance(value, kind):
        raise DataError(problem(where, f"a JSON {kind.__name__}", type(value).__name__, _rerun(stage)))
    return value


def _rerun(stage: str) -> str:
    return f"run: dvc repro {stage}" if stage == "evaluate" else f"re-run: dvc repro -f {stage}"


def _short(e: Exception) -> str:
    return f"unreadable ({type(e).__name__}: {' '.join(str(e).split())[:100]})"
