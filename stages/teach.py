"""teach: the donor's top-k next-token distribution over the train split, cached for distillation
(`train.distill.*`), and the donor's fp32 val loss for evaluate's comparison."""

from __future__ import annotations

import logging

import hydra
from omegaconf import DictConfig

from pipeline.data.packed import load_meta
from pipeline.distill.teach import run_teach
from pipeline.models.devices import pick_device, resolve_precision
from stages._input_records import DONOR_RECORD, read_record
from stages._run.exits import entry
from stages._run.lifecycle import CONFIG_NAME, CONFIG_PATH, StageContext, run_stage

log = logging.getLogger(__name__)


def body(ctx: StageContext) -> dict[str, float]:
    cfg = ctx.cfg
    record_path = ctx.paths.inputs / DONOR_RECORD
    ctx.add_input("donor_record", record_path)
    ctx.add_input("packed_meta", ctx.paths.packed / "meta.json")
    device = pick_device(cfg.train.device)
    progress = cfg.output == "text"
    record = read_record(ctx.paths.inputs)
    precision = resolve_precision(cfg.train.precision, device)  # the donor's, for the cache
    paths = ctx.paths
    meta, metrics = run_teach(ctx.donor_gguf, record, paths.packed, ctx.out_dir, cfg.train, device, progress, precision)
    if ctx.run is not None:
        ctx.run.set_tags({"teach.mode": meta.mode, "teach.donor_sha256": meta.donor_sha256[:16]})
    ctx.artifact(ctx.out_dir / "meta.json")
    if meta.mode == "off" and load_meta(ctx.paths.packed).format == "images":
        log.info("teach: skipped for image data (no donor, no distillation): only the record is written")
    elif meta.mode == "off":
        log.info("teach: distillation is off (train.distill.weight=0): nothing cached")
    elif meta.cached:
        log.info(
            f"teach: top-{meta.top_k} of {meta.positions} positions in {metrics['cache_seconds']:.0f}s "
            f"({metrics['cache_tokens_per_second']:.0f} tok/s, top-k mass {metrics['top_k_mass']:.3f}) -> {ctx.out_dir}"
        )
    return metrics


@hydra.main(version_base="1.3", config_path=CONFIG_PATH, config_name=CONFIG_NAME)
def main(cfg: DictConfig) -> None:
    run_stage("teach", cfg, body)


if __name__ == "__main__":
    entry(main)
