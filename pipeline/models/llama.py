"""The llama architecture (after nanoGPT's model.py and litgpt): RMSNorm, RoPE, grouped-query
attention, SwiGLU; everything else is the shared `DecoderLM`.

Q/K weights use GGUF's row order: RoPE rotates *adjacent* pairs (the original Meta layout, which
llama.cpp's converter produces), so GGUF tensors map 1:1 onto our parameters in both directions.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pipeline.models import fused
from pipeline.models.base import Block, DecoderLM, KVCache, Rope, TransformerConfig, attend
from pipeline.models.devices import to_device
from pipeline.models.varlen import PackedRows


def _in_dtype(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`t` as `dtype`, itself when it is that already. An autograd.Function's forward must not end in a
    cast that does nothing (`.to` / `.float()` of a tensor of that dtype): under torch.compile in torch
    2.11 its inputs then get zero gradients (2.6, 2.12 and 2.13 are right; `tests/test_model.py` checks)."""
    return t if t.dtype == dtype else t.to(dtype)


class _RMSNorm(torch.autograd.Function):
    """RMSNorm keeping only its input and one scale per row for backward (autograd's own graph of the
    fp32 ops kept three fp32 copies of each row: a quarter of a LoRA step's activation memory)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        xf = x.float()
        rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, weight, rstd)
        return _in_dtype(xf * rstd * weight.float(), x.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight, rstd = ctx.saved_tensors
        xhat, g = x.float() * rstd, grad.float()
        gw = g * weight.float()
        dx = rstd * (gw - xhat * (gw * xhat).mean(-1, keepdim=True))
        dw = (g * xhat).flatten(0, -2).sum(0).to(weight.dtype) if ctx.needs_input_grad[1] else None
        return dx.to(x.dtype), dw, None


class RMSNorm(nn.Module):
    """Root-mean-square norm, computed in fp32 whatever the autocast dtype (`fused`: its Triton kernels on CUDA)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.fused = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if fused.wanted(self.fused, x, self.weight):
            return fused.rms_norm(x, self.weight, self.eps)
        return _RMSNorm.apply(x, self.weight, self.eps)


def inverse_frequencies(cfg: TransformerConfig, device: torch.device) -> torch.Tensor:
    """RoPE's (head_dim/2,) fp32 angular frequencies: base^(-2i/d), divided by llama.cpp's freq_factors if any."""
    half = cfg.head_dim // 2
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, half, device=device, dtype=torch.float32) * 2 / cfg.head_dim))
    if cfg.rope_freq_factors:  # as llama.cpp's freq_factors: theta_i = pos * base^(-2i/d) / factor_i
        factors = torch.tensor(cfg.rope_freq_factors, dtype=torch.float32)
        inv_freq = inv_freq / to_device(factors, device)
    return inv_freq


def rope_tables(
    cfg: TransformerConfig, seq_len: int, device: torch.device, inv_freq: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin of shape (seq_len, head_dim/2), in fp32 (`inv_freq`: `inverse_frequencies`, when kept)."""
    inv_freq = inverse_frequencies(cfg, device) if inv_freq is None else inv_freq
    t = torch.arange(seq_len, device=device, dtype=torch.float32)
    angles = torch.outer(t, inv_freq)
    return angles.cos(), angles.sin()


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    xf = x.float().unflatten(-1, (-1, 2))
    x0, x1 = xf[..., 0], xf[..., 1]
    out = torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1)
    return _in_dtype(out.flatten(-2), x.dtype)


class _Rope(torch.autograd.Function):
    """The rotation's backward is the rotation by the opposite angles: nothing but the tables is kept
    (autograd's graph of the fp32 ops kept two fp32 copies of q and of k)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(cos, sin)
        return _rotate(x, cos, sin)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        cos, sin = ctx.saved_tensors
        return _rotate(grad, cos, -sin), None, None


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate adjacent pairs (x0,x1),(x2,x3)...; x is (B, H, T, D), cos/sin (T, D/2) in fp32."""
    return _Rope.apply(x, cos, sin)


class Attention(nn.Module):
    """Causal grouped-query attention with RoPE, through scaled_dot_product_attention."""

    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        self.cfg = cfg
        hd = cfg.head_dim
        self.wq = nn.Linear(cfg.d_model, cfg.n_head * hd, bias=False)
        self.wk = nn.Linear(cfg.d_model, cfg.n_kv_head * hd, bias=False)
        self.wv = nn.Linear(cfg.d_model, cfg.n_kv_head * hd, bias=False)
        self.wo = nn.Linear(cfg.n_head * hd, cfg.d_model, bias=False)
        self.fused = True  # RoPE through its Triton kernel on CUDA (`fused`)

    def forward(
        self,
        x: torch.Tensor,
        rope: Rope,
        cache: KVCache | None = None,
        layer: int = 0,
        rows: PackedRows | None = None,
    ) -> torch.Tensor:
        """`rows`: x (1, N, d) holds the real tokens of packed rows, each example attends to itself only."""
        b, t, _ = x.shape
        hd = self.cfg.head_dim
        q = self.wq(x).view(b, t, self.cfg.n_head, hd).transpose(1, 2)
        k = self.wk(x).view(b, t, self.cfg.n_kv_head, hd).transpose(1, 2)
        v = self.wv(x).view(b, t, self.cfg.n_kv_head, hd).transpose(1, 2)
        cos, sin = rope
        q, k = self._rope(q, cos, sin), self._rope(k, cos, sin)
        y = attend(q, k, v, cache, layer, rows)
        return self.wo(y.transpose(1, 2).reshape(b, t, -1))

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        if fused.wanted(self.fused, x, cos, sin) and fused.rope_fits(x, cos, sin):
            return fused.rope(x, cos, sin)
        return apply_rope(x, cos, sin)


class _SwiGLU(torch.autograd.Function):
    """silu(g) * u keeping only g and u for backward (autograd's graph also kept silu(g): a third of
    the feed-forward's activation memory)."""

    @staticmethod
    def forward(ctx, g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(g, u)
        return F.silu(g) * u

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        g, u = ctx.saved_tensors
        gf, sig = g.float(), torch.sigmoid(g.float())
        grad_u = (grad.float() * gf * sig).to(u.dtype)
        grad_g = (grad.float() * u.float() * sig * (1 + gf * (1 - sig))).to(g.dtype)
        return grad_g, grad_u


class FeedForward(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        self.gate = nn.Linear(cfg.d_model, cfg.d_ff, bias=False)
        self.up = nn.Linear(cfg.d_model, cfg.d_ff, bias=False)
        self.down = nn.Linear(cfg.d_ff, cfg.d_model, bias=False)
        self.fused = True  # SwiGLU through its Triton kernel on CUDA (`fused`)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        g, u = self.gate(x), self.up(x)
        if fused.wanted(self.fused, g, u) and g.dtype == u.dtype and g.shape == u.shape:
            return self.down(fused.swiglu(g, u))
        return self.down(_SwiGLU.apply(g, u))


class Llama(DecoderLM):
    """Token embedding (optionally donor-width + lens), llama blocks, final RMSNorm, (tied) head."""

    RESIDUAL_PROJECTIONS = ("attn.wo.weight", "ffn.down.weight")

    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        self._token_table(cfg)
        self.blocks = nn.ModuleList(
            Block(
                RMSNorm(cfg.d_model, cfg.norm_eps), Attention(cfg), RMSNorm(cfg.d_model, cfg.norm_eps), FeedForward(cfg)
            )
            for _ in range(cfg.n_layer)
        )
        self._output(cfg, RMSNorm(cfg.d_model, cfg.norm_eps))
        self._inv_freq: dict[torch.device, torch.Tensor] = {}  # not a buffer: no state_dict entry

    def _frequencies(self, device: torch.device) -> torch.Tensor:
        """`inverse_frequencies` on `device`, made once: a step captured as a CUDA graph must not copy
        host data (the freq factors) inside the capture."""
        if device not in self._inv_freq:
            self._inv_freq[device] = inverse_frequencies(self.cfg, device)
        return self._inv_freq[device]

    def embed(self, idx: torch.Tensor, start: int, rows: PackedRows | None) -> tuple[torch.Tensor, Rope]:
        """Token vectors and the RoPE tables of positions start.. (or of `rows.positions`, one per token)."""
        if rows is None:
            cos, sin = rope_tables(self.cfg, start + idx.shape[1], idx.device, self._frequencies(idx.device))
            return self.tokens(idx), (cos[start:], sin[start:])
        cos, sin = rope_tables(self.cfg, rows.longest, idx.device, self._frequencies(idx.device))
        return self.tokens(idx), (cos[rows.positions], sin[rows.positions])
