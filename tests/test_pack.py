"""Corpus sources, packing, deterministic split, memmap dtype and meta; bad corpora fail cleanly."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from pipeline.config import DataConfig
from pipeline.data.corpus import load_documents
from pipeline.data.packed import load_meta, load_split
from pipeline.data.text import pack, split_documents
from pipeline.errors import DataError
from pipeline.tokenizer.gguf_tokenizer import GGUFTokenizer, tokenizer_from_gguf


@pytest.fixture(scope="module")
def tok(smollm2) -> GGUFTokenizer:
    return tokenizer_from_gguf(smollm2)


def test_pydoc_corpus_is_the_language_reference() -> None:
    docs = load_documents(DataConfig())
    assert len(docs) >= 70
    assert any("for" in d.name for d in docs)
    assert [d.name for d in docs] == sorted(d.name for d in docs)


def test_pack_pydoc(tmp_path: Path, tok: GGUFTokenizer) -> None:
    cfg = DataConfig()
    docs = load_documents(cfg)
    meta, metrics = pack(docs, tok, cfg, tmp_path / "packed")
    assert meta.dtype == "uint16" and meta.vocab_size == 49152
    assert meta.tokens["train"] + meta.tokens["val"] == metrics["tokens"]
    assert meta.documents["train"] + meta.documents["val"] == len(docs)
    assert 100_000 < metrics["tokens"] < 130_000
    train = load_split(tmp_path / "packed", "train")
    assert train.dtype == np.uint16 and len(train) == meta.tokens["train"]
    # SmolLM2 adds no BOS; every document ends with EOS (id 2)
    assert meta.bos_id is None and meta.eos_id == tok.eos_id
    assert int((train == tok.eos_id).sum()) >= meta.documents["train"]
    assert len(meta.tokenizer_fingerprint) == 64 and len(meta.corpus_sha256) == 64
    assert metrics["tokens_per_second"] > 0 and metrics["distinct_tokens"] > 1000


def test_a_val_split_over_the_cap_keeps_spread_spans_of_it(tmp_path: Path, tok: GGUFTokenizer) -> None:
    """data.val_max_tokens: a larger val split keeps that many tokens, evenly spread, bits per byte kept."""
    docs = load_documents(DataConfig())
    full, _ = pack(docs, tok, DataConfig(val_fraction=0.3, val_max_tokens=0), tmp_path / "full")
    capped, _ = pack(docs, tok, DataConfig(val_fraction=0.3, val_max_tokens=4096), tmp_path / "capped")
    val, kept = load_split(tmp_path / "full", "val"), load_split(tmp_path / "capped", "val")
    assert full.tokens["val"] > 4096 and capped.val_kept_of == full.tokens["val"] and len(kept) == 4096
    assert np.array_equal(kept[:2048], val[:2048]) and np.array_equal(kept[-2048:], val[-2048:])  # spread to both ends
    assert np.array_equal(load_split(tmp_path / "capped", "train"), load_split(tmp_path / "full", "train"))
    assert capped.bits_per_token("val") == pytest.approx(full.bits_per_token("val"), rel=1e-3)
    assert full.val_kept_of is None and "val_kept_of" not in json.loads((tmp_path / "full" / "meta.json").read_text())


def test_split_is_deterministic_and_by_document() -> None:
    docs = load_documents(DataConfig())
    a = split_documents(docs, 0.1, seed=0)
    b = split_documents(docs, 0.1, seed=0)
    c = split_documents(docs, 0.1, seed=1)
    assert [d.name for d in a["val"]] == [d.name for d in b["val"]]
    assert [d.name for d in a["val"]] != [d.name for d in c["val"]]
    assert not {d.name for d in a["val"]} & {d.name for d in a["train"]}


def test_text_dir_and_jsonl_sources(tmp_path: Path, tok: GGUFTokenizer) -> None:
    (tmp_path / "one.txt").write_text("first doc\n---\nsecond doc\n---\nthird doc\n")
    assert len(load_documents(DataConfig(source="text", path=str(tmp_path / "one.txt")))) == 3
    d = tmp_path / "dir"
    (d / "sub").mkdir(parents=True)
    (d / "a.txt").write_text("alpha")
    (d / "sub" / "b.txt").write_text("beta")
    (d / "skip.md").write_text("not matched")
    docs = load_documents(DataConfig(source="dir", path=str(d)))
    assert [x.name for x in docs] == ["a.txt", "sub/b.txt"]
    j = tmp_path / "c.jsonl"
    j.write_text("\n".join(json.dumps({"body": f"doc {i} " * 20}) for i in range(10)) + "\n")
    cfg = DataConfig(source="jsonl", path=str(j), text_field="body", val_fraction=0.2)
    meta, _ = pack(load_documents(cfg), tok, cfg, tmp_path / "packed")
    assert meta.documents == {"train": 8, "val": 2}
    assert load_meta(tmp_path / "packed").source == "jsonl"


def test_bos_setting_overrides_the_gguf_flag(tmp_path: Path, tok: GGUFTokenizer) -> None:
    (tmp_path / "t.txt").write_text("a b c\n---\nd e f\n")
    cfg = DataConfig(source="text", path=str(tmp_path / "t.txt"), add_bos="true", val_fraction=0.5)
    meta, _ = pack(load_documents(cfg), tok, cfg, tmp_path / "p")
    train = load_split(tmp_path / "p", "train")
    assert meta.bos_id == tok.bos_id and int(train[0]) == tok.bos_id and int(train[-1]) == tok.eos_id


@pytest.mark.parametrize(
    ("content", "needles"),
    [
        ('{"text": "ok"}\n{"text": "fine"}\nnot json\n', ["line 3", "invalid JSON"]),
        ('{"text": "ok"}\n{"body": "wrong field"}\n', ["line 2", "'text'"]),
    ],
)
def test_malformed_jsonl_names_the_line(tmp_path: Path, content: str, needles: list[str]) -> None:
    p = tmp_path / "bad.jsonl"
    p.write_text(content)
    with pytest.raises(DataError) as err:
        load_documents(DataConfig(source="jsonl", path=str(p)))
    for needle in needles:
        assert needle in str(err.value)


def test_missing_and_tiny_corpora(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="found nothing at .*missing.txt; fix: check data.path .*git"):
        load_documents(DataConfig(source="text", path=str(tmp_path / "missing.txt")))
    with pytest.raises(DataError, match="expected an existing file, found a directory; fix: use data=dir"):
        load_documents(DataConfig(source="text", path=str(tmp_path)))
    (tmp_path / "c.txt").write_text("a\n---\nb\n")
    with pytest.raises(DataError, match="expected an existing directory, found a file; fix: use data=text"):
        load_documents(DataConfig(source="dir", path=str(tmp_path / "c.txt")))
    (tmp_path / "one.txt").write_text("only one document")
    with pytest.raises(DataError, match="at least 2"):
        load_documents(DataConfig(source="text", path=str(tmp_path / "one.txt")))
    with pytest.raises(DataError, match="data.glob"):
        load_documents(DataConfig(source="dir", path=str(tmp_path), glob="*.none"))


def test_missing_pack_output_is_named(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="dvc repro pack"):
        load_meta(tmp_path / "nothing")
