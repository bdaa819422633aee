"""The chunked cross-entropy's Triton kernel (`pipeline.models.ops.fused_ce`) against the plain loss.

As in test_fused.py: each case runs on CUDA where there is one (marked `cuda`) and on the CPU under
Triton's interpreter, in a child process started by `test_the_kernel_under_the_interpreter`.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from pipeline.models.ops import fused, fused_ce
from pipeline.models.ops.losses import IGNORE_INDEX, linear_cross_entropy
from tests.helpers import run_under_interpreter

ROOT = Path(__file__).resolve().parent.parent
DEVICES = [
    pytest.param("cpu", marks=pytest.mark.skipif(not fused.INTERPRET, reason="runs in the interpreter's child")),
    pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(not fused.available(), reason="no Triton")]),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab", [5000, 4096, 300])
def test_the_kernel_writes_softmax_minus_onehot_and_returns_the_summed_nll(
    device: str, dtype: torch.dtype, vocab: int
) -> None:
    """Against F.cross_entropy in fp32: the summed loss (ignored rows excluded) and, in place, the
    logits' gradient of the summed loss; vocabularies below, at and above one block, not its multiple."""
    g = torch.Generator().manual_seed(vocab)
    z = (4 * torch.randn(37, vocab, generator=g)).to(dtype)
    t = torch.randint(0, vocab, (37,), generator=g)
    t[[3, 20]] = IGNORE_INDEX
    ref = z.float().requires_grad_()
    loss = F.cross_entropy(ref, t, reduction="sum", ignore_index=IGNORE_INDEX)
    loss.backward()
    got_z = z.to(device)
    got = fused_ce.softmax_grad_(got_z, t.to(device))
    assert abs(float(got) - float(loss.detach())) <= 1e-5 * float(loss.detach())
    tol = 1e-5 if dtype == torch.float32 else 2**-8
    assert (got_z.cpu().float() - ref.grad).abs().max() <= tol
    assert torch.all(got_z[[3, 20]] == 0)


@pytest.mark.parametrize("device", DEVICES)
def test_the_chunked_loss_through_the_kernel_equals_the_plain_loss(device: str) -> None:
    """`linear_cross_entropy` (chunks smaller than the rows, bf16 autocast) takes the kernel and gives
    F.cross_entropy's loss and gradients of h and w to bf16 tolerance."""
    g = torch.Generator().manual_seed(0)
    h = torch.randn(50, 32, generator=g).to(device).requires_grad_()
    w = (0.3 * torch.randn(700, 32, generator=g)).to(device).requires_grad_()
    t = torch.randint(0, 700, (50,), generator=g).to(device)
    assert fused_ce.wanted(torch.empty(2, 700, device=device))
    with torch.autocast(device, dtype=torch.bfloat16):
        got = linear_cross_entropy(h, w, t, chunk=16)
    got_h, got_w = torch.autograd.grad(got, (h, w))
    with torch.autocast(device, dtype=torch.bfloat16):
        ref = F.cross_entropy((h @ w.t()).float(), t)
    ref_h, ref_w = torch.autograd.grad(ref, (h, w))
    assert abs(float(got) - float(ref)) <= 1e-3 * float(ref)
    for a, b in ((got_h, ref_h), (got_w, ref_w)):
        assert (a - b).abs().max() <= 2e-2 * b.abs().max()


def test_cpu_logits_take_the_plain_softmax_outside_the_interpreter() -> None:
    assert fused_ce.wanted(torch.empty(3, 10)) is (fused.INTERPRET and fused.available())
    assert not fused_ce.wanted(torch.empty(10, 3).t())


@pytest.mark.skipif(not fused.available(), reason="no Triton (CUDA torch ships it; else pip install triton)")
@pytest.mark.skipif(fused.INTERPRET, reason="this is the interpreter's child")
def test_the_kernel_under_the_interpreter() -> None:
    """This file's CPU cases with Triton's interpreter: the kernel's code checked without a GPU."""
    run_under_interpreter(__file__)
