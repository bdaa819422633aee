"""The one module that touches MLflow, behind a small plain interface.

Stages open one `Run` per execution; the training loop only sees a `log_metrics(dict, step)`
callable. Metrics are buffered and sent in batches so per-step logging stays cheap.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.files import flatten

TRACKING_ENV = "MLFLOW_TRACKING_URI"


def default_tracking_uri(root: Path) -> str:
    """`MLFLOW_TRACKING_URI` if set, else a SQLite store at `<root>/mlflow.db` by absolute path."""
    return os.environ.get(TRACKING_ENV) or f"sqlite:///{Path(root).resolve() / 'mlflow.db'}"


@dataclass
class RunInfo:
    run_id: str
    experiment_id: str
    tracking_uri: str


class Run:
    """An open MLflow run: metrics (buffered), params, tags, artifacts, and its end status."""

    FLUSH_AT = 500

    def __init__(self, client, info: RunInfo):
        self._client = client
        self.info = info
        self._buffer: list = []

    @property
    def run_id(self) -> str:
        return self.info.run_id

    def log_params(self, params: dict[str, Any]) -> None:
        from mlflow.entities import Param  # mlflow takes over a second to import: only when a run is open

        items = [Param(k, str(v)[:6000]) for k, v in flatten(params).items()]
        for i in range(0, len(items), 100):
            self._client.log_batch(self.run_id, params=items[i : i + 100])

    def set_tags(self, tags: dict[str, Any]) -> None:
        for k, v in tags.items():
            if v is not None:
                self._client.set_tag(self.run_id, k, str(v))

    def log_metrics(self, metrics: dict[str, float], step: int = 0) -> None:
        from mlflow.entities import Metric

        ts = int(time.time() * 1000)
        self._buffer.extend(Metric(k, float(v), ts, step) for k, v in metrics.items())
        if len(self._buffer) >= self.FLUSH_AT:
            self.flush()

    def flush(self) -> None:
        while self._buffer:
            chunk, self._buffer = self._buffer[:1000], self._buffer[1000:]
            self._client.log_batch(self.run_id, metrics=chunk)

    def log_artifact(self, path: Path, artifact_path: str | None = None) -> None:
        self._client.log_artifact(self.run_id, str(path), artifact_path)

    def end(self, status: str = "FINISHED") -> None:
        self.flush()
        self._client.set_terminated(self.run_id, status)


class Tracker:
    """Creates runs in one experiment of one store."""

    def __init__(self, tracking_uri: str, experiment: str, artifact_root: Path | None = None):
        from mlflow.tracking import MlflowClient  # heavy: imported only when tracking is on

        self.tracking_uri = tracking_uri
        self._client = MlflowClient(tracking_uri=tracking_uri)
        exp = self._client.get_experiment_by_name(experiment)
        if exp is None:
            location = Path(artifact_root).resolve().as_uri() if artifact_root else None
            self.experiment_id = self._client.create_experiment(experiment, artifact_location=location)
        else:
            self.experiment_id = exp.experiment_id

    def start(self, name: str, tags: dict[str, Any], parent_run_id: str | None = None) -> Run:
        all_tags = {k: str(v) for k, v in tags.items() if v is not None}
        if parent_run_id:
            all_tags["mlflow.parentRunId"] = parent_run_id
        run = self._client.create_run(self.experiment_id, run_name=name, tags=all_tags)
        return Run(self._client, RunInfo(run.info.run_id, self.experiment_id, self.tracking_uri))

    def exists(self, run_id: str) -> bool:
        """Whether `run_id` is a run of this store (a checkpoint may come from another store)."""
        from mlflow.exceptions import MlflowException

        try:
            self._client.get_run(run_id)
        except MlflowException:
            return False
        return True

    def resume(self, run_id: str) -> Run:
        """Reopen an existing run (e.g. to keep logging after a restart)."""
        self._client.update_run(run_id, status="RUNNING")
        return Run(self._client, RunInfo(run_id, self.experiment_id, self.tracking_uri))

    def sweep_parent(self, sweep_id: str, name: str, tags: dict[str, Any]) -> str:
        """The parent run of a sweep: found by its `sweep_id` tag, created by the first job."""
        found = self._client.search_runs(
            [self.experiment_id],
            filter_string=f"tags.sweep_id = '{sweep_id}' and tags.sweep_parent = 'true'",
            max_results=1,
        )
        if found:
            return found[0].info.run_id
        run = self.start(name, {**tags, "sweep_id": sweep_id, "sweep_parent": "true"})
        run.end()
        return run.run_id
