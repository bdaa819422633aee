"""report: the pipeline's outputs and its MLflow runs into `reports/report.md` and a self-contained
`reports/report.html`; both are logged to this stage's MLflow run and to the pipeline's parent run."""

from __future__ import annotations

import logging

import hydra
from omegaconf import DictConfig

from pipeline.report import HTML, ReportInputs, build_report, check_ready, read_outputs, write_report
from pipeline.report.environment import environment
from pipeline.report.outputs import STAGES
from pipeline.report.runs import compare
from pipeline.tracking import RunRecord, default_tracking_uri, project_root, stage_runs
from stages._run.exits import entry
from stages._run.lifecycle import CONFIG_NAME, CONFIG_PATH, StageContext, run_stage
from stages._run.mlflow_runs import git_commit

log = logging.getLogger(__name__)
SEARCHED = 200  # runs per stage searched for the one that logged the current metrics


def mlflow_runs(ctx: StageContext) -> dict[str, list[RunRecord]]:
    """Each stage's newest finished runs in the project's store (none with tracking off)."""
    if not ctx.cfg.tracking.enabled:
        return {}
    uri = default_tracking_uri(project_root(ctx.paths.root))
    return {s: stage_runs(uri, ctx.cfg.tracking.experiment, s, SEARCHED) for s in STAGES}


def body(ctx: StageContext) -> dict[str, float]:
    cfg = ctx.cfg
    outputs = read_outputs(ctx.paths.root)
    runs = mlflow_runs(ctx)
    evaluated = runs.get("evaluate", [])
    limit = cfg.report.compare_runs
    compared = compare(outputs.metrics["evaluate"], ctx.resolved, evaluated, limit) if limit > 0 else []
    env = environment(cfg.train.device, cfg.train.threads, git_commit(ctx.paths.root))
    inputs = ReportInputs(outputs, cfg.recipe.name, env, compared, runs, cfg.tracking.enabled)
    report = build_report(inputs)
    md, page = write_report(report, ctx.out_dir)
    for path in (md, page):
        ctx.artifact(path, "report")
    parent = ctx.run.parent_id() if ctx.run is not None else None
    if parent is not None:  # the pipeline's own run: the report beside its children
        for path in (md, page):
            ctx.run.log_artifact_to(parent, path, "report")
    log.info(f"report: {len(report.figures)} charts, {len(compared)} runs compared -> {ctx.out_dir / HTML}")
    return {
        "charts": float(len(report.figures)),
        "compared_runs": float(len(compared)),
        "html_bytes": float(page.stat().st_size),
    }


@hydra.main(version_base="1.3", config_path=CONFIG_PATH, config_name=CONFIG_NAME)
def main(cfg: DictConfig) -> None:
    run_stage("report", cfg, body, lineage=lambda typed, paths: check_ready(paths.root) or {})


if __name__ == "__main__":
    entry(main)
