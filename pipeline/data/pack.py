"""The pack stage: the donor's own tokenizer over the configured corpus or instruction examples,
written as the packed-data format (`pipeline.data.packed`)."""

from __future__ import annotations

from pathlib import Path

from pipeline.config import DataConfig
from pipeline.data.corpus import iter_documents
from pipeline.data.images import pack_images
from pipeline.data.instruct_pack import pack_instruct
from pipeline.data.mixture import pack_mixture
from pipeline.data.packed import PackMeta
from pipeline.data.shards import merge_shards, pack_shard
from pipeline.data.text import pack
from pipeline.gguf.reader import GGUFFile
from pipeline.tokenizer.gguf_tokenizer import tokenizer_from_gguf


def run_pack(
    data: DataConfig, donor_path: Path, out_dir: Path, progress: bool = False
) -> tuple[PackMeta, dict[str, float]]:
    """Tokenize and write `out_dir` atomically (running text streams, see `pipeline.data.text`); returns
    the meta and the stage metrics. `progress`: a bar with documents/s and tokens/s. Images need no
    tokenizer (`pipeline.data.images`)."""
    if data.images:
        return pack_images(data, out_dir)
    g = GGUFFile(donor_path)
    tok = tokenizer_from_gguf(g)
    if data.source == "instruct":
        return pack_instruct(data, tok, g.metadata, out_dir)
    if data.source == "mix":
        return pack_mixture(data, tok, out_dir, progress)
    return pack(iter_documents(data), tok, data, out_dir, progress)


def run_pack_shard(data: DataConfig, donor_path: Path, progress: bool = False) -> tuple[Path, dict[str, float]]:
    """One job of a sharded pack (`data.num_shards` > 1): its shard dir and metrics (`pipeline.data.shards`)."""
    tok = tokenizer_from_gguf(GGUFFile(donor_path))
    return pack_shard(iter_documents(data), tok, data, progress)


def run_merge(data: DataConfig, donor_path: Path, out_dir: Path) -> tuple[PackMeta, dict[str, float]]:
    """The shards of `data` checked against this config and donor tokenizer, merged into `out_dir`."""
    tok = tokenizer_from_gguf(GGUFFile(donor_path))
    return merge_shards(data, tok.fingerprint(), out_dir)
