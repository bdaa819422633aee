"""realize: build the model from its config and initialise it (scratch, pca, or lens), or, for a
fine-tuning recipe (recipe.init=base), load the base GGUF at donor.path and attach adapters."""

from __future__ import annotations

import hydra
from omegaconf import DictConfig

from pipeline.finetune import realize_finetune
from pipeline.gguf_io import resolve_gguf_path
from pipeline.pack import load_meta
from pipeline.realize import run_realize
from stages.common import CONFIG_NAME, CONFIG_PATH, StageContext, run_stage


def body(ctx: StageContext) -> dict[str, float]:
    cfg = ctx.cfg
    ctx.add_input("packed_meta", ctx.paths.packed / "meta.json")
    if cfg.recipe.finetune:
        base = resolve_gguf_path(cfg.donor.path)
        ctx.add_input("base", base)
        metrics = realize_finetune(cfg.recipe, base, load_meta(ctx.paths.packed).vocab_size, ctx.out_dir)
        print(
            f"realize: {cfg.recipe.name} on {base.name}, {int(metrics['trainable_parameters'])} of "
            f"{int(metrics['parameters'])} parameters train -> {ctx.out_dir}"
        )
        return metrics
    if cfg.recipe.init != "scratch":
        ctx.add_input("pca", ctx.paths.donor / "pca.safetensors")
    metrics = run_realize(cfg.model, cfg.recipe.init, cfg.seed, ctx.paths.packed, ctx.paths.donor, ctx.out_dir)
    print(f"realize: init={cfg.recipe.init}, {int(metrics['parameters'])} parameters -> {ctx.out_dir}")
    return metrics


@hydra.main(version_base="1.3", config_path=CONFIG_PATH, config_name=CONFIG_NAME)
def main(cfg: DictConfig) -> None:
    run_stage("realize", cfg, body)


if __name__ == "__main__":
    main()
