"""llama's elementwise layers as autograd Functions that keep only what backward needs (RMSNorm,
RoPE, SwiGLU: autograd's own graphs of their fp32 ops kept 2-3 fp32 copies per op), their tables,
and the one dispatch between these and the Triton kernels of `fused` (CUDA)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pipeline.models.devices import to_device
from pipeline.models.ops import fused
from pipeline.models.transformer import TransformerConfig


def in_dtype(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`t` as `dtype`, itself when it is that already. An autograd.Function's forward must not end in a
    cast that does nothing (`.to` / `.float()` of a tensor of that dtype): under torch.compile in torch
    2.11 its inputs then get zero gradients (2.6, 2.12 and 2.13 are right; `tests/test_model.py` checks)."""
    return t if t.dtype == dtype else t.to(dtype)


class RMSNormFn(torch.autograd.Function):
    """RMSNorm keeping only its input and one scale per row for backward (autograd's own graph of the
    fp32 ops kept three fp32 copies of each row: a quarter of a LoRA step's activation memory)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        xf = x.float()
        rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, weight, rstd)
        return in_dtype(xf * rstd * weight.float(), x.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight, rstd = ctx.saved_tensors
        xhat, g = x.float() * rstd, grad.float()
        gw = g * weight.float()
        dx = rstd * (gw - xhat * (gw * xhat).mean(-1, keepdim=True))
        dw = (g * xhat).flatten(0, -2).sum(0).to(weight.dtype) if ctx.needs_input_grad[1] else None
        return dx.to(x.dtype), dw, None


def inverse_frequencies(cfg: TransformerConfig, device: torch.device, local: bool = False) -> torch.Tensor:
    """RoPE's (head_dim/2,) fp32 angular frequencies: base^(-2i/d), divided by llama.cpp's freq_factors if
    any and by a linear scaling factor; `local`: a sliding layer's (its own base, no scaling, as llama.cpp)."""
    half = cfg.head_dim // 2
    base = cfg.rope_theta_local if local else cfg.rope_theta
    inv_freq = 1.0 / (base ** (torch.arange(0, half, device=device, dtype=torch.float32) * 2 / cfg.head_dim))
    if cfg.rope_freq_factors and not local:  # as llama.cpp's freq_factors: theta_i = pos * base^(-2i/d) / factor_i
        factors = torch.tensor(cfg.rope_freq_factors, dtype=torch.float32)
        inv_freq = inv_freq / to_device(factors, device)
    if cfg.rope_scale != 1.0 and not local:  # llama.cpp's freq_scale = 1 / factor
        inv_freq = inv_freq * (1.0 / cfg.rope_scale)
    return inv_freq


def rope_tables(
    cfg: TransformerConfig, seq_len: int, device: torch.device, inv_freq: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin of shape (seq_len, head_dim/2), in fp32 (`inv_freq`: `inverse_frequencies`, when kept)."""
    inv_freq = inverse_frequencies(cfg, device) if inv_freq is None else inv_freq
    t = torch.arange(seq_len, device=device, dtype=torch.float32)
    angles = torch.outer(t, inv_freq)
    return angles.cos(), angles.sin()


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, halves: bool = False) -> torch.Tensor:
    """(x0*cos - x1*sin, x0*sin + x1*cos) per pair, in fp32: adjacent pairs (x_2i, x_2i+1), or with
    `halves` (NEOX) the pairs (x_i, x_i+d/2). `RopeFn` writes the halves into place (no stack: a third
    of the time in bf16 on CPU, the same bits); compiled code and autograd stack (dynamo refuses strided
    `out=`, autograd any `out=`; inductor fuses the stack)."""
    dim = -2 if halves else -1
    xf = x.float().unflatten(-1, (2, -1) if halves else (-1, 2))
    x0, x1 = xf.select(dim, 0), xf.select(dim, 1)
    if torch.compiler.is_compiling() or (torch.is_grad_enabled() and x.requires_grad):
        return in_dtype(torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=dim).flatten(-2), x.dtype)
    out = torch.empty_like(xf)
    torch.mul(x0, cos, out=out.select(dim, 0)).sub_(x1 * sin)
    torch.mul(x0, sin, out=out.select(dim, 1)).add_(x1 * cos)
    return in_dtype(out.flatten(-2), x.dtype)


class RopeFn(torch.autograd.Function):
    """The rotation's backward is the rotation by the opposite angles: nothing but the tables is kept
    (autograd's graph of the fp32 ops kept two fp32 copies of q and of k)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, halves: bool) -> torch.Tensor:
        ctx.save_for_backward(cos, sin)
        ctx.halves = halves
        return rotate(x, cos, sin, halves)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        cos, sin = ctx.saved_tensors
        return rotate(grad, cos, -sin, ctx.halves), None, None, None


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, halves: bool = False) -> torch.Tensor:
    """Rotate adjacent pairs (x0,x1),(x2,x3)... (or with `halves` the pairs (x_i, x_i+D/2)); x is
    (B, H, T, D), cos/sin (T, D/2) in fp32."""
    return RopeFn.apply(x, cos, sin, halves)


class SwiGLUFn(torch.autograd.Function):
    """silu(g) * u keeping only g and u for backward (autograd's graph also kept silu(g): a third of
    the feed-forward's activation memory)."""

    @staticmethod
    def forward(ctx, g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(g, u)
        return F.silu(g) * u

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        """grad_u = grad*g*sig, grad_g = grad*u*sig*(1 + g*(1-sig)) in fp32, each cast made once and
        the products in place (the same roundings as the expressions written out: bit-identical)."""
        g, u = ctx.saved_tensors
        gf, gradf = g.float(), grad.to(torch.float32, copy=True)  # a copy: the products below go into it
        sig = torch.sigmoid(gf)
        grad_u = in_dtype((gradf * gf).mul_(sig), u.dtype)
        slope = torch.rsub(sig, 1).mul_(gf).add_(1)  # 1 + g*(1-sig)
        grad_g = in_dtype(gradf.mul_(u.float()).mul_(sig).mul_(slope), g.dtype)
        return grad_g, grad_u


class GeGLUFn(torch.autograd.Function):
    """gelu_tanh(g) * u keeping only g and u for backward, as `SwiGLUFn` (Gemma's feed-forward)."""

    @staticmethod
    def forward(ctx, g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(g, u)
        return F.gelu(g, approximate="tanh") * u

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        g, u = ctx.saved_tensors
        grad_u = grad * F.gelu(g, approximate="tanh")
        grad_g = torch.ops.aten.gelu_backward(grad * u, g, approximate="tanh")
        return grad_g, grad_u


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, use_fused: bool = True) -> torch.Tensor:
    """RMSNorm in fp32 whatever the autocast dtype; the Triton kernels where `fused` wants them."""
    if fused.wanted(use_fused, x, weight):
        return fused.rms_norm(x, weight, eps)
    return RMSNormFn.apply(x, weight, eps)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, use_fused: bool = True, halves: bool = False):
    """`apply_rope`, through its Triton kernel (adjacent pairs only) where `fused` wants it and the tables fit."""
    if not halves and fused.wanted(use_fused, x, cos, sin) and fused.rope_fits(x, cos, sin):
        return fused.rope(x, cos, sin)
    return apply_rope(x, cos, sin, halves)


def geglu(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """gelu_tanh(g) * u (no Triton kernel: autograd's Function everywhere)."""
    return GeGLUFn.apply(g, u)


def swiglu(g: torch.Tensor, u: torch.Tensor, use_fused: bool = True) -> torch.Tensor:
    """silu(g) * u, through its Triton kernel where `fused` wants it."""
    if fused.wanted(use_fused, g, u) and g.dtype == u.dtype and g.shape == u.shape:
        return fused.swiglu(g, u)
    return SwiGLUFn.apply(g, u)
