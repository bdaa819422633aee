"""Weighted mixtures: train-token shares follow the weights, deterministic, val documents never repeated into
train, per-source counts in meta and metrics; bad weights and bad sources are one line naming the key."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from pipeline.config import DataConfig
from pipeline.config.data_schema import MixSource
from pipeline.data.mixture import pack_mixture, val_flags
from pipeline.data.packed import load_meta, load_split
from pipeline.errors import ConfigError, DataError
from pipeline.tokenizer.gguf_tokenizer import GGUFTokenizer, tokenizer_from_gguf


@pytest.fixture(scope="module")
def tok(smollm2) -> GGUFTokenizer:
    return tokenizer_from_gguf(smollm2)


def jsonl(path: Path, n: int, word: str) -> str:
    path.write_text("".join(json.dumps({"text": f"{word} {i} " + f"{word} " * (i % 5 + 3)}) + "\n" for i in range(n)))
    return str(path)


def mix(tmp_path: Path, weights: tuple[float, float], sizes: tuple[int, int] = (300, 60), **kw) -> DataConfig:
    a, b = jsonl(tmp_path / "a.jsonl", sizes[0], "apple"), jsonl(tmp_path / "b.jsonl", sizes[1], "zebra")
    sources = [
        MixSource(source="jsonl", path=a, weight=weights[0]),
        MixSource(source="jsonl", path=b, weight=weights[1]),
    ]
    return DataConfig(source="mix", sources=sources, val_fraction=0.2, **kw)


@pytest.mark.parametrize("stop", ["first_exhausted", "all_exhausted"])
def test_shares_follow_the_weights(tmp_path: Path, tok: GGUFTokenizer, stop: str) -> None:
    cfg = mix(tmp_path, (0.7, 0.3), mix_stop=stop)
    meta, metrics = pack_mixture(cfg, tok, tmp_path / "out")
    a, b = meta.sources
    assert abs(a["share"] - 0.7) < 0.02 and abs(b["share"] - 0.3) < 0.02
    assert metrics["source0_share"] == a["share"] and metrics["source1_tokens_train"] == b["tokens_train"]
    assert load_meta(tmp_path / "out").sources == meta.sources
    assert len(load_split(tmp_path / "out", "train")) == meta.tokens["train"] == a["tokens_train"] + b["tokens_train"]
    if stop == "first_exhausted":  # b (60 documents at 30%) runs out first: a is down-sampled
        assert (a["passes"], b["passes"]) == (1, 1) and a["documents_train"] < 0.8 * 300
    else:  # a read once in full, b repeated to keep 30%
        assert a["documents_train"] + a["documents_val"] == 300 and b["passes"] >= 2


def test_val_documents_are_never_repeated_into_train(tmp_path: Path, tok: GGUFTokenizer) -> None:
    """Up-sampling repeats a source's train documents only; its val documents (the seeded hash) appear once."""
    cfg = mix(tmp_path, (0.5, 0.5), mix_stop="all_exhausted")
    meta, _ = pack_mixture(cfg, tok, tmp_path / "out")
    flags = val_flags(cfg.split_seed, 1, 0, 60, cfg.val_fraction)
    b = meta.sources[1]
    assert b["passes"] >= 3 and b["documents_val"] == int(flags.sum())
    val_text = tok.decode(np.asarray(load_split(tmp_path / "out", "val")).tolist())
    train_text = tok.decode(np.asarray(load_split(tmp_path / "out", "train")).tolist())
    for i in np.flatnonzero(flags).tolist():
        assert f"zebra {i} " in val_text and f"zebra {i} " not in train_text


def test_the_mixture_is_deterministic(tmp_path: Path, tok: GGUFTokenizer) -> None:
    cfg = mix(tmp_path, (2.0, 1.0))
    pack_mixture(cfg, tok, tmp_path / "one")
    pack_mixture(cfg, tok, tmp_path / "two")
    for f in ("train.bin", "val.bin", "meta.json"):
        assert (tmp_path / "one" / f).read_bytes() == (tmp_path / "two" / f).read_bytes()


@pytest.mark.parametrize(
    ("weights", "key"),
    [((0.5, -0.1), r"data\.sources\[1\]\.weight"), ((0.0, 0.0), r"data\.sources\[\*\]\.weight.*positive")],
)
def test_bad_weights_name_the_key(weights: tuple[float, float], key: str) -> None:
    sources = [MixSource(path="a.jsonl", weight=w) for w in weights]
    with pytest.raises(ConfigError, match=key):
        DataConfig(source="mix", sources=sources)


def test_sources_without_mix_and_mix_without_sources_are_named() -> None:
    with pytest.raises(ConfigError, match=r"data\.sources"):
        DataConfig(source="mix")
    with pytest.raises(ConfigError, match=r"data\.sources"):
        DataConfig(source="jsonl", path="a.jsonl", sources=[MixSource(path="b.jsonl")])
    with pytest.raises(ConfigError, match=r"data\.sources\[0\]\.source"):
        DataConfig(source="mix", sources=[MixSource(source="instruct", path="b.jsonl")])


@pytest.mark.parametrize(("content", "needle"), [(None, "data.sources[1].path="), ("\n\n", "documents, found none")])
def test_unreadable_or_empty_source_is_named(
    tmp_path: Path, tok: GGUFTokenizer, content: str | None, needle: str
) -> None:
    cfg = mix(tmp_path, (0.5, 0.5))
    bad = tmp_path / "bad.jsonl"
    if content is not None:
        bad.write_text(content)
    cfg.sources[1].path = str(bad)
    with pytest.raises(DataError) as err:
        pack_mixture(cfg, tok, tmp_path / "out")
    assert str(err.value).startswith("data.sources[1]") and needle in str(err.value) and "\n" not in str(err.value)
    assert not (tmp_path / "out").exists()
