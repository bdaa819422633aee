"""train: the one training loop, from the realized weights on the packed data.

Checkpoints go to `<train.checkpoint_dir>/<config key>/` (outside DVC's outs, which DVC deletes
before re-running the stage); with `train.resume=auto` a re-run continues from the newest valid
one and reopens the MLflow run it was logging to. Under torchrun every rank runs this; rank 0
alone tracks and writes.
"""

# ruff: noqa: E402  (the imports follow the allocator restart, which must come before torch loads)
from __future__ import annotations

from stages._malloc import allocator_in_use, reexec_with_fast_malloc

if __name__ == "__main__":  # after torch's imports the restart repeated them (3.2 s a launch on 2 cores)
    reexec_with_fast_malloc()

import logging
import math
from pathlib import Path

import hydra
from matplotlib.figure import Figure
from omegaconf import DictConfig

from pipeline.config import PipelineConfig
from pipeline.data.packed import load_meta, train_tokens
from pipeline.export.corpus_imatrix import imatrix_source
from pipeline.io.files import write_text
from pipeline.modeldir import weight_files
from pipeline.training.checkpoint import Checkpoint
from pipeline.training.distributed import is_main_process
from pipeline.training.loop import Hooks, TrainJob, TrainResult
from pipeline.training.resume import CheckpointPlan, plan_checkpoints
from pipeline.training.trainer import TrainInputs, run_train, sized, with_precision
from stages._lineage import check_init, check_packed, check_teach
from stages._run.exits import entry
from stages._run.lifecycle import CONFIG_NAME, CONFIG_PATH, Stage, StageContext
from stages._run.paths import Paths

log = logging.getLogger(__name__)


def checkpoint_plan(cfg: PipelineConfig, paths: Paths) -> CheckpointPlan:
    root = Path(cfg.train.checkpoint_dir)
    root = root if root.is_absolute() else paths.root / root
    return plan_checkpoints(cfg.train, cfg.optim, cfg.seed, paths.init, paths.packed, root, teach_dir=paths.teach)


def body(ctx: StageContext, plan: CheckpointPlan) -> dict[str, float]:
    cfg, paths = ctx.cfg, ctx.paths
    for path in weight_files(paths.init):
        ctx.add_input("init" if path.name == "model.safetensors" else f"init_{path.stem}", path)
    ctx.add_input("packed_meta", paths.packed / "meta.json")
    if cfg.train.distill.enabled:
        ctx.add_input("teach_meta", paths.teach / "meta.json")
    if plan.resume is not None and is_main_process():
        log.info(resume_line(plan.resume, cfg.train.steps))
    online = cfg.train.distill.enabled and cfg.train.distill.mode == "online"
    inputs = TrainInputs(
        init_dir=paths.init,
        packed_dir=paths.packed,
        out_dir=ctx.out_dir,
        teach_dir=paths.teach,
        donor=ctx.donor_gguf if online else None,
        imatrix=imatrix_source(cfg, paths.packed, cfg.train.qat_imatrix) if cfg.train.qat_imatrix else None,
    )
    job = TrainJob(train=cfg.train, optim=cfg.optim, seed=cfg.seed, plan=plan, progress=cfg.output == "text")
    hooks = Hooks(log=ctx.log, run_id=ctx.run_id)
    if ctx.run is not None:
        hooks.flush = ctx.run.flush
        # what train.precision=auto chose here, and the allocator the CPU figures ran under
        ctx.run.set_tags({"train.precision_ran": cfg.train.precision, "train.allocator": allocator_in_use()})
    result = run_train(inputs, job, hooks)
    if not is_main_process():
        return {}
    write_plots(ctx, result)
    accuracy = result.history[-1].get("val_accuracy") if result.history else None
    log.info(
        f"train: {result.steps} steps in {result.seconds:.0f}s, final val loss {result.final_val_loss:.4f} "
        + (f"(accuracy {accuracy:.4f})" if accuracy is not None else f"(ppl {result.final_val_ppl:.2f})")
        + f" -> {ctx.out_dir}"
    )
    if result.kept_step != result.steps:
        log.info(
            f"train: kept the weights of step {result.kept_step} (val loss {result.kept_val_loss:.4f}, the lowest; "
            "train.keep_best=false keeps the last)"
        )
    return metrics(result, load_meta(paths.packed).bits_per_token("val"))


def resume_line(found: Checkpoint, steps: int) -> str:
    """What a resume will do: the final checkpoint (or one early stopping ended the run at) trains no
    step, which "resuming at step N" did not say; its outputs are written from it all the same."""
    done = "nothing to train, writing its outputs"
    if found.step >= steps:
        return f"train: already at step {found.step} of {steps} ({found.path}); {done}"
    if found.state.get("stopped_early"):
        return f"train: stopped early at step {found.step} of {steps} (train.early_stop_patience, {found.path}); {done}"
    return f"train: resuming at step {found.step} of {steps} from {found.path}"


# plots/train/<file>.tsv: its columns, taken from the history rows that have the first one after `step`
PLOT_COLUMNS = {
    "train_loss": ("train_loss",),
    "val_loss": ("val_loss", "val_ppl", "val_bpb", "val_accuracy"),
    "optim": ("lr", "grad_norm", "tokens_per_second"),
    "epochs": ("epoch_train_ppl", "epoch_val_ppl"),  # fine-tunes (epochs over rows); a header alone otherwise
}


OPTIONAL_COLUMNS = ("val_accuracy",)


def write_plots(ctx: StageContext, result: TrainResult) -> None:
    """The DVC plots (and MLflow artifacts): train and val loss, lr and grad norm per step, perplexity per epoch."""
    history = with_base_row(result)
    for name, columns in PLOT_COLUMNS.items():
        ctx.artifact(write_text(ctx.plots_dir / f"{name}.tsv", plot_table(history, columns)))
    if ctx.run is not None:
        ctx.run.log_figure(loss_figure(history), "loss.png")


def with_base_row(result: TrainResult) -> list[dict[str, float]]:
    """The history, led by a step-0 val row when the loop measured the base first (fine-tunes): the curve
    then starts at the base model's held-out loss, which is what fine-tuning is judged against."""
    if result.initial_val_loss is None:
        return result.history
    loss = result.initial_val_loss
    row = {"step": 0.0, "val_loss": loss, "val_ppl": math.exp(loss)}
    scaled = next((h for h in result.history if "val_bpb" in h and h["val_loss"] > 0), None)
    if scaled is not None:  # the same bits-per-byte factor as every other val row
        row["val_bpb"] = loss * scaled["val_bpb"] / scaled["val_loss"]
    return [row, *result.history]


def plot_table(history: list[dict[str, float]], columns: tuple[str, ...]) -> str:
    """A TSV of `step` and `columns` over the history rows that have `columns[0]` (an absent value: empty);
    an optional column (val_accuracy: image recipes) only where some row has it."""
    columns = tuple(c for c in columns if c not in OPTIONAL_COLUMNS or any(c in h for h in history))
    lines = ["\t".join(("step", *columns))]
    for h in (h for h in history if columns[0] in h):
        lines.append("\t".join([str(int(h["step"]))] + [f"{h[c]:.8g}" if c in h else "" for c in columns]))
    return "\n".join(lines) + "\n"


def loss_figure(history: list[dict[str, float]]) -> Figure:
    """Train and val loss on one chart: MLflow draws one chart per metric key."""
    fig = Figure(figsize=(7, 4), dpi=100)
    ax = fig.add_subplot()
    train = [h for h in history if "train_loss" in h]
    ax.plot([h["step"] for h in train], [h["train_loss"] for h in train], label="train_loss", linewidth=1)
    val = [h for h in history if "val_loss" in h]
    ax.plot([h["step"] for h in val], [h["val_loss"] for h in val], "o-", label="val_loss")
    ax.set(xlabel="step", ylabel="loss (nats/token)", title="train and val loss")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    return fig


def metrics(result: TrainResult, bits_per_token: float | None = None) -> dict[str, float]:
    """The run's single values; with a byte count from pack, the val losses in bits per byte too."""
    extra = {}
    if result.initial_val_loss is not None:  # instruct rows: the held-out response loss before training
        extra = {"initial_val_loss": result.initial_val_loss, "initial_val_ppl": math.exp(result.initial_val_loss)}
        log.info(f"train: held-out response loss {result.initial_val_loss:.4f} before -> {result.final_val_loss:.4f}")
    last = result.history[-1] if result.history else {}
    extra.update({f"final_{k}": last[k] for k in ("train_ce", "train_kd") if k in last})  # distillation's parts
    if "val_accuracy" in last:  # image recipes: the accuracy of the last and of the kept weights
        kept = next(h for h in result.history if h["step"] == result.kept_step and "val_accuracy" in h)
        extra.update(final_val_accuracy=last["val_accuracy"], kept_val_accuracy=kept["val_accuracy"])
    tps = [h["tokens_per_second"] for h in result.history[1:]] or [0.0]
    return {
        **extra,
        "final_train_loss": result.final_train_loss,
        "final_val_loss": result.final_val_loss,
        "final_val_ppl": result.final_val_ppl,
        "kept_step": float(result.kept_step),
        "kept_val_loss": result.kept_val_loss,
        **bpb(result, bits_per_token),
        "stopped_early": float(result.stopped_early),
        "steps": float(result.steps),
        "tokens_seen": float(result.tokens_seen),
        "seconds": result.seconds,
        "median_tokens_per_second": sorted(tps)[len(tps) // 2],  # per-step values are `tokens_per_second`
        "resumed_from": float(result.resumed_from),
        "skipped_steps": float(result.skipped_steps),
    }


def bpb(result: TrainResult, bits_per_token: float | None) -> dict[str, float]:
    if bits_per_token is None:
        return {}
    bits = bits_per_token
    return {"final_val_bpb": result.final_val_loss * bits, "kept_val_bpb": result.kept_val_loss * bits}


def lineage(cfg: PipelineConfig, paths: Paths) -> dict[str, str]:
    """The config must be what data/packed and models/init were made with; a distillation's
    data/teach must be of that data and the donor data/inputs recorded. Data and init are checked
    first: a hand run on another recipe's inputs is named by its recipe (the cause), not by the
    teach cache that recipe made differently (a symptom)."""
    tags = {**check_packed(cfg, paths.packed), **check_init(cfg, paths.init)}
    return {**tags, **check_teach(cfg, paths.teach, paths.packed, paths.inputs)}


def prepared(cfg: DictConfig) -> tuple[Stage, CheckpointPlan]:
    """The stage checked and its checkpoint plan made, before its MLflow run opens: `train.epochs` becomes
    a step count once (the plan and the loop both use it), `train.precision=auto` bf16 or fp32 for this
    machine, and a resumed run's MLflow run is known."""
    stage = Stage("train", cfg, lineage, train_tokens)
    stage.cfg.train = stage.prepare(sized, stage.cfg.train, stage.paths.packed)
    stage.cfg.train = stage.prepare(with_precision, stage.cfg.train)
    return stage, stage.prepare(checkpoint_plan, stage.cfg, stage.paths)


@hydra.main(version_base="1.3", config_path=CONFIG_PATH, config_name=CONFIG_NAME)
def main(cfg: DictConfig) -> float | None:
    stage, plan = prepared(cfg)
    metrics = stage.run(lambda ctx: body(ctx, plan), resume_run_id=plan.run_id)
    return metrics.get("kept_val_loss")  # the objective of an Optuna sweep: the loss of the weights written


if __name__ == "__main__":
    entry(main)
