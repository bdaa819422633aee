"""pack: tokenize the corpus with the donor's tokenizer into memmapped train/val ids."""

from __future__ import annotations

import logging

import hydra
from omegaconf import DictConfig

from pipeline.data.pack import run_pack, run_pack_shard
from stages._run.exits import entry
from stages._run.lifecycle import CONFIG_NAME, CONFIG_PATH, StageContext, run_stage

log = logging.getLogger(__name__)


def body(ctx: StageContext) -> dict[str, float]:
    ctx.add_input("donor", ctx.donor_gguf)
    data = ctx.cfg.data
    if data.num_shards > 1:
        shard, metrics = run_pack_shard(data, ctx.donor_gguf, progress=ctx.cfg.output == "text")
        log.info(
            f"pack: shard {data.shard_index} of {data.num_shards}: {int(metrics['documents'])} documents, "
            f"{int(metrics['tokens'])} tokens -> {shard}; when all are done: python -m stages.pack_merge"
        )
        return metrics
    meta, metrics = run_pack(ctx.cfg.data, ctx.donor_gguf, ctx.out_dir, progress=ctx.cfg.output == "text")
    if ctx.run is not None:
        ctx.run.set_tags({"corpus_sha256": meta.corpus_sha256, "tokenizer": meta.tokenizer_fingerprint[:16]})
    ctx.artifact(ctx.out_dir / "meta.json")
    if meta.format == "images":
        stats = meta.stats or {}
        log.info(
            f"pack: {int(metrics['images'])} images of {meta.n_classes} classes at {stats.get('image_size')}px "
            f"(train {meta.documents['train']}, val {meta.documents['val']}) -> {ctx.out_dir}"
        )
        return metrics
    kind = "examples" if meta.format == "instruct" else "documents"
    log.info(
        f"pack: {sum(meta.documents.values())} {kind}, {int(metrics['tokens'])} tokens "
        f"(train {meta.tokens['train']}, val {meta.tokens['val']}) -> {ctx.out_dir}"
    )
    return metrics


@hydra.main(version_base="1.3", config_path=CONFIG_PATH, config_name=CONFIG_NAME)
def main(cfg: DictConfig) -> None:
    run_stage("pack", cfg, body)


if __name__ == "__main__":
    entry(main)
