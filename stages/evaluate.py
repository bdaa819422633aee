"""evaluate: load the exported GGUF back, compute val perplexity, write samples."""

from __future__ import annotations

import json
import logging

import hydra
from omegaconf import DictConfig

from pipeline.evaluate import run_evaluate
from pipeline.files import atomic_dir
from pipeline.lineage import check_packed
from stages.common import CONFIG_NAME, CONFIG_PATH, StageContext, entry, run_stage

log = logging.getLogger(__name__)


def body(ctx: StageContext) -> dict[str, float]:
    gguf_path = ctx.paths.export / "model.gguf"
    ctx.add_input("gguf", gguf_path)
    metrics, samples = run_evaluate(gguf_path, ctx.paths.packed, ctx.paths.train, ctx.cfg, ctx.donor, ctx.paths.teach)
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


@hydra.main(version_base="1.3", config_path=CONFIG_PATH, config_name=CONFIG_NAME)
def main(cfg: DictConfig) -> float | None:
    lineage = lambda typed, paths: check_packed(typed, paths.packed)  # noqa: E731 - the data it scores
    return run_stage("evaluate", cfg, body, lineage=lineage).get("val_loss")


if __name__ == "__main__":
    entry(main)
