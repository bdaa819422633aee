"""The donor's cut for the packed corpus (`pipeline.config.student`) set in the config keys left at 0
(`pipeline.config.pipeline_schema.with_student_cut`), before a stage checks or reads them: the typed
config every later step sees, and the resolved one that MLflow logs and the run's hash covers, both
hold the values the run used."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from pipeline.config import PipelineConfig
from pipeline.config.pipeline_schema import needs_cut, with_student_cut

log = logging.getLogger(__name__)


def apply_cut(
    stage: str, cfg: PipelineConfig, resolved: dict[str, Any], train_tokens: Callable[[], int]
) -> tuple[PipelineConfig, dict[str, Any]]:
    """`cfg` and `resolved` with the cut's values where they are 0 (`train_tokens`: the packed train split's,
    a named error before the pack stage has run)."""
    if not needs_cut(cfg):
        return cfg, resolved
    tokens = train_tokens()
    cut, name = with_student_cut(cfg, tokens)
    resolved = {**resolved, "model": {**resolved["model"], "n_layer": cut.model.n_layer}}
    resolved["optim"] = {**resolved["optim"], "lr": cut.optim.lr}
    resolved["train"] = {**resolved["train"], "steps": cut.train.steps, "eval_every": cut.train.eval_every}
    log.info(
        "%s: the donor's %s cut for %s train tokens: %d layers, lr %g, %d steps",
        stage,
        name,
        f"{tokens:,}",
        cut.model.n_layer,
        cut.optim.lr,
        cut.train.steps,
    )
    return cut, resolved
