"""pack_merge: the shards of a sharded pack (`data.num_shards` > 1, one pack job per `data.shard_index`)
checked and merged into `data/packed`, the layout train reads; metrics/pack.json as pack would write it.

    python -m stages.pack_merge --config-dir . --config-name params data.num_shards=4
"""

from __future__ import annotations

import logging

import hydra
from omegaconf import DictConfig

from pipeline.data.pack import run_merge
from stages._run.exits import entry
from stages._run.lifecycle import CONFIG_NAME, CONFIG_PATH, StageContext, run_stage

log = logging.getLogger(__name__)


def body(ctx: StageContext) -> dict[str, float]:
    ctx.add_input("donor", ctx.donor_gguf)
    meta, metrics = run_merge(ctx.cfg.data, ctx.donor_gguf, ctx.out_dir)
    if ctx.run is not None:
        ctx.run.set_tags({"corpus_sha256": meta.corpus_sha256, "tokenizer": meta.tokenizer_fingerprint[:16]})
    ctx.artifact(ctx.out_dir / "meta.json")
    log.info(
        f"pack_merge: {meta.shards} shards, {sum(meta.documents.values())} documents, {int(metrics['tokens'])} tokens "
        f"(train {meta.tokens['train']}, val {meta.tokens['val']}) -> {ctx.out_dir}"
    )
    return metrics


@hydra.main(version_base="1.3", config_path=CONFIG_PATH, config_name=CONFIG_NAME)
def main(cfg: DictConfig) -> None:
    run_stage("pack", cfg, body)


if __name__ == "__main__":
    entry(main)
