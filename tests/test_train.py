"""The training loop: schedule shape, learning on real packed text, deterministic validation,
and named errors for batch shapes the data cannot serve."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from pipeline.config import ModelConfig, OptimConfig, TrainConfig
from pipeline.errors import ConfigError
from pipeline.realize import realize
from pipeline.train import BatchSampler, evaluate_loss, lr_at, train

TINY = ModelConfig(d_model=32, n_layer=2, n_head=4, n_kv_head=2, d_ff=64, context_length=64)


def test_lr_warmup_cosine_floor_and_restarts() -> None:
    o = OptimConfig(lr=1.0, warmup_steps=10, min_lr_ratio=0.1)
    lrs = [lr_at(s, o, 110) for s in range(110)]
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == pytest.approx(1.0)
    assert all(a >= b for a, b in zip(lrs[10:], lrs[11:]))
    assert lrs[-1] == pytest.approx(0.1, abs=1e-3) and min(lrs[10:]) >= 0.1 - 1e-9
    r = OptimConfig(lr=1.0, warmup_steps=0, min_lr_ratio=0.0, cycle_steps=20)
    assert lr_at(0, r, 100) == pytest.approx(1.0) and lr_at(20, r, 100) == pytest.approx(1.0)
    assert lr_at(10, r, 100) == pytest.approx(0.5)


def test_sampler_is_seeded() -> None:
    data = np.arange(1000, dtype=np.uint16)
    a, b = BatchSampler(data, 4, 16, seed=1), BatchSampler(data, 4, 16, seed=1)
    xa, ya = a()
    xb, yb = b()
    assert torch.equal(xa, xb) and torch.equal(ya, yb)
    assert torch.equal(xa[:, 1:], ya[:, :-1])


@pytest.fixture(scope="module")
def packed(tmp_path_factory, smollm2):
    """Real text (the language reference) packed with the donor tokenizer, vocab remapped small."""
    from pipeline.config import DataConfig
    from pipeline.corpus import load_documents
    from pipeline.pack import encode_documents
    from pipeline.tokenizer import tokenizer_from_gguf

    docs = load_documents(DataConfig())[:12]
    ids = encode_documents(docs, tokenizer_from_gguf(smollm2), False, True)
    return ids[:-4000], ids[-4000:]


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_loss_goes_down_on_real_text(packed, precision: str) -> None:
    train_ids, val_ids = packed
    model = realize(TINY, "scratch", 49152, 0)
    before = evaluate_loss(model, val_ids, 32, 8, torch.device("cpu"))
    tcfg = TrainConfig(steps=30, batch_size=8, seq_len=32, eval_every=15, log_every=5, precision=precision)
    logged = []
    result, opt = train(
        model,
        train_ids,
        val_ids,
        tcfg,
        OptimConfig(lr=3e-3, warmup_steps=5),
        0,
        log=lambda m, s: logged.append((s, m)),
        progress=False,
    )
    assert result.final_val_loss < before - 0.5
    assert math.isfinite(result.final_train_loss)
    assert [s for s, m in logged if "val_loss" in m] == [15, 30]
    assert {"train_loss", "lr", "grad_norm", "tokens_per_second"} <= set(logged[0][1])
    assert result.final_val_loss == pytest.approx(evaluate_loss(model, val_ids, 32, 8, torch.device("cpu")))
    assert len(opt.state) == sum(1 for p in model.parameters() if p.requires_grad)


def test_training_is_reproducible(packed) -> None:
    train_ids, val_ids = packed
    tcfg = TrainConfig(steps=4, batch_size=2, seq_len=16, eval_every=4, log_every=1, precision="fp32")
    runs = []
    for _ in range(2):
        m = realize(TINY, "scratch", 49152, 0)
        result, _ = train(m, train_ids, val_ids, tcfg, OptimConfig(), 7, progress=False)
        runs.append(([h["train_loss"] for h in result.history], m.state_dict()))
    assert runs[0][0] == runs[1][0]
    for a, b in zip(runs[0][1].values(), runs[1][1].values()):
        assert torch.equal(a, b)


def test_grad_accumulation_runs(packed) -> None:
    train_ids, val_ids = packed
    tcfg = TrainConfig(steps=2, batch_size=2, seq_len=16, grad_accum=3, eval_every=2, log_every=1)
    result, _ = train(realize(TINY, "scratch", 49152, 0), train_ids, val_ids, tcfg, OptimConfig(), 0, progress=False)
    assert result.tokens_seen == 2 * 2 * 16 * 3


def test_batch_larger_than_split_is_named() -> None:
    data = np.arange(100, dtype=np.uint16)
    tcfg = TrainConfig(steps=1, batch_size=8, seq_len=32)
    with pytest.raises(ConfigError, match="train.batch_size x train.seq_len"):
        train(realize(TINY, "scratch", 49152, 0), data, data, tcfg, OptimConfig(), 0, progress=False)


def test_seq_len_beyond_context_is_named() -> None:
    data = np.arange(10_000, dtype=np.uint16)
    tcfg = TrainConfig(steps=1, batch_size=1, seq_len=128)
    with pytest.raises(ConfigError, match="context_length=64"):
        train(realize(TINY, "scratch", 49152, 0), data, data, tcfg, OptimConfig(), 0, progress=False)
