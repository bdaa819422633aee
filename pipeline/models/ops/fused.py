"""Triton kernels for llama's elementwise layers on CUDA: RMSNorm, RoPE and SwiGLU, forward and backward.

An H100 profile of the 135M shape's step spent over half its GPU time in the plain versions of these
(`elementwise.RMSNormFn`, `RopeFn`, `SwiGLUFn`): each is a chain of small kernels with fp32 copies between them.
Here each is one kernel each way, computing in fp32 as the plain code does, so results agree with it to
rounding (the tests compare them: bf16 tolerance, and fp32 to 1e-5). RMSNorm's weight gradient is
summed in fixed row blocks, then in a fixed order: runs stay bit-identical.

Used where `wanted` says so: CUDA tensors, Triton installed (it comes with PyPI's CUDA torch), the
module's `fused` switch on (`train.fused_kernels`) and outside `torch.compile`, which fuses the plain
code itself. Everything else (CPU, no Triton) runs the plain code. `TRITON_INTERPRET=1` at import runs
these kernels on CPU tensors through Triton's interpreter: how the tests check them without a GPU.
"""

from __future__ import annotations

import os

import torch
from torch import nn

try:  # optional: the plain code runs without it
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised where Triton is absent
    triton = None

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"  # read by Triton when the kernels are defined
_TILE = 4096  # elements a program holds per row block: rows x the row's power-of-two width


def available() -> bool:
    """Whether the kernels can run here at all (Triton importable)."""
    return triton is not None


def wanted(enabled: bool, *tensors: torch.Tensor) -> bool:
    """Run the fused kernel on `tensors`: Triton present, the module's switch on, not inside
    torch.compile's tracing, and plain tensors (no DTensor or other subclass) on CUDA (on CPU
    under the interpreter)."""
    if not enabled or triton is None or torch.compiler.is_compiling():
        return False
    return all(_plain(t) and (t.is_cuda or (INTERPRET and t.device.type == "cpu")) for t in tensors)


def _plain(t: torch.Tensor) -> bool:
    return type(t) is torch.Tensor or type(t) is nn.Parameter


def use_fused_kernels(model: nn.Module, enabled: bool) -> None:
    """Switch the fused kernels on or off for every module of `model` that has them (`train.fused_kernels`)."""
    for module in model.modules():
        if hasattr(module, "fused"):
            module.fused = enabled


def _rows(width: int) -> tuple[int, int]:
    """(power-of-two block width, rows per program) for rows of `width` elements."""
    block = triton.next_power_of_2(width)
    return block, max(1, _TILE // block)


def _warps(block: int, rows: int) -> int:
    """Warps for a program holding block x rows elements: 4 up to `_TILE`, more for rows wider than it."""
    return max(4, min(16, block * rows // 1024))


if triton is not None:

    @triton.jit
    def _rms_forward(X, W, Y, RSTD, n_rows, width, eps, BLOCK: tl.constexpr, ROWS: tl.constexpr):
        rows = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = (rows[:, None] < n_rows) & (cols[None, :] < width)
        at = rows[:, None] * width + cols[None, :]
        x = tl.load(X + at, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.rsqrt(tl.sum(x * x, axis=1) / width + eps)
        w = tl.load(W + cols, mask=cols < width, other=0.0).to(tl.float32)
        y = x * rstd[:, None] * w[None, :]
        tl.store(Y + at, y.to(Y.dtype.element_ty), mask=mask)
        tl.store(RSTD + rows, rstd, mask=rows < n_rows)

    @triton.jit
    def _rms_backward(
        G, X, W, RSTD, DX, DW, n_rows, width, BLOCK: tl.constexpr, ROWS: tl.constexpr, WITH_DW: tl.constexpr
    ):
        pid = tl.program_id(0)
        rows = (pid * ROWS + tl.arange(0, ROWS)).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = (rows[:, None] < n_rows) & (cols[None, :] < width)
        at = rows[:, None] * width + cols[None, :]
        w = tl.load(W + cols, mask=cols < width, other=0.0).to(tl.float32)
        x = tl.load(X + at, mask=mask, other=0.0).to(tl.float32)
        g = tl.load(G + at, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD + rows, mask=rows < n_rows, other=0.0)
        xhat = x * rstd[:, None]
        gw = g * w[None, :]
        mean = tl.sum(gw * xhat, axis=1) / width
        dx = rstd[:, None] * (gw - xhat * mean[:, None])
        tl.store(DX + at, dx.to(DX.dtype.element_ty), mask=mask)
        if WITH_DW:  # this block's share of the weight gradient, summed over blocks by the caller
            tl.store(DW + pid.to(tl.int64) * width + cols, tl.sum(g * xhat, axis=0), mask=cols < width)

    @triton.jit
    def _rope(X, COS, SIN, Y, seq, heads, sb, sh, st, width, sign, BLOCK: tl.constexpr, ROWS: tl.constexpr):
        # one (batch, head) per program on axis 0, a block of ROWS positions on axis 1; each row of x is
        # loaded whole (coalesced) and split into its (even, odd) elements in registers. A 1-D grid over
        # rows with per-element division and stride-2 loads ran ~10x under memory speed on an H100
        bh = tl.program_id(0)
        b, h = bh // heads, bh % heads
        t = tl.program_id(1) * ROWS + tl.arange(0, ROWS)
        cols = tl.arange(0, BLOCK)
        mask = (t[:, None] < seq) & (cols[None, :] < width)
        src = X + b.to(tl.int64) * sb + h.to(tl.int64) * sh + t[:, None].to(tl.int64) * st + cols[None, :]
        x = tl.load(src, mask=mask, other=0.0).to(tl.float32)
        x0, x1 = tl.split(tl.reshape(x, (ROWS, BLOCK // 2, 2)))
        j = tl.arange(0, BLOCK // 2)
        half = width // 2
        table = t[:, None] * half + j[None, :]
        pairs = (t[:, None] < seq) & (j[None, :] < half)
        c = tl.load(COS + table, mask=pairs, other=0.0)
        s = tl.load(SIN + table, mask=pairs, other=0.0) * sign
        y = tl.reshape(tl.join(x0 * c - x1 * s, x0 * s + x1 * c), (ROWS, BLOCK))
        dst = Y + bh.to(tl.int64) * seq * width + t[:, None] * width + cols[None, :]
        tl.store(dst, y.to(Y.dtype.element_ty), mask=mask)

    @triton.jit
    def _swiglu_forward(G, U, H, n, BLOCK: tl.constexpr):
        at = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = at < n
        g = tl.load(G + at, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(U + at, mask=mask, other=0.0).to(tl.float32)
        tl.store(H + at, (g * tl.sigmoid(g) * u).to(H.dtype.element_ty), mask=mask)

    @triton.jit
    def _swiglu_backward(D, G, U, DG, DU, n, BLOCK: tl.constexpr):
        at = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = at < n
        d = tl.load(D + at, mask=mask, other=0.0).to(tl.float32)
        g = tl.load(G + at, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(U + at, mask=mask, other=0.0).to(tl.float32)
        sig = tl.sigmoid(g)
        tl.store(DU + at, (d * g * sig).to(DU.dtype.element_ty), mask=mask)
        tl.store(DG + at, (d * u * sig * (1 + g * (1 - sig))).to(DG.dtype.element_ty), mask=mask)


class _FusedRMSNorm(torch.autograd.Function):
    """`elementwise.RMSNormFn` as two kernels; keeps the same (input, weight, one scale per row)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        width = x.shape[-1]
        x2 = x.reshape(-1, width).contiguous()
        y = torch.empty_like(x2)
        rstd = torch.empty(x2.shape[0], dtype=torch.float32, device=x.device)
        block, rows = _rows(width)
        grid = (triton.cdiv(x2.shape[0], rows),)
        _rms_forward[grid](x2, weight, y, rstd, x2.shape[0], width, eps, block, rows, num_warps=_warps(block, rows))
        ctx.save_for_backward(x2, weight, rstd)
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x2, weight, rstd = ctx.saved_tensors
        n_rows, width = x2.shape
        block, rows = _rows(width)
        programs = triton.cdiv(n_rows, rows)
        with_dw = ctx.needs_input_grad[1]
        dx = torch.empty_like(x2)
        # one weight-gradient row per program, summed in a fixed order: the same result every run
        partial = torch.empty((programs, width) if with_dw else (1, 1), dtype=torch.float32, device=x2.device)
        g2 = grad.reshape(-1, width).contiguous()
        args = (g2, x2, weight, rstd, dx, partial, n_rows, width, block, rows, with_dw)
        _rms_backward[(programs,)](*args, num_warps=_warps(block, rows))
        dw = partial.sum(0).to(weight.dtype) if with_dw else None
        return dx.view(grad.shape), dw, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of x's last dimension in fp32, scaled by `weight`, in x's dtype."""
    return _FusedRMSNorm.apply(x, weight, eps)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, sign: float) -> torch.Tensor:
    """Rotate x's adjacent pairs by the tables' angles (times `sign`); the result is contiguous."""
    b, h, t, d = x.shape
    y = torch.empty((b, h, t, d), dtype=x.dtype, device=x.device)
    block, rows = _rows(d)
    grid = (b * h, triton.cdiv(t, rows))
    _rope[grid](x, cos, sin, y, t, h, x.stride(0), x.stride(1), x.stride(2), d, sign, block, rows, num_warps=4)
    return y


class _FusedRope(torch.autograd.Function):
    """`elementwise.RopeFn` as one kernel each way: backward is the rotation by the opposite angles."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(cos, sin)
        return _rotate(x, cos, sin, 1.0)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        cos, sin = ctx.saved_tensors
        grad = grad if grad.stride(-1) == 1 else grad.contiguous()
        return _rotate(grad, cos, sin, -1.0), None, None


def rope_fits(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """Whether the kernel handles these: x (B, H, T, D) with unit last stride, fp32 contiguous (T, D/2) tables."""
    half = x.shape[-1] // 2
    tables_ok = all(
        tab.dtype == torch.float32 and tab.is_contiguous() and tuple(tab.shape) == (x.shape[2], half)
        for tab in (cos, sin)
    )
    return x.dim() == 4 and x.stride(-1) == 1 and x.shape[-1] % 2 == 0 and tables_ok


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on adjacent pairs of x (B, H, T, D) with fp32 (T, D/2) tables, in fp32, in x's dtype."""
    return _FusedRope.apply(x, cos, sin)


class _FusedSwiGLU(torch.autograd.Function):
    """`elementwise.SwiGLUFn` as one kernel each way, keeping only g and u."""

    @staticmethod
    def forward(ctx, g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        g, u = g.contiguous(), u.contiguous()
        h = torch.empty_like(g)
        _swiglu_forward[(triton.cdiv(g.numel(), 1024),)](g, u, h, g.numel(), 1024)
        ctx.save_for_backward(g, u)
        return h

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        g, u = ctx.saved_tensors
        grad = grad.contiguous()
        dg, du = torch.empty_like(g), torch.empty_like(u)
        _swiglu_backward[(triton.cdiv(g.numel(), 1024),)](grad, g, u, dg, du, g.numel(), 1024)
        return dg, du


def swiglu(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """silu(g) * u in fp32, in g's dtype (g and u of one shape and dtype)."""
    return _FusedSwiGLU.apply(g, u)
