"""Overfitting handled: the best weights by val loss are the ones kept (and survive resume),
early stopping ends a run that stopped improving, and `train.epochs` sizes a run in passes."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from pipeline.config import ModelConfig, OptimConfig, TrainConfig
from pipeline.data.packed import Packed, load_split
from pipeline.errors import ConfigError
from pipeline.init.realize import realize
from pipeline.modeldir import load_model_dir
from pipeline.training import checkpoint as ckpt
from pipeline.training.batches import check_batches, epochs_planned, steps_for_epochs
from pipeline.training.validation import evaluate_loss
from tests.test_resume import assert_same_weights, make_project, run_lib

pytestmark = pytest.mark.usefixtures("one_thread")

# A high constant LR on a small split: val loss rises and falls, so the last step is not the best.
OVERFIT = TrainConfig(
    steps=24, batch_size=4, seq_len=32, eval_every=2, log_every=1, checkpoint_every=5, keep_checkpoints=9
)
HOT = OptimConfig(lr=0.05, warmup_steps=0, min_lr_ratio=1.0)


@pytest.fixture(scope="module")
def project(tmp_path_factory, smollm2) -> Path:
    return make_project(tmp_path_factory.mktemp("best"), smollm2, n_docs=4)


def val_losses(result) -> dict[int, float]:
    return {int(h["step"]): h["val_loss"] for h in result.history if "val_loss" in h}


def weights_loss(project: Path, weights: dict[str, torch.Tensor]) -> float:
    model = load_model_dir(project / "models" / "init")
    model.load_state_dict(weights)
    return evaluate_loss(model, load_split(project / "data" / "packed", "val"), 32, 4, torch.device("cpu"))


def test_keep_best_returns_the_weights_of_the_lowest_val_loss(project: Path, tmp_path: Path) -> None:
    _, result, _ = run_lib(project, OVERFIT, tmp_path, HOT)
    losses = val_losses(result)
    best = min(losses, key=losses.get)
    assert best < OVERFIT.steps, losses  # the setup must make the last step worse than an earlier one
    assert result.kept_step == best and result.kept_val_loss == losses[best]
    assert weights_loss(project, result.weights) == pytest.approx(losses[best], abs=1e-6)
    assert result.final_val_loss == losses[OVERFIT.steps]  # the last evaluation is still reported


def test_keep_best_off_returns_the_last_weights(project: Path, tmp_path: Path) -> None:
    model, result, _ = run_lib(project, replace(OVERFIT, keep_best=False), tmp_path, HOT)
    assert result.kept_step == OVERFIT.steps and result.kept_val_loss == result.final_val_loss
    assert_same_weights(result.weights, model.state_dict())


def test_resume_keeps_the_best_weights_of_before_the_interruption(project: Path, tmp_path: Path) -> None:
    _, full, plan = run_lib(project, OVERFIT, tmp_path, HOT)
    for step, path in ckpt.step_dirs(plan.root):  # as if the process had died right after step 15
        if step > 15:
            ckpt.shutil.rmtree(path)
    state = ckpt.validate(plan.root / ckpt.step_name(15)).state
    assert state["best_step"] < 15 and "best.safetensors" in state["files"]  # the best so far rides along
    _, resumed, _ = run_lib(project, OVERFIT, tmp_path, HOT)
    assert resumed.resumed_from == 15 and resumed.kept_step == full.kept_step
    assert_same_weights(full.weights, resumed.weights)


def test_early_stop_ends_after_patience_evaluations_without_a_new_best(project: Path, tmp_path: Path) -> None:
    tcfg = replace(OVERFIT, early_stop_patience=2)
    _, result, plan = run_lib(project, tcfg, tmp_path, HOT)
    losses = val_losses(result)
    steps = sorted(losses)
    assert result.stopped_early and result.steps == steps[-1] < tcfg.steps
    after = [s for s in steps if s > result.kept_step]
    assert len(after) == 2 and all(losses[s] >= losses[result.kept_step] for s in after)
    assert ckpt.step_dirs(plan.root)[0][0] == result.steps  # the stop is checkpointed
    _, again, _ = run_lib(project, tcfg, tmp_path, HOT)  # a re-run resumes there and does not go on
    assert again.resumed_from == result.steps and again.steps == result.steps
    assert_same_weights(again.weights, result.weights)


def test_epochs_size_the_run_for_streams_and_rows() -> None:
    stream = np.zeros(10_000, dtype=np.uint16)
    tcfg = TrainConfig(batch_size=4, seq_len=50, epochs=3)  # 200 tokens a step: 50 steps a pass
    assert steps_for_epochs(stream, tcfg) == 150
    rows = Packed(np.zeros((53, 8), np.int32), np.zeros((53, 8), np.int32), np.zeros((53, 8), np.int16))
    steps = steps_for_epochs(rows, TrainConfig(batch_size=4, epochs=3))
    assert steps == 40 and epochs_planned(rows, TrainConfig(batch_size=4, steps=steps)) >= 3


def test_a_batch_larger_than_the_packed_rows_is_a_named_error() -> None:
    rows = Packed(np.zeros((3, 8), np.int64), np.zeros((3, 8), np.int64), np.ones((3, 8), np.int32))
    model = realize(
        ModelConfig(d_model=32, n_layer=1, n_head=4, n_kv_head=2, d_ff=64, context_length=16), "scratch", 64, 0
    )
    with pytest.raises(ConfigError, match=r"train.batch_size: expected at most the 3 packed train rows.*found 4"):
        check_batches(model, rows, rows, TrainConfig(batch_size=4), OptimConfig())
