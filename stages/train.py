"""train: the one training loop, from the realized weights on the packed data.

Checkpoints go to `<train.checkpoint_dir>/<config key>/` (outside DVC's outs, which DVC deletes
before re-running the stage); with `train.resume=auto` a re-run continues from the newest valid
one and reopens the MLflow run it was logging to. Under torchrun every rank runs this; rank 0
alone tracks and writes.
"""

from __future__ import annotations

import math
from pathlib import Path

import hydra
from omegaconf import DictConfig

from pipeline.atomic import write_text
from pipeline.config import PipelineConfig
from pipeline.distributed import is_main_process
from pipeline.finetune import weight_files
from pipeline.train import CheckpointPlan, plan_checkpoints, run_train
from stages.common import CONFIG_NAME, CONFIG_PATH, Paths, StageContext, run_stage


def checkpoint_plan(cfg: PipelineConfig, paths: Paths) -> CheckpointPlan:
    root = Path(cfg.train.checkpoint_dir)
    root = root if root.is_absolute() else paths.root / root
    return plan_checkpoints(cfg.train, cfg.optim, cfg.seed, paths.init, paths.packed, root)


def body(ctx: StageContext, plan: CheckpointPlan) -> dict[str, float]:
    cfg = ctx.cfg
    for path in weight_files(ctx.paths.init):
        ctx.add_input("init" if path.name == "model.safetensors" else f"init_{path.stem}", path)
    ctx.add_input("packed_meta", ctx.paths.packed / "meta.json")
    if plan.resume is not None and is_main_process():
        print(f"train: resuming at step {plan.resume.step} from {plan.resume.path}")
    flush = ctx.run.flush if ctx.run is not None else None
    result = run_train(
        cfg.train, cfg.optim, cfg.seed, ctx.paths.init, ctx.paths.packed, ctx.out_dir, ctx.log, ctx.run_id, plan, flush
    )
    if not is_main_process():
        return {}
    train_rows = ["step\ttrain_loss"] + [f"{int(h['step'])}\t{h['train_loss']:.6f}" for h in result.history]
    val_rows = ["step\tval_loss"] + [
        f"{int(h['step'])}\t{h['val_loss']:.6f}" for h in result.history if "val_loss" in h
    ]
    write_text(ctx.plots_dir / "train_loss.tsv", "\n".join(train_rows) + "\n")
    write_text(ctx.plots_dir / "val_loss.tsv", "\n".join(val_rows) + "\n")
    ctx.artifact(ctx.plots_dir / "train_loss.tsv")
    ctx.artifact(ctx.plots_dir / "val_loss.tsv")
    tps = [h["tokens_per_second"] for h in result.history[1:]] or [0.0]
    print(
        f"train: {result.steps} steps in {result.seconds:.0f}s, final val loss {result.final_val_loss:.4f} "
        f"(ppl {result.final_val_ppl:.2f}) -> {ctx.out_dir}"
    )
    extra = {}
    if result.initial_val_loss is not None:  # instruct rows: the held-out response loss before training
        extra = {"initial_val_loss": result.initial_val_loss, "initial_val_ppl": math.exp(result.initial_val_loss)}
        print(f"train: held-out response loss {result.initial_val_loss:.4f} before -> {result.final_val_loss:.4f}")
    return {
        **extra,
        "final_train_loss": result.final_train_loss,
        "final_val_loss": result.final_val_loss,
        "final_val_ppl": result.final_val_ppl,
        "steps": float(result.steps),
        "tokens_seen": float(result.tokens_seen),
        "seconds": result.seconds,
        "tokens_per_second": sorted(tps)[len(tps) // 2],
        "resumed_from": float(result.resumed_from),
        "skipped_steps": float(result.skipped_steps),
    }


@hydra.main(version_base="1.3", config_path=CONFIG_PATH, config_name=CONFIG_NAME)
def main(cfg: DictConfig) -> None:
    plans: list[CheckpointPlan] = []  # found before the MLflow run opens, used by the body

    def resume_run(typed: PipelineConfig, paths: Paths) -> str | None:
        plans.append(checkpoint_plan(typed, paths))
        return plans[0].run_id

    run_stage("train", cfg, lambda ctx: body(ctx, plans[0]), resume_run=resume_run)


if __name__ == "__main__":
    main()
