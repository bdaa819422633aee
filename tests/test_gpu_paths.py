"""The paths a GPU takes, checked against the plain ones: on this CPU by forcing them where they
are device-independent math, and on CUDA itself in the tests marked `cuda` (skipped without one)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from pipeline.config import OptimConfig, TrainConfig
from pipeline.data.packed import load_split
from pipeline.errors import NonFiniteError
from pipeline.inference import decode
from pipeline.inference.decode import PackedLlama
from pipeline.inference.sampling import generate_ids
from pipeline.modeldir import load_model_dir
from pipeline.models.llama import Llama
from pipeline.models.ops import losses
from pipeline.models.ops.losses import (
    ACCELERATOR_SIZES,
    IGNORE_INDEX,
    linear_cross_entropy,
    linear_distill_loss,
    top_k_targets,
)
from pipeline.models.registry import build_model
from pipeline.models.transformer import TransformerConfig, init_weights
from pipeline.training import checkpoint as ckpt
from pipeline.training import queued
from pipeline.training.loop import Hooks, TrainJob, _Run, train
from pipeline.training.resume import plan_checkpoints
from tests.test_resume import TCFG, assert_same_weights, make_project, nan_after, run_lib


def _problem(rows: int, vocab: int, width: int, device: str = "cpu"):
    g = torch.Generator().manual_seed(0)
    h = torch.randn(rows, width, generator=g).to(device).requires_grad_()
    w = (torch.randn(vocab, width, generator=g) * 0.1).to(device).requires_grad_()
    t = torch.randint(0, vocab, (rows,), generator=g).to(device)
    teacher = tuple(x.to(device) for x in top_k_targets(torch.randn(rows, vocab, generator=g), 8))
    return h, w, t, teacher


def _loss_and_grads(distill: bool, h, w, t, teacher, device: str = "cpu"):
    with torch.autocast(device, dtype=torch.bfloat16):
        loss = linear_distill_loss(h, w, t, teacher, 0.5, 2.0)[0] if distill else linear_cross_entropy(h, w, t)
    return (loss.detach().float(), *torch.autograd.grad(loss, (h, w)))


def _close(got, ref) -> None:
    assert float(got[0]) == pytest.approx(float(ref[0]), abs=2e-3)
    for a, b in zip(got[1:], ref[1:]):
        assert (a.float() - b.float()).abs().max() <= 2e-2 * b.float().abs().max()


@pytest.mark.parametrize("distill", [False, True])
def test_accelerator_sized_loss_chunks_equal_the_cpu_sized_ones(distill: bool, monkeypatch) -> None:
    """A GPU runs the chunked losses in few large chunks, each softmaxed whole (`ACCELERATOR_SIZES`):
    the same loss and gradients as the CPU's small cache-sized blocks, to bf16 rounding."""
    h, w, t, teacher = _problem(1500, 3000, 32)
    ref = _loss_and_grads(distill, h, w, t, teacher)
    monkeypatch.setattr(losses, "chunk_sizes", lambda device: ACCELERATOR_SIZES)
    calls = []
    real = losses._rows_within
    monkeypatch.setattr(losses, "_rows_within", lambda *a: calls.append(real(*a)) or calls[-1])
    got = _loss_and_grads(distill, h, w, t, teacher)
    assert calls == [8192]  # one chunk holds all 1500 rows (not 1024 rows in 64-row blocks)
    _close(got, ref)


@pytest.mark.cuda
@pytest.mark.parametrize("distill", [False, True])
def test_chunked_losses_on_cuda_equal_the_cpu(distill: bool) -> None:
    """The chunked losses on CUDA (accelerator sizes, CUDA kernels) against the CPU path."""
    cpu = _loss_and_grads(distill, *_problem(3000, 49152 // 8, 64))
    got = _loss_and_grads(distill, *_problem(3000, 49152 // 8, 64, "cuda"), device="cuda")
    _close([x.cpu() for x in got], cpu)


# --- the loop reads a GPU step's figures only when it logs (pipeline.training.queued) ---------------


@pytest.fixture(scope="module")
def project(tmp_path_factory, smollm2) -> Path:
    return make_project(tmp_path_factory.mktemp("queued"), smollm2)


def _train(project: Path, tcfg: TrainConfig, model=None, plan=None):
    packed = project / "data" / "packed"
    model = model or load_model_dir(project / "models" / "init")
    splits = load_split(packed, "train"), load_split(packed, "val")
    result = train(model, *splits, TrainJob(tcfg, OptimConfig(lr=3e-3, warmup_steps=2), 0, plan=plan, progress=False))
    return model, result


def _figures(result) -> list[dict[str, float]]:
    return [{k: v for k, v in row.items() if k != "tokens_per_second"} for row in result.history]


@pytest.fixture
def queued_on_cpu(monkeypatch):
    """The CUDA loop's queued figures, forced on this CPU (fused AdamW's `found_inf` works here too)."""
    monkeypatch.setattr(queued, "DEFER_ON", ("cuda", "cpu"))


def test_queued_figures_give_the_same_run(project: Path, monkeypatch) -> None:
    """Reading loss and gradient norm only at log steps changes nothing: same weights, same logged rows."""
    tcfg = replace(TCFG, log_every=3)
    eager, eager_result = _train(project, tcfg)
    monkeypatch.setattr(queued, "DEFER_ON", ("cuda", "cpu"))
    seen = []
    monkeypatch.setattr(
        queued.QueuedSteps, "add", lambda self, step, row: seen.append(step) or self.rows.append((step, row))
    )
    model, result = _train(project, tcfg)
    assert seen == list(range(8))  # every step went through the queue
    assert_same_weights(eager.state_dict(), model.state_dict())
    assert _figures(result) == _figures(eager_result) and [r["step"] for r in result.history] == [1, 3, 4, 6, 8]
    assert all(r["tokens_per_second"] > 0 for r in result.history)


def test_queued_nonfinite_step_stops_naming_it_before_the_next_checkpoint(
    project: Path, tmp_path: Path, queued_on_cpu
) -> None:
    """A NaN at step 5 is read at step 6's checkpoint: the error names step 5 and step 6 is not written."""
    tcfg = replace(TCFG, log_every=100, eval_every=100)
    plan = plan_checkpoints(
        tcfg, OptimConfig(lr=3e-3, warmup_steps=2), 0, project / "models/init", project / "data/packed", tmp_path
    )
    model = load_model_dir(project / "models/init")
    nan_after(model, 5)
    with pytest.raises(NonFiniteError) as err:
        _train(project, tcfg, model, plan)
    assert str(err.value).startswith("train step 5:") and "step-00000004" in str(err.value)
    assert [s for s, _ in ckpt.step_dirs(plan.root)] == [4, 2]


def test_queued_skip_of_a_nonfinite_step_equals_the_host_side_skip(project: Path, monkeypatch) -> None:
    """Fused AdamW skipping on the device (`found_inf`) leaves the same weights as not calling `step()`."""
    tcfg = replace(TCFG, skip_nonfinite=True, log_every=4)
    eager = load_model_dir(project / "models/init")
    nan_after(eager, 3)
    eager, eager_result = _train(project, tcfg, eager)
    monkeypatch.setattr(queued, "DEFER_ON", ("cuda", "cpu"))
    model = load_model_dir(project / "models/init")
    nan_after(model, 3)
    model, result = _train(project, tcfg, model)
    assert result.skipped_steps == eager_result.skipped_steps == 1
    assert [r["skipped_steps"] for r in result.history] == [0, 1, 1]  # steps 1, 4, 8
    assert_same_weights(eager.state_dict(), model.state_dict())


@pytest.mark.cuda
def test_cuda_runs_are_bit_identical_and_resume_exactly(project: Path, tmp_path: Path) -> None:
    """On CUDA (queued figures, large loss chunks): two runs give the same weights, and a run resumed
    from its step-4 checkpoint ends with the same weights and losses as the uninterrupted one."""
    tcfg = replace(TCFG, device="cuda", log_every=3)
    first, first_result, plan = run_lib(project, tcfg, tmp_path / "a")
    second, _, _ = run_lib(project, tcfg, tmp_path / "b")
    assert_same_weights(first.state_dict(), second.state_dict())
    for s in (8, 6):
        ckpt.shutil.rmtree(plan.root / ckpt.step_name(s))
    resumed, result, _ = run_lib(project, tcfg, tmp_path / "a")
    assert result.resumed_from == 4
    assert_same_weights(first.state_dict(), resumed.state_dict())
    assert _figures(result) == _figures(first_result)


# --- decoding on CUDA: the one-token step replayed as a CUDA graph ----------------------------------


@pytest.mark.cuda
@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_cuda_graph_decode_gives_the_eager_steps_ids_and_logits(precision: str, monkeypatch) -> None:
    """Greedy ids from graph replays equal the eager dynamic step's, across a cache that grows (a new
    buffer: a new capture) and two generations (the second reuses or recaptures, never a stale graph)."""
    monkeypatch.setattr(decode, "_FIRST_CAPACITY", 4)  # x4 on CUDA: buffers of 16, 32, 64 positions
    model = Llama(TransformerConfig(96, 64, 4, 4, 2, 96, 128, 100000.0, 1e-5))
    init_weights(model, 0.2, seed=0)
    graphed = PackedLlama(model, precision, "cuda")
    eager = PackedLlama(model, precision, "cuda")
    eager.step_mode = "dynamic"
    prompt = torch.randint(0, 96, (7,), generator=torch.Generator().manual_seed(3)).tolist()
    for _ in range(2):
        assert generate_ids(graphed, prompt, 40) == generate_ids(eager, prompt, 40)
    assert graphed.graphs and not eager.graphs
    x = torch.tensor([prompt], device="cuda")
    with torch.inference_mode():
        caches = graphed.new_cache(), eager.new_cache()
        graphed(x, caches[0]), eager(x, caches[1])
        step = torch.tensor([[5]], device="cuda")
        torch.testing.assert_close(graphed(step, caches[0]), eager(step, caches[1]), rtol=0, atol=1e-3)


# --- nothing in a queued CUDA step waits for the device ----------------------------------------------


def _packed_problem(arch: str):
    """A tiny model and two packed rows: examples of 7 and 9 tokens then padding, a 3-token example
    filling the second row; prompt positions (IGNORE_INDEX) in each."""
    cfg = TransformerConfig(
        vocab_size=50, d_model=32, n_layer=2, n_head=2, n_kv_head=1 if arch == "llama" else 2, d_ff=64,
        context_length=32, arch=arch,
    )  # fmt: skip
    model = build_model(cfg)
    init_weights(model, 0.1, 0)
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 50, (2, 20), generator=g)
    y = torch.randint(0, 50, (2, 20), generator=g)
    seg = torch.tensor([[1] * 7 + [2] * 9 + [0] * 4, [1] * 3 + [2] * 17])
    y[0, :3] = y[0, 7:11] = y[1, :2] = IGNORE_INDEX
    y[seg == 0] = IGNORE_INDEX
    return model, x, y, seg


@pytest.mark.cuda
@pytest.mark.parametrize("arch", ["llama", "gpt2"])
@pytest.mark.parametrize("packed", [False, True])
def test_host_labels_give_the_all_device_loss_and_gradients(arch: str, packed: bool) -> None:
    """Labels and segment ids left on the host (as the loop leaves them on CUDA) give exactly the loss
    and gradients of the same batch all on the GPU."""
    model, x, y, seg = _packed_problem(arch)
    model = model.cuda()
    extra = (seg,) if packed else ()

    def loss_and_grads(*batch):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model.loss(*batch)
        return loss.detach(), torch.autograd.grad(loss, list(model.parameters()))

    host = loss_and_grads(x.cuda(), y, *extra)
    device = loss_and_grads(x.cuda(), y.cuda(), *(t.cuda() for t in extra))
    assert torch.equal(host[0], device[0])
    assert all(torch.equal(a, b) for a, b in zip(host[1], device[1]))


@pytest.mark.cuda
def test_packed_rows_step_from_host_labels_never_waits_for_the_device() -> None:
    """Forward and backward of packed rows whose labels and segment ids are on the host: no call in them
    synchronizes with the GPU (`set_sync_debug_mode("error")` raises on any that does)."""
    model, x, y, seg = _packed_problem("llama")
    model = model.cuda()
    x = x.cuda()
    model.loss(x, y, seg).backward()  # warm-up: lazy initialisations may synchronize once
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model.loss(x, y, seg)
        loss.backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.cuda
def test_a_queued_cuda_training_step_never_waits_for_the_device(project: Path) -> None:
    """The loop's steps between two log steps (batches, forward, loss, backward, clipping, fused AdamW
    with its on-device skip) queue work without one synchronizing call."""
    packed = project / "data" / "packed"
    model = load_model_dir(project / "models" / "init")
    tcfg = replace(TCFG, device="cuda", log_every=100, eval_every=100)
    run = _Run(
        model,
        load_split(packed, "train"),
        load_split(packed, "val"),
        TrainJob(tcfg, OptimConfig(), 0),
        Hooks(),
        None,
        None,
    )
    assert run.queue is not None
    run.step(0)  # warm-up: lazy initialisations may synchronize once
    steps_without_sync(run, range(1, 4))


def steps_without_sync(run: _Run, steps: range) -> None:
    """Run the loop's `steps` with any call that synchronizes with the GPU raising, then read their figures."""
    torch.cuda.set_sync_debug_mode("error")
    try:
        for step in steps:
            run.step(step)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    run.read_queued()
