"""Training steps as CUDA graphs (`train.cuda_graph`): when a run may be graphed, the loop's graphed path
checked on CPU (each replay emulated by running the captured function again, as a failed capture does),
and on CUDA itself in the tests marked `cuda`."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from pipeline.config import LoraConfig, OptimConfig
from pipeline.data.packed import load_split
from pipeline.finetune.lora import attach_lora
from pipeline.modeldir import load_model_dir
from pipeline.models.llama import Llama
from pipeline.models.transformer import TransformerConfig
from pipeline.training import checkpoint as ckpt
from pipeline.training import graphed, queued
from pipeline.training.graphed import graphable
from pipeline.training.loop import Hooks, TrainJob, _Run
from tests.test_gpu_paths import _figures, _train, steps_without_sync
from tests.test_resume import TCFG, assert_same_weights, make_project, nan_after, run_lib

SMALL = TransformerConfig(vocab_size=50, d_model=32, n_layer=1, n_head=2, n_kv_head=1, d_ff=64, context_length=32)
CUDA = torch.device("cuda")  # a device name only: nothing here runs on it


@pytest.mark.parametrize(
    ("change", "windows", "queue", "why"),
    [
        ({"cuda_graph": False}, True, True, "train.cuda_graph=false"),
        ({}, False, True, "packed rows or images change shape"),
        ({}, True, False, "reads its loss on the host"),
        ({"activation_checkpointing": True}, True, True, "train.activation_checkpointing"),
    ],
)
def test_graphable_names_why_a_run_is_not_graphed(change: dict, windows: bool, queue: bool, why: str) -> None:
    tcfg = replace(TCFG, **{"cuda_graph": True, **change})
    assert why in graphable(tcfg, Llama(SMALL), CUDA, windows, queue)


def test_graphable_runs_are_cuda_token_windows_without_dropout() -> None:
    tcfg = replace(TCFG, cuda_graph=True)
    assert graphable(tcfg, Llama(SMALL), CUDA, True, True) is None
    assert graphable(replace(tcfg, compile=True), Llama(SMALL), CUDA, True, True) is None  # whole-forward graph
    assert graphable(tcfg, Llama(SMALL), torch.device("cpu"), True, True) == "device cpu"
    for p, graphed_ in ((0.05, False), (0.0, True)):
        lora = Llama(SMALL)
        attach_lora(lora, LoraConfig(rank=2, dropout=p, targets=("q", "v")))
        assert (graphable(tcfg, lora, CUDA, True, True) is None) == graphed_


@pytest.fixture(scope="module")
def project(tmp_path_factory, smollm2) -> Path:
    return make_project(tmp_path_factory.mktemp("graphed"), smollm2)


@pytest.fixture
def graphs_on_cpu(monkeypatch) -> list:
    """The graphed path forced on this CPU: queued figures, `graphable` saying yes, and each replay run as
    the eager function again, as `GraphedStep` does off CUDA); returns the GraphedSteps made."""
    monkeypatch.setattr(queued, "DEFER_ON", ("cuda", "cpu"))
    monkeypatch.setattr(graphed, "graphable", lambda *a: None)
    made = []
    real = graphed.GraphedStep.__init__
    monkeypatch.setattr(graphed.GraphedStep, "__init__", lambda self, *a, **k: made.append(self) or real(self, *a, **k))
    return made


@pytest.mark.parametrize("nan_at", [None, 3])
def test_graphed_steps_give_the_eager_runs_weights_and_figures(project: Path, nan_at, graphs_on_cpu, monkeypatch):
    """One step made at the first step and fed every later batch through its static tensors, gradients
    never zeroed by the loop, outputs copied per step, a non-finite step skipped on the device: the same
    weights and logged figures as the plain eager run."""
    tcfg = replace(TCFG, log_every=3, cuda_graph=True, skip_nonfinite=nan_at is not None)
    with monkeypatch.context() as plain:
        plain.setattr(graphed, "graphable", lambda *a: "off")
        eager = load_model_dir(project / "models" / "init")
        if nan_at:
            nan_after(eager, nan_at)
        eager, eager_result = _train(project, tcfg, eager)
        assert graphs_on_cpu == []
    model = load_model_dir(project / "models" / "init")
    if nan_at:
        nan_after(model, nan_at)
    model, result = _train(project, tcfg, model)
    assert len(graphs_on_cpu) == 1 and graphs_on_cpu[0].graph is None
    assert_same_weights(eager.state_dict(), model.state_dict())
    assert repr(_figures(result)) == repr(_figures(eager_result))  # repr: a skipped step's loss is nan
    assert result.skipped_steps == (1 if nan_at else 0)


@pytest.mark.cuda
def test_cuda_graph_runs_equal_eager_ones_and_resume_exactly(project: Path, tmp_path: Path) -> None:
    """On CUDA: a graphed run gives the eager (queued) run's weights and losses, and a graphed run resumed
    from its step-4 checkpoint ends as the uninterrupted one."""
    eager, eager_result, _ = run_lib(project, replace(TCFG, device="cuda", log_every=3), tmp_path / "e")
    tcfg = replace(TCFG, device="cuda", log_every=3, cuda_graph=True)
    first, first_result, plan = run_lib(project, tcfg, tmp_path / "g")
    assert_same_weights(eager.state_dict(), first.state_dict())
    assert _figures(first_result) == _figures(eager_result)
    for s in (8, 6):
        ckpt.shutil.rmtree(plan.root / ckpt.step_name(s))
    resumed, result, _ = run_lib(project, tcfg, tmp_path / "g")
    assert result.resumed_from == 4
    assert_same_weights(first.state_dict(), resumed.state_dict())


@pytest.mark.cuda
def test_cuda_graph_replays_never_wait_for_the_device(project: Path) -> None:
    """After the capture at step 0, a step is batch copies, one replay and fused AdamW: nothing in it
    synchronizes with the GPU (`set_sync_debug_mode("error")` raises at any call that does)."""
    packed = project / "data" / "packed"
    model = load_model_dir(project / "models" / "init")
    tcfg = replace(TCFG, device="cuda", log_every=100, eval_every=100, cuda_graph=True)
    splits = load_split(packed, "train"), load_split(packed, "val")
    run = _Run(model, *splits, TrainJob(tcfg, OptimConfig(), 0), Hooks(), None, None)
    run.step(0)
    assert run.graph is not None and run.graph.graph is not None  # captured, not the eager fallback
    steps_without_sync(run, range(1, 4))
