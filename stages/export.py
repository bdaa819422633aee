"""export: the trained model as a GGUF with the donor's tokenizer and our provenance; for a
LoRA/QLoRA fine-tune also the adapter as a llama.cpp LoRA GGUF and as a PEFT directory."""

from __future__ import annotations

import logging

import hydra
from omegaconf import DictConfig

from pipeline.export.auto_types import WINDOWS, budget_mb
from pipeline.export.corpus_imatrix import IMATRIX_GGUF, ImatrixSource, imatrix_source
from pipeline.export.exporter import CARD, MODEL_GGUF, ExportPlan, run_export, run_image_export
from pipeline.export.naming import ShipInfo, data_label
from pipeline.modeldir import model_config, read_train_state, weight_files
from stages._run.exits import entry
from stages._run.lifecycle import CONFIG_NAME, CONFIG_PATH, StageContext, config_hash, run_stage

log = logging.getLogger(__name__)


def body(ctx: StageContext) -> dict[str, float]:
    cfg = ctx.cfg
    train_dir = ctx.paths.train
    for path in weight_files(train_dir):
        ctx.add_input("weights" if path.name == "model.safetensors" else f"weights_{path.stem}", path)
    state = read_train_state(train_dir)
    provenance = {
        "pipeline.recipe": cfg.recipe.name,
        "pipeline.config_hash": config_hash(ctx.resolved),
        "pipeline.mlflow_run_id": (state.mlflow_run_id if state else None) or "",
        "pipeline.donor": str(cfg.donor.path),
    }
    if state is not None and state.kept_step is not None:
        provenance["pipeline.kept_step"] = state.kept_step
    if model_config(train_dir).arch == "vit":
        return image_export(ctx, provenance)
    ship = ShipInfo(
        recipe=cfg.recipe.name,
        data=data_label(cfg.data.source, cfg.data.path),
        finetune=cfg.recipe.finetune,
        name=cfg.export.name,
        version=cfg.export.version,
        description=f"recipe={cfg.recipe.name} init={cfg.recipe.init}, trained by smollm-pipeline",
        tags=("smollm-pipeline",),
    )
    reuse = train_dir / IMATRIX_GGUF  # a QAT run's matrix: the one its weights were trained to
    calibration = ImatrixSource(ctx.paths.packed, WINDOWS * cfg.train.seq_len, cfg.train.seq_len)
    plan = ExportPlan(
        cfg.export.dtype,
        ship,
        cfg.recipe.lora.dropout,
        imatrix_source(cfg, ctx.paths.packed, cfg.export.imatrix, reuse),
        calibration if budget_mb(cfg.export.dtype) is not None else None,
    )
    metrics = run_export(train_dir, ctx.donor_gguf, ctx.out_dir, plan, provenance)
    files = ", ".join(sorted(p.name for p in ctx.out_dir.iterdir()))
    log.info(f"export: {cfg.export.dtype} GGUF {metrics['file_bytes'] / 1e6:.1f} MB ({files}) -> {ctx.out_dir}")
    ctx.artifact(ctx.out_dir / CARD)
    if state is not None and state.kept_step is not None:
        log.info(f"export: the weights of step {state.kept_step} of {state.steps} (val loss {state.val_loss:.4f})")
        metrics["kept_step"] = float(state.kept_step)
    return metrics


def image_export(ctx: StageContext, provenance: dict) -> dict[str, float]:
    """The ViT recipe: a GGUF of architecture vit (no donor tokenizer, card or llama.cpp name)."""
    cfg = ctx.cfg
    provenance.pop("pipeline.donor")
    keys = {"general.name": f"{cfg.recipe.name}-{cfg.data.source}", "general.basename": cfg.recipe.name, **provenance}
    metrics = run_image_export(ctx.paths.train, ctx.out_dir, cfg.export.dtype, keys)
    log.info(
        f"export: vit GGUF {metrics['file_bytes'] / 1e6:.2f} MB, {int(metrics['parameters'])} parameters "
        f"({cfg.export.dtype}) -> {ctx.out_dir / MODEL_GGUF}; no tokenizer, model card or llama.cpp name (image model)"
    )
    return metrics


@hydra.main(version_base="1.3", config_path=CONFIG_PATH, config_name=CONFIG_NAME)
def main(cfg: DictConfig) -> None:
    run_stage("export", cfg, body)


if __name__ == "__main__":
    entry(main)
