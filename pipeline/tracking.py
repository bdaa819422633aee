"""The one module that touches MLflow, behind a small plain interface.

Stages open one `Run` per execution; the training loop only sees a `log_metrics(dict, step)`
callable. Metrics are buffered and sent in batches so per-step logging stays cheap. A reopened run
(training resumed from a checkpoint after a kill) holds one value per step: the steps the killed
process had already sent are not sent again. Parent runs
(one per pipeline execution, one per sweep) are found or created under a machine-wide file lock,
so parallel jobs never make two parents, and a fresh SQLite store is initialised by one process.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from filelock import FileLock

from pipeline.io.files import flatten

TRACKING_ENV = "MLFLOW_TRACKING_URI"
PROJECT_ROOT_ENV = "DVC_ROOT"  # DVC sets it to the project (not the temp copy) for queued/temp experiments
LOCAL_SCHEMES = ("sqlite", "file", "")
VAL_DATA_TAG = "val_data"  # an evaluate run's val split (`packed.split_fingerprint`): the report compares like runs
T = TypeVar("T")


def project_root(cwd: Path) -> Path:
    """The project a stage belongs to: DVC's `DVC_ROOT` (a queued or `--temp` experiment runs in a
    temp copy that is deleted afterwards), else `cwd`."""
    return Path(os.environ.get(PROJECT_ROOT_ENV) or cwd).resolve()


def default_tracking_uri(root: Path) -> str:
    """`MLFLOW_TRACKING_URI` if set, else a SQLite store at `<root>/mlflow.db` by absolute path."""
    return os.environ.get(TRACKING_ENV) or f"sqlite:///{Path(root).resolve() / 'mlflow.db'}"


def is_local_store(uri: str) -> bool:
    """A store on this machine's disk (SQLite or a file store), where we choose the artifact folder."""
    if uri.lower().startswith("databricks"):
        return False
    return uri.split(":", 1)[0].lower() in LOCAL_SCHEMES if ":" in uri else True


@contextmanager
def store_lock(uri: str) -> Iterator[None]:
    """One writer at a time for the steps that must not race (schema creation, find-or-create)."""
    name = hashlib.sha256(uri.encode()).hexdigest()[:16]
    with FileLock(str(Path(tempfile.gettempdir()) / f"smollm-mlflow-{name}.lock"), timeout=120):
        yield


def _retry(call: Callable[[], T], attempts: int = 8) -> T:
    """SQLite refuses a write while another process holds its lock: wait and try again."""
    for i in range(attempts):
        try:
            return call()
        except Exception as e:  # noqa: BLE001 - MLflow wraps sqlite's OperationalError in several types
            if "database is locked" not in str(e) or i == attempts - 1:
                raise
            time.sleep(0.2 * (i + 1))
    raise AssertionError("unreachable")


@dataclass
class RunInfo:
    run_id: str
    experiment_id: str
    tracking_uri: str


class Run:
    """An open MLflow run: metrics (buffered), params, tags, artifacts, and its end status."""

    FLUSH_AT = 500

    def __init__(self, client, info: RunInfo, logged: dict[str, int] | None = None):
        """`logged`: per metric key, the highest step the store already holds (a reopened run)."""
        self._client = client
        self.info = info
        self._buffer: list = []
        self._logged = logged or {}

    @property
    def run_id(self) -> str:
        return self.info.run_id

    def log_params(self, params: dict[str, Any]) -> None:
        from mlflow.entities import Param  # mlflow takes over a second to import: only when a run is open

        items = [Param(k, str(v)[:6000]) for k, v in flatten(params).items()]
        for i in range(0, len(items), 100):
            _retry(lambda i=i: self._client.log_batch(self.run_id, params=items[i : i + 100]))

    def set_tags(self, tags: dict[str, Any]) -> None:
        from mlflow.entities import RunTag

        items = [RunTag(k, str(v)) for k, v in tags.items() if v is not None]
        if items:
            _retry(lambda: self._client.log_batch(self.run_id, tags=items))

    def log_metrics(self, metrics: dict[str, float], step: int = 0) -> None:
        from mlflow.entities import Metric

        ts = int(time.time() * 1000)
        # MLflow cannot delete a value: a resumed run skips the steps its killed process already sent
        # (a resume is bit-identical, so they are the same values), leaving one value per step
        fresh = {k: v for k, v in metrics.items() if step > self._logged.get(k, -1)}
        self._buffer.extend(Metric(k, float(v), ts, step) for k, v in fresh.items())
        if len(self._buffer) >= self.FLUSH_AT:
            self.flush()

    def flush(self) -> None:
        while self._buffer:
            chunk = self._buffer[:1000]
            _retry(lambda chunk=chunk: self._client.log_batch(self.run_id, metrics=chunk))
            self._buffer = self._buffer[1000:]

    def log_artifact(self, path: Path, artifact_path: str | None = None) -> None:
        self._client.log_artifact(self.run_id, str(path), artifact_path)

    def parent_id(self) -> str | None:
        """The run that groups this one (the pipeline execution or the sweep), if any."""
        return _retry(lambda: self._client.get_run(self.run_id)).data.tags.get("mlflow.parentRunId")

    def log_artifact_to(self, run_id: str, path: Path, artifact_path: str | None = None) -> None:
        """An artifact on another run of this store (a stage's report on its pipeline's parent run)."""
        self._client.log_artifact(run_id, str(path), artifact_path)

    def log_figure(self, figure: Any, artifact_file: str) -> None:
        """A matplotlib figure as an image artifact (shown in the run's Artifacts tab)."""
        self._client.log_figure(self.run_id, figure, artifact_file)

    def end(self, status: str = "FINISHED") -> None:
        self.flush()
        _retry(lambda: self._client.set_terminated(self.run_id, status))


class Tracker:
    """Creates runs in one experiment of one store."""

    def __init__(self, tracking_uri: str, experiment: str, artifact_root: Path | None = None):
        from mlflow.tracking import MlflowClient  # heavy: imported only when tracking is on

        self.tracking_uri = tracking_uri
        with store_lock(tracking_uri):  # the client creates a fresh store's schema: one process at a time
            self._client = MlflowClient(tracking_uri=tracking_uri)
            exp = self._client.get_experiment_by_name(experiment)
            if exp is None:
                local = artifact_root is not None and is_local_store(tracking_uri)
                location = Path(artifact_root).resolve().as_uri() if local else None
                self.experiment_id = self._client.create_experiment(experiment, artifact_location=location)
            else:
                self.experiment_id = exp.experiment_id

    def start(self, name: str, tags: dict[str, Any], parent_run_id: str | None = None) -> Run:
        all_tags = {k: str(v) for k, v in tags.items() if v is not None}
        if parent_run_id:
            all_tags["mlflow.parentRunId"] = parent_run_id
        run = _retry(lambda: self._client.create_run(self.experiment_id, run_name=name, tags=all_tags))
        return Run(self._client, RunInfo(run.info.run_id, self.experiment_id, self.tracking_uri))

    def reopenable(self, run_id: str) -> bool:
        """Whether a checkpoint's run may be reopened: a run of this store that did not finish (a
        killed or crashed training). A FINISHED run belongs to the execution that completed it (another
        DVC experiment, another sweep's job with the same config): reopening it logged this execution
        into that one, and left this execution's parent without its run."""
        from mlflow.exceptions import MlflowException

        try:
            return _retry(lambda: self._client.get_run(run_id)).info.status != "FINISHED"
        except MlflowException:
            return False

    def resume(self, run_id: str) -> Run:
        """Reopen an existing run (e.g. to keep logging after a restart)."""
        _retry(lambda: self._client.update_run(run_id, status="RUNNING"))
        return Run(self._client, RunInfo(run_id, self.experiment_id, self.tracking_uri), self.logged_steps(run_id))

    def logged_steps(self, run_id: str) -> dict[str, int]:
        """Per metric key of `run_id`, the highest step the store holds (read once, on reopening)."""
        keys = _retry(lambda: self._client.get_run(run_id)).data.metrics
        return {k: max(m.step for m in _retry(lambda k=k: self._client.get_metric_history(run_id, k))) for k in keys}

    def parent(self, key_tag: str, key: str, name: str, tags: dict[str, Any], params: dict | None = None) -> Run:
        """The parent run whose tag `key_tag` is `key`: found, or created by the first caller.

        A pipeline execution's stages and a sweep's jobs all call this; the lock makes the
        search-then-create atomic across processes on this machine.
        """
        with store_lock(self.tracking_uri):
            found = self._client.search_runs(
                [self.experiment_id], filter_string=f"tags.{key_tag} = '{key}' and tags.parent = 'true'", max_results=1
            )
            if found:
                return self.resume(found[0].info.run_id)
            run = self.start(name, {**tags, key_tag: key, "parent": "true"})
            if params:
                run.log_params(params)
            return run


@dataclass
class RunRecord:
    """A run read back from the store as plain data (times in ms since the epoch)."""

    run_id: str
    name: str
    status: str
    start_ms: int
    end_ms: int | None
    tags: dict[str, str]
    params: dict[str, str]
    metrics: dict[str, float]


def stage_runs(tracking_uri: str, experiment: str, stage: str, max_results: int = 50) -> list[RunRecord]:
    """The newest finished runs of `stage` (tag `stage`) in `experiment`, newest first; [] when the
    store or the experiment does not exist (a local SQLite file is never created just to be read)."""
    if tracking_uri.startswith("sqlite:///") and not Path(tracking_uri.removeprefix("sqlite:///")).is_file():
        return []
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=tracking_uri)
    exp = _retry(lambda: client.get_experiment_by_name(experiment))
    if exp is None:
        return []
    found = _retry(
        lambda: client.search_runs(
            [exp.experiment_id],
            filter_string=f"tags.stage = '{stage}' and attributes.status = 'FINISHED'",
            max_results=max_results,
            order_by=["attributes.start_time DESC"],
        )
    )
    return [
        RunRecord(
            r.info.run_id,
            r.info.run_name or r.info.run_id,
            r.info.status,
            r.info.start_time,
            r.info.end_time,
            dict(r.data.tags),
            dict(r.data.params),
            dict(r.data.metrics),
        )
        for r in found
    ]
