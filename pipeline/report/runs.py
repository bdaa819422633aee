"""This run among the MLflow runs: which stored run made each stage's current metrics (its timing),
and the newest evaluate runs of the experiment to compare with. The stage reads the store through
`pipeline.tracking`; this module only sees the runs as plain records."""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import datetime, timezone

from pipeline.io.files import flatten
from pipeline.tracking import VAL_DATA_TAG, RunRecord

COMPARED_METRICS = ("val_loss", "val_ppl", "val_bpb", "gap_to_donor")
IGNORED_PARAMS = ("output", "tracking.", "report.", "evaluate.prompts")  # how a run reports, not what it is
DIFF_KEYS = 4  # params named per compared run


@dataclass
class Compared:
    """One evaluate run as the comparison table shows it."""

    name: str
    recipe: str
    commit: str
    started: str
    metrics: dict[str, float]
    differs: str
    this: bool
    same_val: bool | None = None  # measured on this run's val split (None: a run without the tag)


def same_metrics(run: RunRecord, metrics: dict[str, object]) -> bool:
    """Whether `run` logged exactly these single values (as `summary/<key>`): the run that wrote the file."""
    for key, value in metrics.items():
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            continue
        logged = run.metrics.get(f"summary/{key}")
        if logged is None:
            return False
        if not (logged == value or (math.isnan(logged) and math.isnan(value))):
            return False
    return True


def producing_run(metrics: dict[str, object], runs: list[RunRecord]) -> RunRecord | None:
    """The newest of `runs` (newest first) that logged `metrics`; None when tracking was off or the store is another."""
    return next((r for r in runs if same_metrics(r, metrics)), None)


def started(run: RunRecord) -> str:
    return datetime.fromtimestamp(run.start_ms / 1000, tz=timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


def seconds(run: RunRecord) -> float | None:
    return None if run.end_ms is None else (run.end_ms - run.start_ms) / 1000


def compare(current: dict[str, float], config: dict, runs: list[RunRecord], limit: int) -> list[Compared]:
    """The newest `limit` evaluate runs (and this run's, wherever it falls), each with the params
    where it differs from this run's config."""
    mine = producing_run(current, runs)
    chosen = runs[:limit]
    if mine is not None and mine not in chosen:
        chosen = [*chosen, mine]
    base = mine.params if mine is not None else {k: str(v) for k, v in flatten(config).items()}
    val = mine.tags.get(VAL_DATA_TAG) if mine is not None else None
    return [
        Compared(
            name=r.name.removesuffix("/evaluate"),
            recipe=r.tags.get("recipe", ""),
            commit=(r.tags.get("git_commit") or "")[:7],
            started=started(r),
            metrics={k: r.metrics[f"summary/{k}"] for k in COMPARED_METRICS if f"summary/{k}" in r.metrics},
            differs="" if r is mine else differences(base, r.params),
            this=r is mine,
            same_val=None if val is None or VAL_DATA_TAG not in r.tags else r.tags[VAL_DATA_TAG] == val,
        )
        for r in chosen
    ]


def differences(base: dict[str, str], other: dict[str, str]) -> str:
    """`key=value` for the params `other` set differently from `base` (the first few, then a count)."""
    keys = sorted(k for k in base.keys() | other.keys() if base.get(k) != other.get(k) and not _ignored(k))
    shown = [f"{k}={_short(other.get(k, '(unset)'))}" for k in keys[:DIFF_KEYS]]
    more = len(keys) - DIFF_KEYS
    return ", ".join(shown) + (f", +{more} more" if more > 0 else "") if keys else "(same config)"


def _ignored(key: str) -> bool:
    return any(key == p or (p.endswith(".") and key.startswith(p)) for p in IGNORED_PARAMS)


def _short(value: str, width: int = 24) -> str:
    return value if len(value) <= width else value[: width - 1] + "…"
