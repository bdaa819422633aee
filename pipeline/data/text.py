"""Running text -> token ids with the donor's own tokenizer, split by document, written as the
packed-data format (`pipeline.data.packed`). No document leaks from train into val."""

from __future__ import annotations

import time
from dataclasses import asdict
from pathlib import Path

import numpy as np

from pipeline.config import DataConfig
from pipeline.data.corpus import Document, corpus_sha256
from pipeline.data.packed import SPLITS, PackMeta, ids_dtype, write_meta, write_tokens
from pipeline.data.split import split_indices
from pipeline.files import atomic_dir
from pipeline.gguf.tokenizer import GGUFTokenizer


def split_documents(docs: list[Document], val_fraction: float, seed: int) -> dict[str, list[Document]]:
    """The documents of each split (see `pipeline.data.split`)."""
    train, val = split_indices(len(docs), val_fraction, seed)
    return {"train": [docs[i] for i in train], "val": [docs[i] for i in val]}


def encode_documents(docs: list[Document], tok: GGUFTokenizer, add_bos: bool, add_eos: bool) -> np.ndarray:
    """All documents' ids concatenated, each wrapped in BOS/EOS as configured."""
    dtype = ids_dtype(tok.vocab_size)
    pieces = []
    for ids in tok.encode_batch([d.text for d in docs]):
        if add_bos and tok.bos_id is not None:
            ids = [tok.bos_id, *ids]
        if add_eos and tok.eos_id is not None:
            ids = [*ids, tok.eos_id]
        pieces.append(np.asarray(ids, dtype=dtype))
    return np.concatenate(pieces) if pieces else np.zeros(0, dtype=dtype)


def resolve_add_bos(setting: str, tok: GGUFTokenizer) -> bool:
    """`auto` follows the GGUF's add_bos_token flag, as llama.cpp does."""
    return tok.add_bos if setting == "auto" else setting == "true"


def pack(docs: list[Document], tok: GGUFTokenizer, cfg: DataConfig, out_dir: Path) -> tuple[PackMeta, dict[str, float]]:
    """Tokenize, split and write `out_dir` atomically; returns the meta and the stage metrics."""
    start = time.perf_counter()
    splits = split_documents(docs, cfg.val_fraction, cfg.split_seed)
    add_bos = resolve_add_bos(cfg.add_bos, tok)
    arrays = {name: encode_documents(splits[name], tok, add_bos, cfg.add_eos) for name in SPLITS}
    elapsed = time.perf_counter() - start
    total = sum(a.size for a in arrays.values())
    distinct = int(np.unique(np.concatenate(list(arrays.values()))).size)
    meta = PackMeta(
        vocab_size=tok.vocab_size,
        dtype=ids_dtype(tok.vocab_size).name,
        tokenizer_fingerprint=tok.fingerprint(),
        corpus_sha256=corpus_sha256(docs),
        source=cfg.source,
        bos_id=tok.bos_id if add_bos else None,
        eos_id=tok.eos_id if cfg.add_eos else None,
        documents={name: len(splits[name]) for name in SPLITS},
        tokens={name: int(arrays[name].size) for name in SPLITS},
        distinct_tokens=distinct,
        data=asdict(cfg),
        bytes={name: sum(len(d.text.encode("utf-8")) for d in splits[name]) for name in SPLITS},
    )
    with atomic_dir(out_dir) as tmp:
        for name in SPLITS:
            write_tokens(tmp, name, arrays[name])
        write_meta(tmp, meta)
    metrics = {
        "documents": float(len(docs)),
        "documents_train": float(len(splits["train"])),
        "documents_val": float(len(splits["val"])),
        "tokens": float(total),
        "tokens_train": float(arrays["train"].size),
        "tokens_val": float(arrays["val"].size),
        "distinct_tokens": float(distinct),
        "tokens_per_second": total / max(elapsed, 1e-9),
    }
    return meta, metrics
