"""donor: read the donor GGUF's embedding table and PCA it down to model.d_model."""

from __future__ import annotations

import logging

import hydra
from omegaconf import DictConfig

from pipeline.data.packed import load_meta
from pipeline.donor import run_donor
from pipeline.files import write_text
from stages.common import CONFIG_NAME, CONFIG_PATH, StageContext, entry, run_stage

log = logging.getLogger(__name__)


def body(ctx: StageContext) -> dict[str, float]:
    meta = load_meta(ctx.paths.packed)
    ctx.add_input("donor", ctx.donor)
    result, metrics = run_donor(
        ctx.donor,
        meta.vocab_size,
        ctx.paths.packed / "meta.json",
        ctx.cfg.model.d_model,
        ctx.cfg.recipe.init,
        ctx.out_dir,
    )
    ratios = result.explained_variance_ratio
    rows = ["component\texplained_variance_ratio\tcumulative"]
    total = 0.0
    for i, r in enumerate(ratios):
        total += float(r)
        rows.append(f"{i + 1}\t{float(r):.6g}\t{total:.6g}")
    plot = write_text(ctx.plots_dir / "explained_variance.tsv", "\n".join(rows) + "\n")
    ctx.artifact(plot)
    explained = metrics["explained_variance_total"]
    if metrics["components"]:
        log.info(f"donor: {int(metrics['components'])} components explain {explained:.3f} of the variance")
    else:
        log.info(f"donor: no PCA for recipe.init={ctx.cfg.recipe.init}; the donor's vocabulary matches the packed data")
    return metrics


@hydra.main(version_base="1.3", config_path=CONFIG_PATH, config_name=CONFIG_NAME)
def main(cfg: DictConfig) -> None:
    run_stage("donor", cfg, body)


if __name__ == "__main__":
    entry(main)
