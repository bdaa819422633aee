"""realize: build the model from its config and initialise it (scratch, pca, or lens), or, for a
fine-tuning recipe (recipe.init=base), load the base GGUF at donor.path and attach adapters."""

from __future__ import annotations

import logging

import hydra
from omegaconf import DictConfig

from pipeline.data.packed import train_tokens
from pipeline.init.realize import run_realize
from stages._run.exits import entry
from stages._run.lifecycle import CONFIG_NAME, CONFIG_PATH, StageContext, run_stage

log = logging.getLogger(__name__)


def body(ctx: StageContext) -> dict[str, float]:
    cfg = ctx.cfg
    ctx.add_input("packed_meta", ctx.paths.packed / "meta.json")
    if cfg.recipe.finetune:
        ctx.add_input("base", ctx.donor_gguf)
    elif cfg.recipe.init == "subclone":
        ctx.add_input("donor", ctx.donor_gguf)
        ctx.add_input("calibration", ctx.paths.donor_dir / "calibration.safetensors")
    elif cfg.recipe.init != "scratch":
        ctx.add_input("pca", ctx.paths.donor_dir / "pca.safetensors")
    paths = ctx.paths
    metrics = run_realize(
        cfg.recipe,
        cfg.model,
        cfg.seed,
        ctx.donor_gguf,
        paths.packed,
        paths.donor_dir,
        ctx.out_dir,
        cfg.train.seq_len,
        cfg.train.vocab,
    )
    if cfg.recipe.finetune:
        log.info(
            f"realize: {cfg.recipe.name} on {ctx.donor_gguf.name}, {int(metrics['trainable_parameters'])} of "
            f"{int(metrics['parameters'])} parameters train -> {ctx.out_dir}"
        )
    elif cfg.recipe.init == "subclone":
        log.info(
            f"realize: subclone of {ctx.donor_gguf.name}, {int(metrics['parameters'])} parameters "
            f"({metrics['parameter_fraction']:.1%} of the donor's), layers kept {int(metrics['layers_kept'])}, "
            f"residual variance kept {metrics['residual_variance_kept']:.3f}, val loss before training "
            f"{metrics['step0_val_loss']:.4f} at seq_len {cfg.train.seq_len} -> {ctx.out_dir}"
        )
    elif cfg.model.arch == "vit":
        m = cfg.model
        log.info(
            f"realize: ViT of {m.n_layer} blocks x {m.d_model}, {int(metrics['patches'])} patches of "
            f"{m.patch_size}x{m.patch_size} px, {int(metrics['classes'])} classes, {int(metrics['parameters'])} "
            f"parameters -> {ctx.out_dir}"
        )
    else:
        log.info(f"realize: init={cfg.recipe.init}, {int(metrics['parameters'])} parameters -> {ctx.out_dir}")
    return metrics


@hydra.main(version_base="1.3", config_path=CONFIG_PATH, config_name=CONFIG_NAME)
def main(cfg: DictConfig) -> None:
    run_stage("realize", cfg, body, train_tokens=train_tokens)


if __name__ == "__main__":
    entry(main)
