"""realize: build the model from its config and initialise it (scratch, pca, or lens), or, for a
fine-tuning recipe (recipe.init=base), load the base GGUF at donor.path and attach adapters."""

from __future__ import annotations

import logging

import hydra
from omegaconf import DictConfig

from pipeline.realize import run_realize
from stages.common import CONFIG_NAME, CONFIG_PATH, StageContext, entry, run_stage

log = logging.getLogger(__name__)


def body(ctx: StageContext) -> dict[str, float]:
    cfg = ctx.cfg
    ctx.add_input("packed_meta", ctx.paths.packed / "meta.json")
    if cfg.recipe.finetune:
        ctx.add_input("base", ctx.donor)
    elif cfg.recipe.init != "scratch":
        ctx.add_input("pca", ctx.paths.donor / "pca.safetensors")
    metrics = run_realize(cfg.recipe, cfg.model, cfg.seed, ctx.donor, ctx.paths.packed, ctx.paths.donor, ctx.out_dir)
    if cfg.recipe.finetune:
        log.info(
            f"realize: {cfg.recipe.name} on {ctx.donor.name}, {int(metrics['trainable_parameters'])} of "
            f"{int(metrics['parameters'])} parameters train -> {ctx.out_dir}"
        )
    else:
        log.info(f"realize: init={cfg.recipe.init}, {int(metrics['parameters'])} parameters -> {ctx.out_dir}")
    return metrics


@hydra.main(version_base="1.3", config_path=CONFIG_PATH, config_name=CONFIG_NAME)
def main(cfg: DictConfig) -> None:
    run_stage("realize", cfg, body)


if __name__ == "__main__":
    entry(main)
