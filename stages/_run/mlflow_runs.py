"""One MLflow run per stage execution, under the parent that groups it.

- `dvc repro` / `dvc exp run` (DVC sets `DVC_STAGE`): one parent per pipeline execution, found by
  the id of the DVC process running the stages, named after the DVC experiment (or `repro@<commit>`);
  the stage runs are its children, named `<parent>/<stage>`.
- A Hydra multirun (basic, joblib or Optuna sweeper): one parent per sweep directory; the jobs are
  its children, named after their overrides (`lr=0.003/train`).
- A stage run by hand: a top-level run named after the stage.

Every run carries MLflow's own source tags (`mlflow.source.name`, `mlflow.source.git.commit`,
`mlflow.user`), the DVC experiment name, the git commit, the recipe and a hash of the config.
"""

from __future__ import annotations

import getpass
import hashlib
import os
import socket
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import yaml
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import OmegaConf

from pipeline.config import PipelineConfig
from pipeline.tracking import Run, Tracker, default_tracking_uri

NAME_CHARS = 80


@dataclass(frozen=True)
class Group:
    """The parent a run belongs to: its identity tag, its key and its display name."""

    key_tag: str
    key: str
    name: str
    tags: dict[str, str]


def git_commit(root: Path) -> str | None:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10, check=False
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def dvc_process_id() -> str | None:
    """Host, pid and start time of the `dvc` process running this stage, or None outside DVC."""
    if "DVC_STAGE" not in os.environ:
        return None
    try:
        proc = psutil.Process().parent()
        while proc is not None:
            cmd = proc.cmdline()
            if any(Path(c).name == "dvc" for c in cmd[:2]) or cmd[1:3] == ["-m", "dvc"]:
                return f"{socket.gethostname()}:{proc.pid}:{proc.create_time():.3f}"
            proc = proc.parent()
    except psutil.Error:
        return None
    return None


def sweep_job() -> tuple[str, str] | None:
    """(sweep dir, this job's short override label) in a Hydra multirun, else None."""
    if not HydraConfig.initialized() or HydraConfig.get().mode != RunMode.MULTIRUN:
        return None
    hc = HydraConfig.get()
    label = ",".join(_short(o) for o in hc.overrides.task) or f"job{hc.job.num}"
    return str(Path(hc.sweep.dir).resolve()), label[:NAME_CHARS]


def _short(override: str) -> str:
    key, _, value = override.partition("=")
    return f"{key.lstrip('+~').rsplit('.', 1)[-1]}={value}"


def sweep_overrides(sweep_dir: Path) -> str | None:
    """The sweep's command-line overrides as typed (`optim.lr=1e-3,3e-4`), from the `multirun.yaml`
    Hydra's sweeper writes before the first job; None where a sweeper writes none."""
    try:
        task = OmegaConf.select(OmegaConf.load(sweep_dir / "multirun.yaml"), "hydra.overrides.task", default=None)
    except (OSError, ValueError, yaml.YAMLError):
        return None
    return " ".join(str(o) for o in task) if task else None


def group(stage: str, commit: str | None) -> tuple[Group | None, str]:
    """The parent group of this run (or None) and the run's own name."""
    sweep = sweep_job()
    if sweep is not None:
        sweep_dir, label = sweep
        sweep_id = hashlib.sha256(sweep_dir.encode()).hexdigest()[:12]
        tags = {"stage": stage, "sweep_dir": sweep_dir, "sweep_overrides": sweep_overrides(Path(sweep_dir))}
        return Group("sweep_id", sweep_id, f"sweep-{stage}-{sweep_id}", tags), f"{label}/{stage}"
    pid = dvc_process_id()
    if pid is None:
        return None, stage
    exp = os.environ.get("DVC_EXP_NAME")
    name = exp or f"repro@{(commit or 'nogit')[:7]}"
    key = hashlib.sha256(pid.encode()).hexdigest()[:16]
    return Group("pipeline_id", key, name, {"dvc_exp_name": exp, "dvc_process": pid}), f"{name}/{stage}"


def source_tags(stage: str, commit: str | None) -> dict[str, Any]:
    """MLflow's own source fields, which its UI shows for every run."""
    return {
        "mlflow.source.type": "LOCAL",
        "mlflow.source.name": f"stages/{stage}.py",
        "mlflow.source.git.commit": commit,
        "mlflow.user": _user(),
    }


def _user() -> str | None:
    try:
        return getpass.getuser()
    except (KeyError, OSError):
        return None


def open_run(
    stage: str, cfg: PipelineConfig, resolved: dict, root: Path, config_hash: str, resume_id: str | None = None
) -> tuple[Run | None, Run | None]:
    """(this stage's run, its parent run) in the project's store, or (None, None) with tracking off."""
    if not cfg.tracking.enabled:
        return None, None
    tracker = Tracker(default_tracking_uri(root), cfg.tracking.experiment, root / "mlartifacts")
    commit = git_commit(Path.cwd())  # a queued experiment's temp copy is at its baseline commit
    grp, name = group(stage, commit)
    parent = None
    common = {**source_tags(stage, commit), "git_commit": commit, "dvc_exp_name": os.environ.get("DVC_EXP_NAME")}
    if grp is not None:
        parent_tags = {**common, **grp.tags}
        if grp.key_tag == "pipeline_id":
            parent_tags["mlflow.source.name"] = "dvc"
        # a sweep's jobs differ in config, so its parent holds the overrides (a tag), not one job's params
        params = None if grp.key_tag == "sweep_id" else resolved
        parent = tracker.parent(grp.key_tag, grp.key, grp.name, parent_tags, params)
    if resume_id is not None and tracker.reopenable(resume_id):  # a finished run gets a new one
        run = tracker.resume(resume_id)  # params were logged when it started
        run.set_tags({"resumed": "true"})
        return run, parent
    tags = {**common, "stage": stage, "recipe": cfg.recipe.name, "config_hash": config_hash}
    if grp is not None:
        tags[grp.key_tag] = grp.key
    run = tracker.start(name, tags, parent_run_id=None if parent is None else parent.run_id)
    run.log_params(resolved)
    return run, parent


# What a pipeline's parent run repeats from its evaluate child: the run list shows parents collapsed,
# one per `dvc repro` / `dvc exp run`, so these are what puts experiments side by side at a glance.
HEADLINE = ("val_loss", "val_ppl", "val_bpb", "gap_to_donor", "gap_closed", "val_accuracy")


def summarize_parent(parent: Run | None, stage: str, metrics: dict[str, float]) -> None:
    """The evaluate stage's headline metrics on its pipeline's parent run, under the child's names
    (`summary/val_loss`: one column of the run list shows both). A sweep's parent is left alone: its
    jobs differ, and one value per metric would be the last job's."""
    if parent is None or stage != "evaluate" or sweep_job() is not None:
        return
    parent.log_metrics({f"summary/{k}": float(v) for k, v in metrics.items() if k in HEADLINE}, step=0)
