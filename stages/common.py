"""What every stage entry point shares: typed config, output paths, one MLflow run, clean errors.

A stage module is a thin Hydra app: `@hydra.main` composes the config (from `conf/`, or from
`params.yaml` when DVC runs it with `--config-dir . --config-name params`), then calls
`run_stage(name, cfg, body)`. `body` does the stage's work through one `pipeline` call and
returns its metrics.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any, TypeVar

from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import MissingMandatoryValue, OmegaConfBaseException

from pipeline.config import PipelineConfig
from pipeline.errors import ConfigError, PipelineError
from pipeline.files import fingerprint, write_json, write_text
from pipeline.gguf.reader import resolve_gguf_path
from pipeline.tracking import Run, Tracker, default_tracking_uri

CONFIG_PATH = "../conf"
T = TypeVar("T")
CONFIG_NAME = "config"


@dataclass(frozen=True)
class Paths:
    """Where each stage's outputs live, relative to the project root (DVC's working directory)."""

    root: Path

    @property
    def packed(self) -> Path:
        return self.root / "data" / "packed"

    @property
    def donor(self) -> Path:
        return self.root / "data" / "donor"

    @property
    def init(self) -> Path:
        return self.root / "models" / "init"

    @property
    def train(self) -> Path:
        return self.root / "models" / "train"

    @property
    def export(self) -> Path:
        return self.root / "models" / "export"

    @property
    def evaluate(self) -> Path:
        return self.root / "models" / "evaluate"

    def stage_out(self, stage: str) -> Path:
        return {"pack": self.packed, "realize": self.init}.get(stage) or getattr(self, stage)

    def metrics(self, stage: str) -> Path:
        return self.root / "metrics" / f"{stage}.json"

    def plots(self, stage: str) -> Path:
        return self.root / "plots" / stage


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
        if self.run is not None:
            self.run.log_metrics(metrics, step)

    @cached_property
    def donor(self) -> Path:
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


def fail(message: str, code: int = 2) -> None:
    """One line on stderr and a non-zero exit: never a traceback for a user mistake."""
    print(f"error: {message}", file=sys.stderr)
    sys.exit(code)


def typed_config(cfg: DictConfig) -> PipelineConfig:
    """Merge into the schema (types, unknown keys) and build the dataclasses (value checks)."""
    return structured_config(PipelineConfig, cfg)


def structured_config(schema: type[T], cfg: DictConfig, source: str = "params.yaml") -> T:
    """`cfg` merged into the dataclass `schema` and built (its __post_init__ checks values);
    `source` names the config file for the one-line error."""
    try:
        merged = OmegaConf.merge(OmegaConf.structured(schema), cfg)
        return OmegaConf.to_object(merged)
    except MissingMandatoryValue as e:
        raise ConfigError(
            f"config key {e.full_key}: expected a value, found ??? (mandatory); fix: set {e.full_key}=... on the "
            f"command line or in {source}"
        ) from None
    except OmegaConfBaseException as e:
        msg = str(e.msg if hasattr(e, "msg") and e.msg else e).splitlines()[0]
        key = getattr(e, "full_key", None) or "?"
        where = "conf/ or params.yaml" if source == "params.yaml" else source
        raise ConfigError(f"config key {key}: {msg}; fix: correct {key} in {where}") from None


def config_hash(resolved: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(resolved, sort_keys=True).encode()).hexdigest()[:16]


def git_commit(root: Path) -> str | None:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10, check=False
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def _hydra_job() -> tuple[bool, Path | None, str | None]:
    """(is multirun, this job's output dir, sweep dir) from Hydra's runtime config."""
    if not HydraConfig.initialized():
        return False, None, None
    hc = HydraConfig.get()
    multirun = hc.mode == RunMode.MULTIRUN
    return multirun, Path(hc.runtime.output_dir), str(Path(hc.sweep.dir).resolve()) if multirun else None


def run_stage(
    stage: str,
    cfg: DictConfig,
    body: Callable[[StageContext], dict[str, float]],
    resume_run: Callable[[PipelineConfig, Paths], str | None] | None = None,
) -> dict[str, float]:
    """Validate config, open the MLflow run, run `body`, write metrics; exit 2 on user errors.

    `resume_run` may name an existing MLflow run to reopen instead of starting one (a training
    run resumed from a checkpoint keeps logging to its run). Under torchrun only rank 0 tracks
    and writes metrics.
    """
    primary = int(os.environ.get("RANK", "0")) == 0
    try:
        typed = typed_config(cfg)
    except PipelineError as e:
        fail(str(e))
    resolved = OmegaConf.to_container(cfg, resolve=True)
    paths = Paths(Path.cwd().resolve())
    multirun, job_dir, sweep_dir = _hydra_job()
    if multirun:  # a sweep job keeps its outputs in its own Hydra job dir, not the DVC paths
        out_dir, metrics_path, plots_dir = job_dir / stage, job_dir / "metrics.json", job_dir / "plots"
    else:
        out_dir, metrics_path, plots_dir = paths.stage_out(stage), paths.metrics(stage), paths.plots(stage)
    try:
        resume_id = resume_run(typed, paths) if resume_run is not None else None
    except PipelineError as e:
        fail(str(e))
    run = _open_run(stage, typed, resolved, paths, sweep_dir, resume_id) if primary else None
    ctx = StageContext(stage, typed, resolved, paths, out_dir, metrics_path, plots_dir, run)
    try:
        metrics = body(ctx)
        if primary:
            write_json(metrics_path, metrics)
        if run is not None:
            run.log_metrics({k: v for k, v in metrics.items() if isinstance(v, (int, float))}, step=0)
            config_file = write_text(out_dir.parent / f".{stage}-config.yaml", OmegaConf.to_yaml(cfg, resolve=True))
            run.log_artifact(config_file)
            config_file.unlink(missing_ok=True)
            run.log_artifact(metrics_path)
            run.end("FINISHED")
    except PipelineError as e:
        if run is not None:
            run.set_tags({"error": str(e)})
            run.end(getattr(e, "mlflow_status", "FAILED"))
        fail(str(e), getattr(e, "exit_code", 2))
    except BaseException:
        if run is not None:
            run.end("KILLED" if not isinstance(sys.exc_info()[1], Exception) else "FAILED")
        raise
    return metrics


def _open_run(
    stage: str, cfg: PipelineConfig, resolved: dict, paths: Paths, sweep_dir: str | None, resume_id: str | None = None
) -> Run | None:
    if not cfg.tracking.enabled:
        return None
    tracker = Tracker(default_tracking_uri(paths.root), cfg.tracking.experiment, paths.root / "mlartifacts")
    if resume_id is not None and tracker.exists(resume_id):
        run = tracker.resume(resume_id)  # params were logged when it started
        run.set_tags({"resumed": "true"})
        return run
    tags = {
        "stage": stage,
        "recipe": cfg.recipe.name,
        "git_commit": git_commit(paths.root),
        "dvc_exp_name": os.environ.get("DVC_EXP_NAME"),
        "config_hash": config_hash(resolved),
    }
    parent = None
    if sweep_dir is not None:
        sweep_id = hashlib.sha256(sweep_dir.encode()).hexdigest()[:12]
        tags["sweep_id"] = sweep_id
        parent = tracker.sweep_parent(sweep_id, f"sweep-{stage}-{sweep_id}", {"stage": stage, "sweep_dir": sweep_dir})
    run = tracker.start(stage, tags, parent_run_id=parent)
    run.log_params(resolved)
    return run
