"""Padding-free packed rows (`pipeline.models.ops.varlen`): the loss and its gradients over packed rows equal
those of each example run alone, for both architectures, through the CPU flash attention, and the fused
llama ops (RMSNorm, RoPE, SwiGLU) equal autograd's own graph of the same math."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pipeline.models.gpt2 import GPT2
from pipeline.models.llama import Llama
from pipeline.models.ops import varlen
from pipeline.models.ops.elementwise import RMSNormFn, SwiGLUFn, apply_rope, rotate
from pipeline.models.ops.losses import IGNORE_INDEX
from pipeline.models.ops.varlen import PackedRows
from pipeline.models.transformer import TransformerConfig, init_weights

CFG = TransformerConfig(vocab_size=50, d_model=32, n_layer=2, n_head=4, n_kv_head=2, d_ff=48, context_length=64)


def rows_of(lengths_per_row: list[list[int]], t: int, seed: int = 0):
    """Random packed rows: the examples' lengths per row, then padding; labels on each example's second half."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(1, CFG.vocab_size, (len(lengths_per_row), t), generator=g)
    y = torch.full_like(x, IGNORE_INDEX)
    seg = torch.zeros_like(x)
    for r, lengths in enumerate(lengths_per_row):
        at = 0
        for i, n in enumerate(lengths):
            seg[r, at : at + n] = i + 1
            y[r, at + n // 2 : at + n] = torch.randint(0, CFG.vocab_size, (n - n // 2,), generator=g)
            at += n
    return x, y, seg


def alone(model, x, y, seg):
    """Sum of each example's loss run by itself (no packing, no padding) and its labelled-position count."""
    total, count = 0.0, 0
    for r in range(x.shape[0]):
        for s in seg[r].unique().tolist():
            if s == 0:
                continue
            idx = (seg[r] == s).nonzero().squeeze(1)
            n = int((y[r, idx] != IGNORE_INDEX).sum())
            if n:
                total = total + model.loss(x[r, idx][None], y[r, idx][None]) * n
                count += n
    return total, count


@pytest.mark.parametrize("arch", [Llama, GPT2])
def test_packed_loss_and_gradients_equal_each_example_alone(arch) -> None:
    model = arch(CFG)
    init_weights(model, 0.2, seed=0)
    # lengths 3..64 fall into five power-of-two buckets; the middle row is one example, no padding
    x, y, seg = rows_of([[5, 17, 3], [64], [9, 30, 25]], t=64)
    packed = model.loss(x, y, seg)
    g_packed = torch.autograd.grad(packed, list(model.parameters()))
    total, count = alone(model, x, y, seg)
    reference = total / count
    g_alone = torch.autograd.grad(reference, list(model.parameters()))
    torch.testing.assert_close(packed, reference, atol=1e-5, rtol=1e-5)
    for a, b in zip(g_packed, g_alone):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


def test_rows_drop_padding_and_restart_positions() -> None:
    seg = torch.tensor([[1, 1, 1, 2, 2, 0, 0], [1, 1, 1, 1, 1, 1, 1]])
    rows = PackedRows(seg)
    assert len(rows) == 12 and rows.keep.tolist() == [0, 1, 2, 3, 4] + list(range(7, 14))
    assert rows.positions.tolist() == [0, 1, 2, 0, 1] + list(range(7))
    # three examples of lengths 3, 2, 7: buckets by power of two, each example in exactly one
    sizes = sorted(tuple(b.gather.shape) for b in rows.buckets)
    assert sizes == [(1, 2), (1, 3), (1, 7)]
    assert sorted(torch.cat([b.tokens for b in rows.buckets]).tolist()) == list(range(12))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_causal_attention_agrees_with_sdpa(dtype: torch.dtype) -> None:
    """The CPU flash kernels (fp32 inside, GQA without repeated heads, inputs of any strides) give
    SDPA's outputs and gradients on repeated heads; in bf16 within bf16's rounding of the fp64 ones."""
    g = torch.Generator().manual_seed(0)
    exact = [torch.randn(3, 20, h, 8, generator=g, dtype=torch.float64).transpose(1, 2) for h in (6, 2, 2)]
    ours = [t.to(dtype).detach().requires_grad_() for t in exact]
    ref = [t.detach().clone().requires_grad_() for t in exact]
    out = varlen.causal_attention(*ours)
    q, k, v = ref
    reference = F.scaled_dot_product_attention(q, k.repeat_interleave(3, 1), v.repeat_interleave(3, 1), is_causal=True)
    cotangent = torch.randn(reference.shape, generator=g, dtype=torch.float64)
    (out.double() * cotangent).sum().backward()
    (reference * cotangent).sum().backward()
    tol = {torch.float64: {}, torch.float32: {"atol": 1e-5, "rtol": 1e-5}}.get(dtype, {"atol": 0.05, "rtol": 0.05})
    torch.testing.assert_close(out.double(), reference, **tol)
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a.grad.double(), b.grad, **tol)


def test_cpu_attention_reruns_bit_identical() -> None:
    """Exact resume and bit-identical reruns need a deterministic backward: GQA sums each kv head's gradient
    over its query heads, at 2 and at 5 threads (more than this machine's cores)."""
    threads = torch.get_num_threads()
    try:
        for n in (2, 5):
            torch.set_num_threads(n)
            g = torch.Generator().manual_seed(n)
            q, k, v = (torch.randn(4, h, 150, 64, generator=g).bfloat16().requires_grad_() for h in (9, 3, 3))
            grad = torch.randn(4, 9, 150, 64, generator=g).bfloat16()
            first, second = (torch.autograd.grad(varlen.causal_attention(q, k, v), (q, k, v), grad) for _ in range(2))
            assert all(torch.equal(a, b) for a, b in zip(first, second))
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_packed_attention_equals_autograd_of_the_bucket_loop(dtype: torch.dtype) -> None:
    """The CPU path (one cast per call, rows put in place) gives the bucket loop's output and gradients
    bit for bit, from the strided (N, heads, D) views `attend` passes: examples of 1..64 tokens in five
    buckets (one padded: 17..30), one row full, padding after the others."""
    _, _, seg = rows_of([[20, 30, 1], [64], [3, 7, 30, 17]], 64)
    rows = PackedRows(seg)
    g = torch.Generator().manual_seed(3)
    base = [torch.randn(h, len(rows), 64, generator=g).to(dtype) for h in (9, 3, 3)]
    grad = torch.randn(len(rows), 9, 64, generator=g).to(dtype)
    results = []
    for attend in (rows.attend_buckets, lambda q, k, v: varlen._CpuPacked.apply(q, k, v, rows)):
        leaves = [t.clone().requires_grad_() for t in base]
        out = attend(*(t.transpose(0, 1) for t in leaves))
        results.append((out, *torch.autograd.grad(out, leaves, grad)))
    assert len(rows.buckets) == 5 and all(torch.equal(a, b) for a, b in zip(*results))


def test_fused_llama_ops_equal_autograd_of_the_same_math() -> None:
    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        tol = 1e-5 if dtype == torch.float32 else 2e-2  # bf16: a rounding apart (ours rounds once, from fp32)
        x = torch.randn(2, 5, 64, generator=g).to(dtype).requires_grad_()
        w = torch.randn(64, generator=g).requires_grad_()
        grad = torch.randn(2, 5, 64, generator=g).to(dtype)
        ours = RMSNormFn.apply(x, w, 1e-5)
        xf = x.float()
        plain = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5) * w).to(dtype)
        assert torch.equal(ours, plain)
        for a, b in zip(torch.autograd.grad(ours, (x, w), grad), torch.autograd.grad(plain, (x, w), grad)):
            torch.testing.assert_close(a.float(), b.float(), atol=tol, rtol=tol)
        angles = torch.rand(5, 4, generator=g) * 6
        q = torch.randn(1, 3, 5, 8, generator=g).to(dtype).requires_grad_()
        gq = torch.randn(1, 3, 5, 8, generator=g).to(dtype)
        ours, plain = apply_rope(q, angles.cos(), angles.sin()), rotate(q, angles.cos(), angles.sin())
        assert torch.equal(ours, plain)
        torch.testing.assert_close(torch.autograd.grad(ours, q, gq)[0], torch.autograd.grad(plain, q, gq)[0])
        a, b = (torch.randn(7, 16, generator=g).to(dtype).requires_grad_() for _ in range(2))
        gs = torch.randn(7, 16, generator=g).to(dtype)
        ours, plain = SwiGLUFn.apply(a, b), F.silu(a) * b
        assert torch.equal(ours, plain)
        for p, r in zip(torch.autograd.grad(ours, (a, b), gs), torch.autograd.grad(plain, (a, b), gs)):
            torch.testing.assert_close(p.float(), r.float(), atol=tol, rtol=tol)


@pytest.mark.cuda
def test_flash_varlen_attention_equals_the_bucketed_path_on_cuda() -> None:
    """On a GPU, bf16 packed rows go through one flash varlen kernel (GQA inside it); its outputs and the
    q, k, v gradients equal the bucketed fp32 path's on the same examples, within bf16's rounding."""
    seg = torch.tensor([[1] * 300 + [2] * 70 + [3] * 130 + [0] * 12, [1] * 17 + [2] * 495])
    rows = PackedRows(seg, torch.device("cuda"))
    g = torch.Generator().manual_seed(0)
    n = len(rows)
    exact = [torch.randn(1, h, n, 64, generator=g).cuda() for h in (9, 3, 3)]
    half = [t.bfloat16().requires_grad_() for t in exact]
    full = [t.clone().requires_grad_() for t in exact]
    assert varlen.flash_varlen_ready(half[0][0].transpose(0, 1)) and not varlen.flash_varlen_ready(exact[0])
    out_half, out_full = rows.attend(*half), rows.attend(*full)
    grad = torch.randn(out_full.shape, generator=g).cuda()
    out_half.backward(grad.bfloat16())
    out_full.backward(grad)
    torch.testing.assert_close(out_half.float(), out_full, atol=2e-2, rtol=2e-2)
    for a, b in zip(half, full):
        torch.testing.assert_close(a.grad.float(), b.grad, atol=5e-2, rtol=5e-2)
