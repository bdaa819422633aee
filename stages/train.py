"""train: the one training loop, from the realized weights on the packed data."""

from __future__ import annotations

import hydra
from omegaconf import DictConfig

from pipeline.atomic import write_text
from pipeline.train import run_train
from stages.common import CONFIG_NAME, CONFIG_PATH, StageContext, run_stage


def body(ctx: StageContext) -> dict[str, float]:
    cfg = ctx.cfg
    ctx.add_input("init", ctx.paths.init / "model.safetensors")
    ctx.add_input("packed_meta", ctx.paths.packed / "meta.json")
    result = run_train(
        cfg.train, cfg.optim, cfg.seed, ctx.paths.init, ctx.paths.packed, ctx.out_dir, ctx.log, ctx.run_id
    )
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
    return {
        "final_train_loss": result.final_train_loss,
        "final_val_loss": result.final_val_loss,
        "final_val_ppl": result.final_val_ppl,
        "steps": float(result.steps),
        "tokens_seen": float(result.tokens_seen),
        "seconds": result.seconds,
        "tokens_per_second": sorted(tps)[len(tps) // 2],
    }


@hydra.main(version_base="1.3", config_path=CONFIG_PATH, config_name=CONFIG_NAME)
def main(cfg: DictConfig) -> None:
    run_stage("train", cfg, body)


if __name__ == "__main__":
    main()
