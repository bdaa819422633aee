"""The Triton kernels (`pipeline.models.ops.fused`) against the plain code they replace on CUDA.

Each kernel test runs on two devices: CUDA where there is one (marked `cuda`), and the CPU under
Triton's interpreter, which must be switched on before Triton is imported: `test_kernels_under_the_
interpreter` runs this file again in a child process with `TRITON_INTERPRET=1` (CI's proof of the kernels).
The interpreter rounds fp32 to bf16 by truncation (a GPU rounds to nearest), so bf16 results are
compared to bf16 tolerance and fp32 ones to 1e-5.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pipeline.models.llama import Llama
from pipeline.models.ops import fused
from pipeline.models.ops.elementwise import RMSNormFn, SwiGLUFn, apply_rope, rope_tables
from pipeline.models.transformer import TransformerConfig, init_weights
from tests.helpers import run_under_interpreter

ROOT = Path(__file__).resolve().parent.parent
DEVICES = [
    pytest.param("cpu", marks=pytest.mark.skipif(not fused.INTERPRET, reason="runs in the interpreter's child")),
    pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(not fused.available(), reason="no Triton")]),
]
DTYPES = [torch.float32, torch.bfloat16]


def _close(got: torch.Tensor, ref: torch.Tensor) -> None:
    """Equal to rounding: 1e-5 relative in fp32, two bf16 steps (2^-7 of the largest value) in bf16."""
    tol = 1e-5 if ref.dtype == torch.float32 else 2**-7
    assert got.dtype == ref.dtype and got.shape == ref.shape
    assert (got.float() - ref.float()).abs().max() <= tol * max(1.0, ref.float().abs().max())


def _grads(fn, *inputs: torch.Tensor, seed: int = 1) -> tuple[torch.Tensor, ...]:
    """fn's output and the gradients of its inputs under a fixed random output gradient."""
    leaves = [t.detach().clone().requires_grad_(t.requires_grad) for t in inputs]
    out = fn(*leaves)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed)).to(out.device, out.dtype)
    out.backward(g)
    return out.detach(), *(t.grad for t in leaves if t.requires_grad)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width,train_weight", [(576, True), (100, False), (64, True), (5000, True)])
def test_rms_norm_kernel_equals_the_plain_norm(device: str, dtype: torch.dtype, width: int, train_weight: bool) -> None:
    """Forward, input gradient and weight gradient (or none, for a frozen weight), at widths that are
    and are not powers of two, over a row count that no row block divides."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 7, width, generator=g).to(device, dtype).requires_grad_()
    w = (1 + 0.1 * torch.randn(width, generator=g)).to(device).requires_grad_(train_weight)
    got = _grads(lambda a, b: fused.rms_norm(a, b, 1e-5), x, w)
    ref = _grads(lambda a, b: RMSNormFn.apply(a, b, 1e-5), x, w)
    assert len(got) == len(ref) == (3 if train_weight else 2)
    for a, b in zip(got, ref):
        _close(a, b)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "heads,seq,dim,transposed",
    [(4, 27, 64, True), (2, 27, 64, True), (3, 70, 64, True), (2, 45, 128, False), (2, 9, 96, True)],
)
def test_rope_kernel_equals_the_plain_rotation(
    device: str, dtype: torch.dtype, heads: int, seq: int, dim: int, transposed: bool
) -> None:
    """q/k as attention makes them (a transposed view of the projection) or contiguous, tables from a
    start offset: the same rotation and input gradient, and a contiguous result; over position counts
    that the row block does not divide (one block and several), head widths 64, 128 and 96 (not a
    power of two)."""
    cfg = TransformerConfig(
        vocab_size=10, d_model=4 * dim, n_layer=1, n_head=4, n_kv_head=2, d_ff=8, context_length=seq + 5
    )
    cos, sin = rope_tables(cfg, seq + 5, torch.device(device))
    cos, sin = cos[5:], sin[5:]
    x = torch.randn(2, seq, heads, dim, generator=torch.Generator().manual_seed(0)).to(device, dtype)
    x = x.transpose(1, 2) if transposed else x.transpose(1, 2).contiguous()
    assert fused.rope_fits(x, cos, sin) and x.is_contiguous() is not transposed
    got = _grads(lambda t: fused.rope(t, cos, sin), x.requires_grad_())
    ref = _grads(lambda t: apply_rope(t, cos, sin), x)
    assert got[0].is_contiguous()
    for a, b in zip(got, ref):
        _close(a, b)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_swiglu_kernel_equals_the_plain_one(device: str, dtype: torch.dtype) -> None:
    """silu(g) * u and both gradients, over a size no kernel block divides."""
    g = torch.Generator().manual_seed(0)
    a, b = (torch.randn(3, 5, 1500, generator=g).to(device, dtype).requires_grad_() for _ in range(2))
    got = _grads(fused.swiglu, a, b)
    ref = _grads(SwiGLUFn.apply, a, b)
    for x, y in zip(got, ref):
        _close(x, y)


def _model_step(device: str, use_fused: bool, precision: str) -> tuple[torch.Tensor, list[torch.Tensor]]:
    cfg = TransformerConfig(vocab_size=64, d_model=64, n_layer=2, n_head=4, n_kv_head=2, d_ff=96, context_length=32)
    model = Llama(cfg)
    init_weights(model, 0.05, 0)
    model.to(device)
    fused.use_fused_kernels(model, use_fused)
    g = torch.Generator().manual_seed(1)
    x, y = (torch.randint(0, 64, (2, 24), generator=g).to(device) for _ in range(2))
    with torch.autocast(device, dtype=torch.bfloat16, enabled=precision == "bf16"):
        loss = model.loss(x, y)
    return loss.detach(), list(torch.autograd.grad(loss, list(model.parameters())))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_llama_step_through_the_kernels_equals_the_plain_step(device: str, precision: str, monkeypatch) -> None:
    """The model calls the kernels (each of the three, every layer) when its switch is on and not when
    off, with the same loss and gradients to rounding; twice through the kernels is bit-identical."""
    calls: dict[str, int] = {}
    for name in ("rms_norm", "rope", "swiglu"):
        real = getattr(fused, name)
        monkeypatch.setattr(fused, name, lambda *a, _real=real, _name=name: calls.update({_name: 1}) or _real(*a))
    plain = _model_step(device, False, precision)
    assert not calls
    got = _model_step(device, True, precision)
    assert set(calls) == {"rms_norm", "rope", "swiglu"}
    tol = 1e-5 if precision == "fp32" else 2e-2
    assert abs(float(got[0]) - float(plain[0])) <= tol * abs(float(plain[0]))
    for a, b in zip(got[1], plain[1]):
        assert (a - b).abs().max() <= tol * max(b.abs().max(), 1e-3)
    again = _model_step(device, True, precision)
    assert torch.equal(got[0], again[0]) and all(torch.equal(a, b) for a, b in zip(got[1], again[1]))


def test_cpu_tensors_take_the_plain_code_outside_the_interpreter() -> None:
    """On CPU (no interpreter), with the switch off, or for a tensor subclass, the plain code runs."""
    x = torch.randn(2, 3)
    assert fused.wanted(True, x) is fused.INTERPRET
    assert not fused.wanted(False, x)
    assert not fused.wanted(True, x.as_subclass(_Marked))


class _Marked(torch.Tensor):
    """A tensor subclass, as FSDP's DTensor or a quantized weight would be."""


@pytest.mark.skipif(not fused.available(), reason="no Triton (CUDA torch ships it; else pip install triton)")
@pytest.mark.skipif(fused.INTERPRET, reason="this is the interpreter's child")
def test_kernels_under_the_interpreter() -> None:
    """Run this file's CPU cases with Triton's interpreter: the kernels' code checked without a GPU."""
    run_under_interpreter(__file__)
