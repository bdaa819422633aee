"""The training loop: schedule shape, learning on real packed text, deterministic validation,
and named errors for batch shapes the data cannot serve."""

from __future__ import annotations

import ctypes
import math
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from pipeline.config import ModelConfig, OptimConfig, TrainConfig
from pipeline.errors import ConfigError
from pipeline.init.realize import realize
from pipeline.models.ops.varlen import PackedRows
from pipeline.training.batches import BatchSampler
from pipeline.training.loop import Hooks, TrainJob, train
from pipeline.training.optim import lr_at
from pipeline.training.runtime import HeapGuard, compile_blocks, keep_freed_memory, resident_bytes, trim_freed_memory
from pipeline.training.validation import evaluate_loss
from stages.train import PLOT_COLUMNS, loss_figure, metrics, plot_table, with_base_row

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
    from pipeline.data.corpus import load_documents
    from pipeline.data.text import encode_documents
    from pipeline.tokenizer.gguf_tokenizer import tokenizer_from_gguf

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
    result = train(
        model,
        train_ids,
        val_ids,
        TrainJob(tcfg, OptimConfig(lr=3e-3, warmup_steps=5), 0, progress=False),
        hooks=Hooks(log=lambda m, s: logged.append((s, m))),
    )
    assert result.final_val_loss < before - 0.5
    assert math.isfinite(result.final_train_loss)
    assert [s for s, m in logged if "val_loss" in m] == [15, 30]
    assert {"train_loss", "lr", "grad_norm", "tokens_per_second"} <= set(logged[0][1])
    where = next(model.parameters()).device  # train.device=auto: the model stays where it trained (CUDA if any)
    assert result.final_val_loss == pytest.approx(evaluate_loss(model, val_ids, 32, 8, where))
    assert len(result.optimizer_state["state"]) == sum(1 for p in model.parameters() if p.requires_grad)


def test_a_split_with_no_window_is_a_named_error_not_a_division_by_zero() -> None:
    model = realize(TINY, "scratch", 64, 0)
    with pytest.raises(ValueError, match=r"32 tokens hold no window of seq_len=32"):
        evaluate_loss(model, np.arange(32, dtype=np.uint16), 32, 8, torch.device("cpu"))


def test_training_is_reproducible(packed) -> None:
    train_ids, val_ids = packed
    tcfg = TrainConfig(steps=4, batch_size=2, seq_len=16, eval_every=4, log_every=1, precision="fp32")
    runs = []
    for _ in range(2):
        m = realize(TINY, "scratch", 49152, 0)
        result = train(m, train_ids, val_ids, TrainJob(tcfg, OptimConfig(), 7, progress=False))
        runs.append(([h["train_loss"] for h in result.history], m.state_dict()))
    assert runs[0][0] == runs[1][0]
    for a, b in zip(runs[0][1].values(), runs[1][1].values()):
        assert torch.equal(a, b)


@pytest.mark.parametrize("scale", [0.0, 0.1])
def test_the_token_table_trains_at_its_own_rate_or_not_at_all(packed, scale: float) -> None:
    """optim.table_lr_scale: the tied token table moves at that fraction of the blocks' rate (its Adam step
    is lr-proportional, so ~scale x an unscaled run's move), and at 0 it keeps its initial weights."""
    train_ids, val_ids = packed
    tcfg = TrainConfig(steps=3, batch_size=2, seq_len=16, eval_every=3, log_every=1, precision="fp32")
    moved = {}
    for s in (1.0, scale):
        m = realize(TINY, "scratch", 49152, 0)
        start = {n: p.detach().clone() for n, p in m.named_parameters()}
        train(m, train_ids, val_ids, TrainJob(tcfg, OptimConfig(table_lr_scale=s, weight_decay=0.0), 7, progress=False))
        moved[s] = {n: float((p.detach() - start[n]).abs().max()) for n, p in m.named_parameters()}
    table, block = "tok_embd.weight", "blocks.0.attn.wq.weight"
    assert moved[scale][block] > 0 and moved[1.0][table] > 0
    if scale == 0:
        assert moved[0.0][table] == 0.0
    else:
        assert 0.5 * scale < moved[scale][table] / moved[1.0][table] < 2 * scale


def test_grad_accumulation_runs(packed) -> None:
    train_ids, val_ids = packed
    tcfg = TrainConfig(steps=2, batch_size=2, seq_len=16, grad_accum=3, eval_every=2, log_every=1)
    result = train(
        realize(TINY, "scratch", 49152, 0), train_ids, val_ids, TrainJob(tcfg, OptimConfig(), 0, progress=False)
    )
    assert result.tokens_seen == 2 * 2 * 16 * 3


def test_batch_larger_than_split_is_named() -> None:
    data = np.arange(100, dtype=np.uint16)
    tcfg = TrainConfig(steps=1, batch_size=8, seq_len=32)
    with pytest.raises(ConfigError, match="train.batch_size x train.seq_len"):
        train(realize(TINY, "scratch", 49152, 0), data, data, TrainJob(tcfg, OptimConfig(), 0, progress=False))


def test_seq_len_beyond_context_is_named() -> None:
    data = np.arange(10_000, dtype=np.uint16)
    tcfg = TrainConfig(steps=1, batch_size=1, seq_len=128)
    with pytest.raises(ConfigError, match="context_length=64"):
        train(realize(TINY, "scratch", 49152, 0), data, data, TrainJob(tcfg, OptimConfig(), 0, progress=False))


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_chunked_cross_entropy_matches_the_plain_path(precision: str) -> None:
    from pipeline.models.ops.losses import linear_cross_entropy

    g = torch.Generator().manual_seed(0)
    h = torch.randn(300, 48, generator=g, requires_grad=True)
    w = (torch.randn(5000, 48, generator=g) * 0.1).requires_grad_()
    t = torch.randint(0, 5000, (300,), generator=g)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
        ref = torch.nn.functional.cross_entropy(torch.nn.functional.linear(h, w).float(), t)
        ours = linear_cross_entropy(h, w, t, chunk=128)  # three chunks, the last one partial
    ref_grads = torch.autograd.grad(ref, (h, w))
    grads = torch.autograd.grad(3 * ours, (h, w))
    tol = 1e-5 if precision == "fp32" else 2e-2
    assert float(ours.detach()) == pytest.approx(float(ref.detach()), abs=1e-5 if precision == "fp32" else 1e-3)
    for a, b in zip(grads, ref_grads):
        assert (a - 3 * b).abs().max() <= tol * 3 * b.abs().max()


@pytest.mark.parametrize("distill", [False, True])
def test_chunked_losses_skip_the_gradient_of_a_frozen_head(distill: bool) -> None:
    """LoRA's frozen tied head: no weight gradient is computed or returned, the input's is unchanged."""
    from pipeline.models.ops.losses import linear_cross_entropy, linear_distill_loss, top_k_targets

    g = torch.Generator().manual_seed(1)
    h = torch.randn(200, 32, generator=g, requires_grad=True)
    w = torch.randn(3000, 32, generator=g) * 0.1
    t = torch.randint(0, 3000, (200,), generator=g)
    teacher = top_k_targets(torch.randn(200, 3000, generator=g), 8)

    def loss(weight: torch.Tensor) -> torch.Tensor:
        if distill:
            return linear_distill_loss(h, weight, t, teacher, 0.5, 1.0, chunk=64)[0]
        return linear_cross_entropy(h, weight, t, chunk=64)

    frozen = loss(w)
    (grad_h,) = torch.autograd.grad(frozen, (h,))
    w_trained = w.clone().requires_grad_()
    trained = loss(w_trained)
    grad_h_ref, grad_w = torch.autograd.grad(trained, (h, w_trained))
    assert torch.equal(frozen.detach(), trained.detach()) and torch.equal(grad_h, grad_h_ref)
    assert grad_w.abs().sum() > 0


def test_no_grad_loss_in_chunks_equals_the_plain_path() -> None:
    """Validation's loss holds one chunk of fp32 logits; one chunk is the plain path exactly."""
    from pipeline.models.ops.losses import linear_nll

    g = torch.Generator().manual_seed(2)
    h, w = torch.randn(300, 32, generator=g), torch.randn(4000, 32, generator=g) * 0.2
    t = torch.randint(0, 4000, (300,), generator=g)
    plain = torch.nn.functional.cross_entropy(h @ w.T, t)
    assert torch.equal(linear_nll(h, w, t), plain)
    assert float(linear_nll(h, w, t, chunk=128)) == pytest.approx(float(plain), rel=1e-6)


def test_cross_entropy_of_an_underflowing_target_is_finite() -> None:
    from pipeline.models.ops.losses import linear_cross_entropy

    h = torch.tensor([[1.0, 0.0]], requires_grad=True)
    w = torch.tensor([[200.0, 0.0], [-200.0, 0.0]])  # p(target=1) = e^-400: below fp32
    loss = linear_cross_entropy(h, w, torch.tensor([1]))
    assert math.isfinite(float(loss)) and float(loss) > 87
    loss.backward()
    assert torch.isfinite(h.grad).all()


def test_activation_checkpointing_gives_identical_gradients(packed) -> None:
    from pipeline.training.runtime import enable_activation_checkpointing

    train_ids, _ = packed
    x = torch.from_numpy(np.asarray(train_ids[:130], dtype=np.int64)).view(2, 65)
    grads = []
    for checkpointing in (False, True):
        model = realize(TINY, "scratch", 49152, 0)
        if checkpointing:
            enable_activation_checkpointing(model)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            model.loss(x[:, :-1], x[:, 1:]).backward()
        grads.append([p.grad for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*grads))
    assert model.blocks[0].forward.__name__ == "forward" and "blocks.0.attn.wq.weight" in model.state_dict()


@pytest.mark.slow
def test_compiled_blocks_train_like_eager(packed) -> None:
    train_ids, val_ids = packed
    runs = []
    for compiled in (False, True):
        tcfg = TrainConfig(steps=3, batch_size=2, seq_len=16, eval_every=3, log_every=1, precision="fp32")
        job = TrainJob(replace(tcfg, compile=compiled), OptimConfig(), 0, progress=False)
        result = train(realize(TINY, "scratch", 49152, 0), train_ids, val_ids, job)
        runs.append([h["train_loss"] for h in result.history])
    assert runs[1] == pytest.approx(runs[0], abs=1e-4)


@pytest.mark.slow
def test_compiled_blocks_on_packed_rows_match_eager() -> None:
    """Packed rows' per-example attention runs eager inside compiled blocks (`keep_attend_eager`)."""
    seg = torch.tensor([[1] * 10 + [2] * 6 + [0] * 16, [1] * 20 + [2] * 12])
    x = torch.randint(0, 64, (2, 32), generator=torch.Generator().manual_seed(0))
    results = []
    for compiled in (False, True):
        model = realize(TINY, "scratch", 64, 0)
        if compiled:
            compile_blocks(model)
        loss = model.loss(x, x.roll(-1, 1), seg)
        loss.backward()
        results.append((loss.detach(), model.blocks[0].attn.wq.weight.grad))
    assert PackedRows.attend._torchdynamo_disable  # wrapped by compile_blocks
    torch.testing.assert_close(results[1], results[0], rtol=1e-4, atol=1e-5)


def test_the_stages_start_without_importing_dynamo() -> None:
    """torch._dynamo costs ~1.5 s to import; only compiling or building an optimizer needs it."""
    stages = "stages.pack, stages.export, stages.evaluate, stages.generate"
    code = f"import sys, {stages}; print('torch._dynamo' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.strip() == "False"


def test_lbfgs_reduces_the_loss(packed) -> None:
    train_ids, val_ids = packed
    model = realize(TINY, "scratch", 49152, 0)
    before = evaluate_loss(model, val_ids, 32, 8, torch.device("cpu"))
    tcfg = TrainConfig(steps=6, batch_size=8, seq_len=32, eval_every=6, log_every=1)
    optim = OptimConfig(
        name="lbfgs", lr=1.0, warmup_steps=0, min_lr_ratio=1.0, weight_decay=0.0, grad_clip=0.0, lbfgs_max_iter=5
    )
    result = train(model, train_ids, val_ids, TrainJob(tcfg, optim, 0, progress=False))
    assert "history_size" in result.optimizer_state["param_groups"][0]  # torch.optim.LBFGS's own setting
    assert result.final_val_loss < before - 0.3


def test_grad_accumulation_below_one_is_named() -> None:
    with pytest.raises(ConfigError, match="train.grad_accum"):
        TrainConfig(grad_accum=0)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_unavailable_device_is_named() -> None:
    data = np.arange(10_000, dtype=np.uint16)
    with pytest.raises(ConfigError, match="train.device"):
        tcfg = TrainConfig(steps=1, batch_size=2, seq_len=32, device="cuda")
        train(realize(TINY, "scratch", 49152, 0), data, data, TrainJob(tcfg, OptimConfig(), 0, progress=False))


def test_a_run_that_passes_over_a_small_split_many_times_warns_once(caplog) -> None:
    from pipeline.training.batches import warn_overfitting

    tokens = np.zeros(31_000, dtype=np.uint16)  # the 31k-token corpus at the default 400 x 8 x 128
    with caplog.at_level("WARNING"):
        epochs = warn_overfitting(tokens, TrainConfig(steps=400))
    assert epochs == pytest.approx(400 * 8 * 128 / 31_000)
    assert len(caplog.records) == 1 and "13.2 times" in caplog.text and "train.max_epochs=4" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING"):
        warn_overfitting(np.zeros(500_000, dtype=np.uint16), TrainConfig(steps=400))  # 0.8 epochs: silent
        warn_overfitting(tokens, TrainConfig(steps=400, max_epochs=0))  # switched off
    assert not caplog.records


def test_val_loss_is_also_logged_in_bits_per_byte() -> None:
    """With pack's byte count, every evaluation logs val_bpb beside val_loss, and the train stage's
    metrics and plot table carry it (the unit that compares models with different tokenizers)."""
    ids = np.random.default_rng(0).integers(0, 49152, 3000).astype(np.int64)
    tcfg = TrainConfig(steps=2, batch_size=2, seq_len=16, eval_every=1, log_every=1, precision="fp32")
    logged = []
    hooks = Hooks(log=lambda m, s: logged.append(m))
    model = realize(TINY, "scratch", 49152, 0)
    result = train(
        model, ids[:2000], ids[2000:], TrainJob(tcfg, OptimConfig(), 0), hooks=hooks, val_bits_per_token=0.25
    )
    val = [m for m in logged if "val_loss" in m]
    assert len(val) == 2 and all(m["val_bpb"] == pytest.approx(m["val_loss"] * 0.25) for m in val)
    out = metrics(result, 0.25)
    assert out["kept_val_bpb"] == pytest.approx(out["kept_val_loss"] * 0.25) and "final_val_bpb" in out
    assert "final_val_bpb" not in metrics(result, None)  # instruct rows: pack counts no bytes
    table = plot_table(result.history, PLOT_COLUMNS["val_loss"]).splitlines()
    assert table[0] == "step\tval_loss\tval_ppl\tval_bpb" and len(table) == 3
    assert float(table[2].split("\t")[3]) == pytest.approx(result.final_val_loss * 0.25, rel=1e-6)
    result.initial_val_loss = 7.0  # a fine-tune measured the base first: its curve starts there, in every unit
    based = with_base_row(result)
    table = plot_table(based, PLOT_COLUMNS["val_loss"]).splitlines()
    assert len(table) == 4 and [float(v) for v in table[1].split("\t")] == pytest.approx([0, 7.0, math.exp(7.0), 1.75])
    assert plot_table(based, PLOT_COLUMNS["train_loss"]) == plot_table(result.history, PLOT_COLUMNS["train_loss"])
    assert len(loss_figure(based).axes[0].lines[1].get_xdata()) == 3  # the val line has the step-0 point


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc_trim and /proc")
def test_heap_guard_hands_free_pages_back_once_the_heap_grew() -> None:
    keep_freed_memory()  # as the train loop does on CPU: freed memory stays resident
    trim_freed_memory()  # start without free resident pages, whatever earlier tests left in the heap
    guard = HeapGuard(slack=0.05)
    guard.reference = resident_bytes()
    parts = [torch.ones(2**18) for _ in range(400)]  # 400 MiB in 1 MiB tensors, then freed
    grown = resident_bytes()
    assert grown > guard.reference + 300 * 2**20
    del parts
    assert resident_bytes() > grown - 100 * 2**20  # kept: the heap still holds the freed pages
    guard.after_step()
    assert resident_bytes() < grown - 300 * 2**20  # the guard returned them


NEW_SHAPES = """
import ctypes, sys, torch
from pipeline.training.runtime import bound_kernel_caches
if sys.argv[1] == "bounded":
    bound_kernel_caches(8)
class Info(ctypes.Structure):
    names = "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost"
    _fields_ = [(n, ctypes.c_size_t) for n in names.split()]
libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = Info
def in_use():
    i = libc.mallinfo2()
    return i.uordblks + i.hblkhd
torch.set_num_threads(1)
w = torch.randn(256, 128, dtype=torch.bfloat16)
torch.randn(64, 128, dtype=torch.bfloat16) @ w.t()
before = in_use()
for m in range(65, 165):  # 100 new token counts, as packed rows bring
    torch.randn(m, 128, dtype=torch.bfloat16) @ w.t()
print(in_use() - before)
"""


def test_bounded_kernel_caches_stop_new_shapes_growing_the_heap() -> None:
    """Each new bf16 matmul shape compiles kernels that stay cached (oneDNN, ideep); bounded, the heap
    in use stops growing with them. Fresh processes: the bound is read at the first oneDNN matmul."""
    try:
        has_mallinfo2 = hasattr(ctypes.CDLL("libc.so.6"), "mallinfo2")
    except OSError:
        has_mallinfo2 = False
    if not has_mallinfo2:
        pytest.skip("needs glibc >= 2.33 (mallinfo2)")
    env = {k: v for k, v in os.environ.items() if k not in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")}
    env["PYTHONPATH"] = str(Path(__file__).resolve().parent.parent)
    grown = {}
    for mode in ("default", "bounded"):
        out = subprocess.run(
            [sys.executable, "-c", NEW_SHAPES, mode], capture_output=True, text=True, env=env, check=True
        )
        grown[mode] = int(out.stdout.split()[-1])
    if grown["default"] < 10 * 2**20:
        pytest.skip(f"this CPU's bf16 matmuls keep no compiled kernels per shape ({grown['default']} bytes)")
    assert grown["bounded"] < grown["default"] / 4
