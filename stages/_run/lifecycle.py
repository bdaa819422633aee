"""One stage execution, in explicit steps: `Stage(name, cfg, lineage)` checks the typed config, the
overrides and the lineage before anything runs; `stage.prepare(fn, ...)` runs any further plan the
same way (a refusal exits 2 and leaves nothing behind); `stage.run(body)` opens the stage's MLflow
run, runs `body` (its work, through one `pipeline` call, returning its metrics), writes the metrics
and closes the run. Under torchrun only rank 0 tracks and writes metrics.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property, partial
from pathlib import Path
from typing import Any, TypeVar

from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from pipeline.config import PipelineConfig
from pipeline.donor.locate import resolve_gguf_path
from pipeline.errors import PipelineError
from pipeline.io.files import fingerprint, write_json, write_text
from pipeline.tracking import Run, project_root
from stages._run import output
from stages._run.cut import apply_cut
from stages._run.exits import config_failed, fail, refuse
from stages._run.mlflow_runs import open_run, summarize_parent
from stages._run.overrides import check_overrides
from stages._run.paths import Paths
from stages._run.signals import restore_sigterm, stop_on_sigterm, stopped
from stages._run.typed import typed_config

CONFIG_PATH = "../conf"  # relative to the entry point's module (stages/<name>.py)
CONFIG_NAME = "config"
T = TypeVar("T")
# MLflow's run page draws one chart per key, in sections by prefix (alphabetical, unprefixed last):
# the loss curves share the first section, the single-value summaries (`summary/`) the next.
# With distillation the train loss's two parts are charted beside it (`loss/train_ce`, `loss/train_kd`).
MLFLOW_NAMES = {
    "train_loss": "loss/train",
    "val_loss": "loss/val",
    "train_ce": "loss/train_ce",
    "train_kd": "loss/train_kd",
}


@dataclass
class StageContext:
    """Everything a stage body needs: typed config, paths, its output locations, tracking."""

    stage: str
    cfg: PipelineConfig
    resolved: dict[str, Any]
    paths: Paths
    out_dir: Path  # this stage's output directory (the DVC path, or the job dir in a sweep)
    metrics_path: Path
    plots_dir: Path
    run: Run | None
    inputs: dict[str, str] = field(default_factory=dict)

    def log(self, metrics: dict[str, float], step: int) -> None:
        """Per-step metrics to MLflow; the losses as `loss/train`, `loss/val` (see MLFLOW_NAMES)."""
        if self.run is not None:
            self.run.log_metrics({MLFLOW_NAMES.get(k, k): v for k, v in metrics.items()}, step)

    @cached_property
    def donor_gguf(self) -> Path:
        """The donor (or fine-tune base) GGUF, resolved once from `donor.path` (`smollm2`: the packaged one)."""
        return resolve_gguf_path(self.cfg.donor.path)

    def add_input(self, name: str, path: Path) -> None:
        """Record an input's fingerprint as an MLflow tag `input.<name>`."""
        self.inputs[name] = fingerprint([path])
        if self.run is not None:
            self.run.set_tags({f"input.{name}": self.inputs[name]})

    def artifact(self, path: Path, artifact_path: str | None = None) -> None:
        if self.run is not None and Path(path).exists():
            self.run.log_artifact(path, artifact_path)

    @property
    def run_id(self) -> str | None:
        return None if self.run is None else self.run.run_id


class Stage:
    """A stage between its checks and its work; see the module docstring for the steps."""

    def __init__(
        self,
        name: str,
        cfg: DictConfig,
        lineage: Callable[[PipelineConfig, Paths], dict[str, str]] | None = None,
        train_tokens: Callable[[Path], int] | None = None,
    ):
        """`train_tokens` (the stages that read the cut's keys): the packed train split's tokens, which
        size the donor's cut where model.n_layer, optim.lr, train.steps or train.eval_every are 0."""
        self.name, self.raw = name, cfg
        try:
            self.cfg = typed_config(cfg)
            output.configure(self.cfg.output)
            check_overrides(name, cfg)
        except PipelineError as e:
            config_failed(e)
        self.resolved = OmegaConf.to_container(cfg, resolve=True)
        self.paths = Paths.here()
        if train_tokens is not None:
            tokens = partial(train_tokens, self.paths.packed)
            self.cfg, self.resolved = self.prepare(apply_cut, name, self.cfg, self.resolved, tokens)
        self.tags = self.prepare(lineage, self.cfg, self.paths) if lineage is not None else {}

    def prepare(self, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)` before the MLflow run opens: a refused value ends the stage with one line, exit 2."""
        try:
            return fn(*args)
        except PipelineError as e:
            refuse(str(e))

    def run(self, body: Callable[[StageContext], dict[str, float]], resume_run_id: str | None = None) -> dict:
        """Open the MLflow run (`resume_run_id`: reopen that one), run `body`, write its metrics; a user
        error ends the run FAILED (KILLED for a stop request) and exits with the error's code."""
        primary = int(os.environ.get("RANK", "0")) == 0
        out_dir, metrics_path, plots_dir = _outputs(self.name, self.paths)
        run, parent = (None, None)
        if primary:
            root, digest = project_root(self.paths.root), config_hash(self.resolved)
            run, parent = open_run(self.name, self.cfg, self.resolved, root, digest, resume_run_id)
        if run is not None:
            run.set_tags(self.tags)
        ctx = StageContext(self.name, self.cfg, self.resolved, self.paths, out_dir, metrics_path, plots_dir, run)
        status = "FAILED"
        previous = stop_on_sigterm()
        try:
            metrics = body(ctx)
            _write_results(ctx, self.raw, metrics, primary)
            summarize_parent(parent, self.name, metrics)
            status = "FINISHED"
        except PipelineError as e:
            status = e.status.upper()
            if run is not None:
                run.set_tags({"error": str(e)})
                run.end(status)
            fail(str(e), e.exit_code)
        except BaseException as e:
            status = "KILLED" if not isinstance(e, Exception) else "FAILED"
            if run is not None:
                run.end(status)
            if isinstance(e, KeyboardInterrupt):
                fail(*stopped(self.name, e))
            raise
        finally:
            restore_sigterm(previous)
            if parent is not None:
                parent.end(status)
        return metrics


def run_stage(
    stage: str,
    cfg: DictConfig,
    body: Callable[[StageContext], dict[str, float]],
    lineage: Callable[[PipelineConfig, Paths], dict[str, str]] | None = None,
    train_tokens: Callable[[Path], int] | None = None,
) -> dict[str, float]:
    """The common case: check (`lineage`: the config against what the stage's inputs were made with,
    returning tags for the run), then run `body`."""
    return Stage(stage, cfg, lineage, train_tokens).run(body)


def config_hash(resolved: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(resolved, sort_keys=True).encode()).hexdigest()[:16]


def _outputs(stage: str, paths: Paths) -> tuple[Path, Path, Path]:
    """(output dir, metrics file, plots dir): the DVC paths, or a sweep job's own Hydra job dir."""
    if HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN:
        job_dir = Path(HydraConfig.get().runtime.output_dir)
        return job_dir / stage, job_dir / "metrics.json", job_dir / "plots"
    return paths.out(stage), paths.metrics(stage), paths.plots(stage)


def _write_results(ctx: StageContext, cfg: DictConfig, metrics: dict[str, float], primary: bool) -> None:
    """The metrics file and `output=json` line (rank 0), then the MLflow run's summary (FINISHED)."""
    if primary:
        write_json(ctx.metrics_path, metrics)
        output.emit_json(ctx.cfg.output, ctx.stage, metrics, ctx.run_id)
    if ctx.run is not None:
        _finish(ctx.run, ctx.stage, cfg, metrics, ctx.metrics_path, ctx.out_dir)


def _finish(run: Run, stage: str, cfg: DictConfig, metrics: dict, metrics_path: Path, out_dir: Path) -> None:
    """The stage's summary metrics (under `summary/`, so the UI shows the curves first and keeps the
    single values in a section of their own), resolved config, metrics file and log file; then FINISHED."""
    run.log_metrics({f"summary/{k}": v for k, v in metrics.items() if isinstance(v, (int, float))}, step=0)
    config_file = write_text(out_dir.parent / f".{stage}-config.yaml", OmegaConf.to_yaml(cfg, resolve=True))
    run.log_artifact(config_file)
    config_file.unlink(missing_ok=True)
    run.log_artifact(metrics_path)
    logfile = output.log_file()
    if logfile and Path(logfile).is_file():
        for handler in logging.getLogger().handlers:
            handler.flush()
        run.log_artifact(Path(logfile), "logs")
    run.end("FINISHED")
