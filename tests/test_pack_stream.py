"""Streaming pack: the same ids and split as the in-memory rule, memory bounded by a batch, the split
replayed exactly for any document count, and nothing written when the corpus is too small."""

from __future__ import annotations

import tracemalloc
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from pipeline.config import DataConfig
from pipeline.data import text as text_mod
from pipeline.data.corpus import Document, corpus_sha256
from pipeline.data.packed import load_meta, load_split
from pipeline.data.split import split_indices, val_mask
from pipeline.data.text import encode_documents, pack, split_documents, wrap_ids
from pipeline.errors import DataError
from pipeline.tokenizer.gguf_tokenizer import GGUFTokenizer, tokenizer_from_gguf


@pytest.fixture(scope="module")
def tok(smollm2) -> GGUFTokenizer:
    return tokenizer_from_gguf(smollm2)


@pytest.mark.parametrize("n", [2, 3, 10, 79, 1001])
@pytest.mark.parametrize(("fraction", "seed"), [(0.1, 0), (0.5, 3), (0.9, 11)])
def test_val_mask_is_the_shuffle_split(n: int, fraction: float, seed: int) -> None:
    train, val = split_indices(n, fraction, seed)
    mask = val_mask(n, fraction, seed)
    assert np.flatnonzero(mask).tolist() == val and np.flatnonzero(~mask).tolist() == train


def test_wrap_ids_places_bos_and_eos_around_each_document() -> None:
    encoded = [[5, 6], [], [7]]
    ids, lens = wrap_ids(encoded, 1, 2, np.dtype(np.uint16))
    assert ids.tolist() == [1, 5, 6, 2, 1, 2, 1, 7, 2] and lens.tolist() == [4, 2, 3]
    ids, lens = wrap_ids(encoded, None, 2, np.dtype(np.uint16))
    assert ids.tolist() == [5, 6, 2, 2, 7, 2] and lens.tolist() == [3, 1, 2]
    ids, lens = wrap_ids(encoded, None, None, np.dtype(np.uint16))
    assert ids.tolist() == [5, 6, 7] and lens.tolist() == [2, 0, 1]


def doc(i: int, words: int) -> Document:
    return Document(f"d{i}", f"document {i}: " + " ".join(f"w{(i * 7 + j) % 97}" for j in range(words)))


def corpus(n: int, words: int = 40) -> list[Document]:
    return [doc(i, words) for i in range(n)]


def test_streamed_pack_equals_the_in_memory_rule(tmp_path: Path, tok: GGUFTokenizer, monkeypatch) -> None:
    monkeypatch.setattr(text_mod, "BATCH_DOCS", 7)  # many batches, runs of train and val across them
    monkeypatch.setattr(text_mod, "COPY_BYTES", 64)  # runs copied out in several pieces
    docs = corpus(60)
    cfg = DataConfig(source="text", path="x", val_fraction=0.3, split_seed=5, add_bos="true")
    meta, metrics = pack(iter(docs), tok, cfg, tmp_path / "p")  # a one-shot generator is enough
    splits = split_documents(docs, 0.3, 5)
    for name in ("train", "val"):
        expected = encode_documents(splits[name], tok, True, True)
        assert np.array_equal(np.asarray(load_split(tmp_path / "p", name)), expected)
        assert meta.bytes[name] == sum(len(d.text.encode()) for d in splits[name])
    assert meta.corpus_sha256 == corpus_sha256(docs) and load_meta(tmp_path / "p").documents == {"train": 42, "val": 18}
    both = np.concatenate([encode_documents(docs, tok, True, True)])
    assert meta.distinct_tokens == np.unique(both).size
    assert sorted(p.name for p in (tmp_path / "p").iterdir()) == ["meta.json", "train.bin", "val.bin"]
    assert metrics["peak_rss_mb"] > 10 and metrics["tokens_per_second"] > 0 and metrics["documents"] == 60


def test_memory_is_bounded_by_a_batch_not_the_corpus(tmp_path: Path, tok: GGUFTokenizer, monkeypatch) -> None:
    monkeypatch.setattr(text_mod, "BATCH_DOCS", 50)
    n, words = 1500, 200  # ~2 MB of text, ~0.6M tokens: ~20 MB as Python id lists if held at once

    def docs() -> Iterator[Document]:  # made one at a time: only the batches in flight are alive
        for i in range(n):
            yield doc(i, words)

    cfg = DataConfig(source="text", path="x")
    tracemalloc.start()
    try:
        meta, _ = pack(docs(), tok, cfg, tmp_path / "p")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert sum(meta.tokens.values()) > 500_000
    assert peak < 6 << 20, f"peak traced memory {peak / 2**20:.1f} MiB"


def test_too_few_documents_writes_nothing(tmp_path: Path, tok: GGUFTokenizer) -> None:
    out = tmp_path / "p"
    with pytest.raises(DataError, match="at least 2 non-empty documents"):
        pack(iter(corpus(1)), tok, DataConfig(source="text", path="x"), out)
    assert list(tmp_path.iterdir()) == []
