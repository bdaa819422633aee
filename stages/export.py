"""export: the trained model as a llama GGUF with the donor's tokenizer and our provenance; for a
LoRA/QLoRA fine-tune also the adapter as a llama.cpp LoRA GGUF and as a PEFT directory."""

from __future__ import annotations

import json

import hydra
from omegaconf import DictConfig

from pipeline.convert import run_export
from pipeline.finetune import export_finetuned, is_finetune_dir, weight_files
from pipeline.gguf_io import resolve_gguf_path
from stages.common import CONFIG_NAME, CONFIG_PATH, StageContext, config_hash, run_stage


def body(ctx: StageContext) -> dict[str, float]:
    cfg = ctx.cfg
    train_dir = ctx.paths.train
    for path in weight_files(train_dir):
        ctx.add_input("weights" if path.name == "model.safetensors" else f"weights_{path.stem}", path)
    state = (
        json.loads((train_dir / "train_state.json").read_text()) if (train_dir / "train_state.json").exists() else {}
    )
    provenance = {
        "general.name": cfg.export.name,
        "general.description": f"recipe={cfg.recipe.name} init={cfg.recipe.init}, trained by smollm-pipeline",
        "pipeline.recipe": cfg.recipe.name,
        "pipeline.config_hash": config_hash(ctx.resolved),
        "pipeline.mlflow_run_id": state.get("mlflow_run_id") or "",
        "pipeline.donor": str(cfg.donor.path),
    }
    if is_finetune_dir(train_dir):
        metrics = export_finetuned(train_dir, ctx.out_dir, cfg.export.dtype, provenance, cfg.recipe.lora.dropout)
        files = ", ".join(sorted(p.name for p in ctx.out_dir.iterdir()))
        print(f"export: merged {cfg.export.dtype} GGUF {metrics['file_bytes'] / 1e6:.1f} MB ({files}) -> {ctx.out_dir}")
        return metrics
    out = ctx.out_dir / "model.gguf"
    metrics = run_export(train_dir, resolve_gguf_path(cfg.donor.path), out, cfg.export.dtype, provenance)
    print(f"export: {cfg.export.dtype} GGUF, {metrics['file_bytes'] / 1e6:.1f} MB -> {out}")
    return metrics


@hydra.main(version_base="1.3", config_path=CONFIG_PATH, config_name=CONFIG_NAME)
def main(cfg: DictConfig) -> None:
    run_stage("export", cfg, body)


if __name__ == "__main__":
    main()
