"""evaluate: load the exported GGUF back, compute val perplexity, write samples."""

from __future__ import annotations

import json
import logging

import hydra
import numpy as np
from matplotlib.figure import Figure
from omegaconf import DictConfig

from pipeline.data.packed import data_files, load_meta, split_fingerprint, split_sha256
from pipeline.evaluate.evaluate_images import CONFUSION_HEADER, Confusion, run_evaluate_images
from pipeline.evaluate.evaluate_text import run_evaluate
from pipeline.io.files import atomic_dir, write_text
from pipeline.tracking import VAL_DATA_TAG
from stages._lineage import check_packed
from stages._run.exits import entry
from stages._run.lifecycle import CONFIG_NAME, CONFIG_PATH, StageContext, run_stage

log = logging.getLogger(__name__)


CONFUSION_PLOT = "confusion.csv"  # plots/evaluate/: DVC's confusion plot (a header alone for text data)


def body(ctx: StageContext) -> dict[str, float]:
    gguf_path = ctx.paths.export / "model.gguf"
    ctx.add_input("gguf", gguf_path)
    images = load_meta(ctx.paths.packed).format == "images"
    # the val split's files hashed once: for the tag and for the donor's val loss check (text)
    hashes = {} if images and ctx.run is None else split_sha256(ctx.paths.packed, "val")
    if ctx.run is not None:  # the report charts only the runs measured on the same val split
        ctx.run.set_tags({VAL_DATA_TAG: split_fingerprint(ctx.paths.packed, "val", hashes)})
    if images:
        return images_body(ctx, gguf_path)
    val_sha256 = hashes.get(data_files(ctx.paths.packed)[2].name)
    paths = ctx.paths
    metrics, samples = run_evaluate(
        gguf_path, paths.packed, paths.train, ctx.cfg, ctx.donor_gguf, paths.teach, val_sha256
    )
    write_text(ctx.plots_dir / CONFUSION_PLOT, CONFUSION_HEADER + "\n")  # DVC's plot: a header alone for text
    with atomic_dir(ctx.out_dir) as tmp:
        (tmp / "samples.json").write_text(json.dumps(samples, indent=2, ensure_ascii=False) + "\n")
    ctx.artifact(ctx.out_dir / "samples.json")
    log.info(f"evaluate: val loss {metrics['val_loss']:.4f} (ppl {metrics['val_ppl']:.2f}) from {gguf_path}")
    if "gap_to_donor" in metrics:
        log.info(f"evaluate: donor val loss {metrics['donor_val_loss']:.4f}, gap {metrics['gap_to_donor']:.4f}")
    if "gap_closed" in metrics:
        closed = metrics["gap_closed"]
        log.info(f"evaluate: {closed:.0%} of the gap from evaluate.baseline_val_loss to the donor closed")
    if "base_val_loss" in metrics:
        log.info(
            f"evaluate: held-out response NLL base {metrics['base_val_loss']:.4f} -> tuned {metrics['val_loss']:.4f}"
        )
    for s in samples:
        log.info(f"  {s['prompt']!r} -> {s.get('greedy', s.get('tuned'))!r}")
    return metrics


def images_body(ctx: StageContext, gguf_path) -> dict[str, float]:
    """Image classification: val loss and accuracy of the export, the confusion matrix as a DVC plot,
    JSON and an MLflow figure; text-only parts (samples, donor gap, llama.cpp parity) do not apply."""
    metrics, confusion = run_evaluate_images(gguf_path, ctx.paths.packed, ctx.paths.train, ctx.cfg)
    with atomic_dir(ctx.out_dir) as tmp:
        (tmp / "confusion.json").write_text(json.dumps(confusion.record(), indent=2) + "\n")
    ctx.artifact(ctx.out_dir / "confusion.json")
    ctx.artifact(write_text(ctx.plots_dir / CONFUSION_PLOT, confusion.csv()))
    if ctx.run is not None:
        ctx.run.log_figure(confusion_figure(confusion), "confusion.png")
    log.info(
        f"evaluate: val accuracy {metrics['val_accuracy']:.4f}, val loss {metrics['val_loss']:.4f} over "
        f"{int(metrics['val_images'])} images from {gguf_path}"
    )
    log.info("evaluate: image data: samples, donor gap and llama.cpp parity skipped (text only)")
    return metrics


def confusion_figure(confusion: Confusion) -> Figure:
    """The confusion matrix as a labelled heat map (counts in the cells)."""
    counts = confusion.matrix()
    fig = Figure(figsize=(5, 4.5), dpi=100)
    ax = fig.add_subplot()
    ax.imshow(counts, cmap="Blues")
    ticks = range(len(confusion.classes))
    ax.set(xticks=ticks, yticks=ticks, xticklabels=confusion.classes, yticklabels=confusion.classes)
    ax.set(xlabel="predicted", ylabel="actual", title="val confusion matrix")
    for (i, j), n in np.ndenumerate(counts):
        if n:
            ax.text(
                j, i, str(n), ha="center", va="center", fontsize=7, color="white" if n > counts.max() / 2 else "black"
            )
    fig.tight_layout()
    return fig


@hydra.main(version_base="1.3", config_path=CONFIG_PATH, config_name=CONFIG_NAME)
def main(cfg: DictConfig) -> float | None:
    lineage = lambda typed, paths: check_packed(typed, paths.packed)  # noqa: E731 - the data it scores
    return run_stage("evaluate", cfg, body, lineage=lineage).get("val_loss")


if __name__ == "__main__":
    entry(main)
