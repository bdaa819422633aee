"""`export.imatrix`: an importance matrix from the packed corpus, and the quantized export it calibrates.

The statistics are collected by our forward over the first `export.imatrix` tokens of the train
split, in windows of train.seq_len (`pipeline.models.imatrix`), written next to the export in
llama.cpp's imatrix GGUF (`imatrix.gguf`, which `llama-quantize --imatrix` also takes), and used to
quantize every tensor that has an entry (`pipeline.gguf.imatrix_format.quantize_gguf`), with llama.cpp's
provenance keys and ours (corpus hash, tokens) in the model's metadata. A QAT run trains to the file
it will export, so with `train.qat_imatrix` the train stage collects the matrix once, from the model
it starts from, and saves it in its own directory; export then takes that one (`reuse`). Export alone
(`export.imatrix`) collects it from the trained model: changing it re-runs only export.
"""

from __future__ import annotations

import logging
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from torch import nn

from pipeline.config import PipelineConfig
from pipeline.data.packed import begin_with_bos, load_meta, load_split, window_bos
from pipeline.errors import ConfigError, problem
from pipeline.export.naming import data_label
from pipeline.gguf.imatrix_format import Imatrix, quantize_gguf, read_imatrix, write_imatrix
from pipeline.models.imatrix import collect_sums
from pipeline.models.registry import export_gguf

log = logging.getLogger(__name__)
IMATRIX_GGUF = "imatrix.gguf"


@dataclass(frozen=True)
class ImatrixSource:
    """Where an importance matrix comes from: `tokens` of the train split in `packed_dir`, in windows of
    `seq_len`, `batch_size` at a time; or the file `reuse` (a QAT run's), when it exists."""

    packed_dir: Path
    tokens: int
    seq_len: int
    batch_size: int = 8  # fixed, not train.batch_size: the sums' order, hence their bits, never depend on it
    dataset: str = ""  # the corpus's name, recorded as quantize.imatrix.dataset
    reuse: Path | None = None


def corpus_imatrix(model: nn.Module, src: ImatrixSource) -> Imatrix:
    """`model`'s importance matrix over the first `src.tokens` tokens of the train split."""
    if src.reuse is not None and src.reuse.is_file():
        log.info(f"imatrix: {src.reuse} (the matrix train.qat trained with)")
        return read_imatrix(src.reuse)
    ids = load_split(src.packed_dir, "train")
    n = min(src.tokens, len(ids)) // src.seq_len
    if n < 1:
        found = f"{src.tokens} (the train split has {len(ids)} tokens)"
        raise ConfigError(
            problem("config key export.imatrix", f">= train.seq_len={src.seq_len} tokens", found, "raise it")
        )
    windows = begin_with_bos(np.array(ids[: n * src.seq_len]).reshape(n, src.seq_len), window_bos(ids))
    device = next(model.parameters()).device
    sums, tokens = collect_sums(model, windows, src.batch_size, device)
    extra = {
        "pipeline.imatrix.corpus_sha256": load_meta(src.packed_dir).corpus_sha256,
        "pipeline.imatrix.split": "train",
        "pipeline.imatrix.tokens": tokens,
    }
    log.info(f"imatrix: {len(sums)} matmuls over {tokens} train tokens ({n} windows of {src.seq_len})")
    return Imatrix(sums, dict.fromkeys(sums, tokens), n, src.seq_len, [src.dataset or "train"], extra)


def export_with_imatrix(
    model: nn.Module,
    out_dir: Path,
    name: str,
    tok_meta: dict[str, Any],
    keys: dict[str, Any],
    dtype: str,
    src: ImatrixSource,
) -> Path:
    """`out_dir/name` at `dtype` quantized with the model's corpus imatrix, written beside it as imatrix.gguf."""
    imx = corpus_imatrix(model, src)
    write_imatrix(out_dir / IMATRIX_GGUF, imx)
    with tempfile.TemporaryDirectory(dir=out_dir, prefix=".f32-") as tmp:
        f32 = export_gguf(model, Path(tmp) / "f32.gguf", tok_meta, keys, "f32")
        return quantize_gguf(f32, out_dir / name, dtype, imx, IMATRIX_GGUF)


def imatrix_source(
    cfg: PipelineConfig, packed_dir: Path, tokens: int, reuse: Path | None = None
) -> ImatrixSource | None:
    """The importance matrix over `tokens` train tokens (export.imatrix, or train.qat_imatrix for the
    train stage), or the file `reuse` when it exists (the one QAT trained to); None when neither."""
    found = reuse if reuse is not None and reuse.is_file() else None
    if not tokens and found is None:
        return None
    label = data_label(cfg.data.source, cfg.data.path)
    return ImatrixSource(packed_dir, tokens, cfg.train.seq_len, dataset=label, reuse=found)
