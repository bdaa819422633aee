"""Sharded pack: N jobs plus a merge give exactly the 1-shard pack's train/val ids and counts; shard keys
are checked; a merge with a missing or foreign shard is one line naming the shard's file."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from pipeline.config import DataConfig
from pipeline.data import shards as shards_mod
from pipeline.data.corpus import iter_documents
from pipeline.data.packed import load_meta
from pipeline.data.shards import merge_shards, pack_shard, shard_name
from pipeline.data.text import pack
from pipeline.errors import ConfigError, DataError
from pipeline.tokenizer.gguf_tokenizer import GGUFTokenizer, tokenizer_from_gguf
from tests.conftest import ROOT


@pytest.fixture(scope="module")
def tok(smollm2) -> GGUFTokenizer:
    return tokenizer_from_gguf(smollm2)


def corpus(tmp_path: Path, n: int = 41) -> Path:
    p = tmp_path / "c.jsonl"
    p.write_text("".join(json.dumps({"text": f"document {i}: " + "word " * (i % 7 + 1)}) + "\n" for i in range(n)))
    return p


def sharded(tmp_path: Path, tok: GGUFTokenizer, n: int, **kw) -> DataConfig:
    """Every shard job of a `n`-shard pack of the corpus, run one after another."""
    cfg = DataConfig(source="jsonl", path=str(corpus(tmp_path)), shard_dir=str(tmp_path / "shards"), num_shards=n, **kw)
    for k in range(n):
        job = DataConfig(**{**cfg.__dict__, "shard_index": k})
        pack_shard(iter_documents(job), tok, job)
    return cfg


@pytest.mark.parametrize("n", [2, 3, 5])
def test_merged_shards_equal_the_one_shard_pack(tmp_path: Path, tok: GGUFTokenizer, monkeypatch, n: int) -> None:
    monkeypatch.setattr(shards_mod, "SHARD_BLOCK", 4)  # 41 documents in 11 blocks, interleaved over the shards
    cfg = sharded(tmp_path, tok, n, val_fraction=0.2, split_seed=7)
    one = DataConfig(**{**cfg.__dict__, "num_shards": 1, "shard_index": 0})
    whole, _ = pack(iter_documents(one), tok, one, tmp_path / "whole")
    meta, metrics = merge_shards(cfg, tok.fingerprint(), tmp_path / "merged")
    for split in ("train", "val"):
        assert (tmp_path / "merged" / f"{split}.bin").read_bytes() == (tmp_path / "whole" / f"{split}.bin").read_bytes()
    loaded = load_meta(tmp_path / "merged")
    assert (loaded.documents, loaded.tokens, loaded.bytes) == (whole.documents, whole.tokens, whole.bytes)
    assert (loaded.distinct_tokens, loaded.data, loaded.shards) == (whole.distinct_tokens, whole.data, n)
    assert loaded.corpus_sha256 != whole.corpus_sha256  # documented: the sha256 of the shards' fingerprints
    assert metrics["shards"] == n and metrics["tokens"] == sum(whole.tokens.values())
    sizes = [
        json.loads((Path(cfg.shard_dir) / shard_name(k, n) / "shard.json").read_text())["documents"] for k in range(n)
    ]
    assert sum(sizes) == 41 and min(sizes) > 0


def test_shard_index_out_of_range_is_named() -> None:
    with pytest.raises(ConfigError, match=r"data\.shard_index.*\[0, data\.num_shards=4\).*found 4"):
        DataConfig(source="jsonl", path="x.jsonl", num_shards=4, shard_index=4)
    with pytest.raises(ConfigError, match=r"data\.num_shards"):
        DataConfig(source="instruct", num_shards=2)


def test_merge_with_a_missing_shard_names_it(tmp_path: Path, tok: GGUFTokenizer) -> None:
    cfg = sharded(tmp_path, tok, 3)
    shutil.rmtree(Path(cfg.shard_dir) / shard_name(1, 3))
    with pytest.raises(DataError) as err:
        merge_shards(cfg, tok.fingerprint(), tmp_path / "merged")
    assert "shard-00001-of-00003" in str(err.value) and "data.shard_index=1" in str(err.value)
    assert "\n" not in str(err.value) and not (tmp_path / "merged").exists()


def test_merge_with_a_foreign_shard_names_its_file(tmp_path: Path, tok: GGUFTokenizer) -> None:
    cfg = sharded(tmp_path, tok, 2)
    other = DataConfig(**{**cfg.__dict__, "split_seed": 5, "shard_index": 1})  # another config's shard 1
    pack_shard(iter_documents(other), tok, other)
    with pytest.raises(DataError) as err:
        merge_shards(cfg, tok.fingerprint(), tmp_path / "merged")
    assert f"{shard_name(1, 2)}/shard.json" in str(err.value) and "another config" in str(err.value)
    with pytest.raises(DataError, match="another config or tokenizer"):
        merge_shards(cfg, "0" * 64, tmp_path / "merged")  # shards made with another tokenizer
    assert not (tmp_path / "merged").exists()


@pytest.mark.parametrize(
    "file, damage",
    [
        ("documents.npy", lambda f: f.write_bytes(f.read_bytes()[:150])),  # copied in part
        ("documents.npy", lambda f: f.write_text("garbage")),
        ("seen.npy", lambda f: f.write_text("garbage")),
        ("tokens.bin", lambda f: f.write_bytes(f.read_bytes()[:10])),
        ("shard.json", lambda f: f.write_text("[1]")),
        ("shard.json", lambda f: f.write_text(json.dumps({**json.loads(f.read_text()), "vocab_size": "x"}))),
    ],
)
def test_merge_of_a_damaged_shard_file_names_it_and_the_job_to_rerun(tmp_path: Path, tok: GGUFTokenizer, file, damage):
    """A shard copied in part from another machine (or edited) is one line naming the file, not a numpy crash."""
    cfg = sharded(tmp_path, tok, 2)
    damage(Path(cfg.shard_dir) / shard_name(0, 2) / file)  # shard 0 holds all 41 documents
    with pytest.raises(DataError) as err:
        merge_shards(cfg, tok.fingerprint(), tmp_path / "merged")
    message = str(err.value)
    assert f"{shard_name(0, 2)}/{file}" in message and "data.shard_index=0" in message and "\n" not in message
    assert not (tmp_path / "merged").exists()


def test_shard_files_are_small_and_flat(tmp_path: Path, tok: GGUFTokenizer) -> None:
    """A shard keeps ids (no text) plus 16 bytes a document and a bit per vocab entry."""
    cfg = sharded(tmp_path, tok, 2)
    d = Path(cfg.shard_dir) / shard_name(0, 2)
    per_doc = np.load(d / "documents.npy")
    assert per_doc.shape == (json.loads((d / "shard.json").read_text())["documents"], 2)
    assert (d / "tokens.bin").stat().st_size == int(per_doc[:, 0].sum()) * 2
    assert (d / "seen.npy").stat().st_size < tok.vocab_size // 8 + 256


def stage(cwd: Path, module: str, *overrides: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", module, *overrides, "tracking.enabled=false", "hydra.run.dir=logs"]
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_shard_jobs_as_a_hydra_multirun_then_the_merge_stage(tmp_path: Path) -> None:
    """The stage CLI end to end: `-m data.shard_index=0,1`, then `stages.pack_merge` gives the 1-job pack."""
    data = ["data=jsonl", f"data.path={corpus(tmp_path, 2500)}"]
    jobs = stage(tmp_path, "stages.pack", "-m", *data, "data.num_shards=2", "data.shard_index=0,1")
    assert jobs.returncode == 0, jobs.stderr[-2000:]
    short = stage(tmp_path, "stages.pack_merge", *data, "data.num_shards=3")  # shards of another count
    lines = [line for line in short.stderr.splitlines() if line.strip()]
    assert short.returncode == 2 and len(lines) == 1 and "shard-00000-of-00003" in lines[0], short.stderr
    merged = stage(tmp_path, "stages.pack_merge", *data, "data.num_shards=2")
    assert merged.returncode == 0, merged.stderr[-2000:]
    assert json.loads((tmp_path / "metrics" / "pack.json").read_text())["shards"] == 2
    (tmp_path / "data" / "packed").rename(tmp_path / "merged")
    assert stage(tmp_path, "stages.pack", *data).returncode == 0
    for split in ("train", "val"):
        assert (tmp_path / "merged" / f"{split}.bin").read_bytes() == (
            tmp_path / "data/packed" / f"{split}.bin"
        ).read_bytes()
