"""Evaluate on a val split too short for one window of train.seq_len: the one-line error train and
teach give for it (it was a ZeroDivisionError in the loss's mean)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from pipeline.config import EvaluateConfig, PipelineConfig, TrainConfig
from pipeline.data.packed import PackMeta, write_meta, write_tokens
from pipeline.errors import ConfigError
from pipeline.evaluate.evaluate_text import run_evaluate
from tests.conftest import write_tiny_gguf

VOCAB = 64


def packed_dir(root: Path, val_tokens: int) -> Path:
    rng = np.random.default_rng(0)
    root.mkdir()
    tokens = {"train": 200, "val": val_tokens}
    for split, n in tokens.items():
        write_tokens(root, split, rng.integers(0, VOCAB, n).astype(np.uint16))
    write_meta(
        root, PackMeta(VOCAB, "uint16", "t" * 64, "c" * 64, "text", None, None, {"train": 1, "val": 1}, tokens, 8)
    )
    return root


def test_a_val_split_shorter_than_a_window_is_the_train_stages_one_line(tmp_path: Path) -> None:
    gguf = write_tiny_gguf(tmp_path / "model.gguf", vocab=VOCAB, width=16, model=True)
    packed = packed_dir(tmp_path / "packed", val_tokens=11)
    cfg = PipelineConfig(
        train=TrainConfig(seq_len=32, batch_size=2, device="cpu"),
        evaluate=EvaluateConfig(prompts=["a"], max_new_tokens=2, llamacpp_windows=0),
    )
    expected = (
        "config key train.seq_len: expected at most 10 (the val split has 11 tokens), found 32; "
        "fix: lower train.seq_len or pack a larger corpus"
    )
    with pytest.raises(ConfigError) as e:
        run_evaluate(gguf, packed, tmp_path / "train", cfg, gguf)
    assert str(e.value) == expected
    cfg.train.seq_len = 10  # exactly one window: scored
    metrics, _ = run_evaluate(gguf, packed, tmp_path / "train", cfg, gguf)
    assert np.isfinite(metrics["val_loss"])
