"""donor: read the donor GGUF's embedding table and PCA it down to model.d_model, or, for
recipe.init=subclone, run the whole donor over part of the train split and measure what realize
needs to transfer every weight (pipeline/donor/calibrate.py)."""

from __future__ import annotations

import logging

import hydra
import numpy as np
from omegaconf import DictConfig

from pipeline.data.packed import load_meta, train_tokens
from pipeline.donor.calibrate import run_calibration
from pipeline.donor.pca import run_donor
from pipeline.io.files import atomic_dir, write_json, write_text
from stages._run.exits import entry
from stages._run.lifecycle import CONFIG_NAME, CONFIG_PATH, StageContext, run_stage

log = logging.getLogger(__name__)


def body(ctx: StageContext) -> dict[str, float]:
    meta = load_meta(ctx.paths.packed)
    if meta.format == "images":
        return skip_for_images(ctx)
    ctx.add_input("donor", ctx.donor_gguf)
    recipe, d_model = ctx.cfg.recipe, ctx.cfg.model.d_model
    if recipe.init == "subclone":
        calib, metrics = run_calibration(ctx.donor_gguf, ctx.paths.packed, ctx.cfg.model, recipe.subclone, ctx.out_dir)
        write_plot(ctx, calib.variance / calib.variance.sum())
        log.info(
            f"donor: calibrated on {int(metrics['calibration_tokens'])} tokens "
            f"({metrics['calibration_tokens_per_second']:.0f} tok/s); {d_model} residual directions keep "
            f"{metrics['explained_variance_total']:.3f} of the variance"
        )
        return metrics
    result, metrics = run_donor(
        ctx.donor_gguf, meta.vocab_size, ctx.paths.packed / "meta.json", d_model, recipe.init, ctx.out_dir
    )
    write_plot(ctx, result.explained_variance_ratio)
    explained = metrics["explained_variance_total"]
    if metrics["components"]:
        log.info(f"donor: {int(metrics['components'])} components explain {explained:.3f} of the variance")
    else:
        log.info(f"donor: no PCA for recipe.init={recipe.init}; the donor's vocabulary matches the packed data")
    return metrics


def skip_for_images(ctx: StageContext) -> dict[str, float]:
    """Image data (the ViT recipe) takes nothing from the donor: a record saying so, an empty plot."""
    with atomic_dir(ctx.out_dir) as tmp:
        write_json(tmp / "meta.json", {"skipped": "image data: the donor (a language model) is not used"})
    write_plot(ctx, np.zeros(0))
    log.info(f"donor: skipped for image data (recipe={ctx.cfg.recipe.name}): no donor PCA or calibration")
    return {"components": 0.0}


def write_plot(ctx: StageContext, ratios: np.ndarray) -> None:
    """The explained variance per component (embedding PCA, or the residual basis for subclone)."""
    rows = ["component\texplained_variance_ratio\tcumulative"]
    total = 0.0
    for i, r in enumerate(ratios):
        total += float(r)
        rows.append(f"{i + 1}\t{float(r):.6g}\t{total:.6g}")
    ctx.artifact(write_text(ctx.plots_dir / "explained_variance.tsv", "\n".join(rows) + "\n"))


@hydra.main(version_base="1.3", config_path=CONFIG_PATH, config_name=CONFIG_NAME)
def main(cfg: DictConfig) -> None:
    run_stage("donor", cfg, body, train_tokens=train_tokens)


if __name__ == "__main__":
    entry(main)
