"""The llama architecture (after nanoGPT's model.py and litgpt): RMSNorm, RoPE, grouped-query
attention, SwiGLU; everything else is the shared `DecoderLM`.

Q/K weights use GGUF's row order: RoPE rotates *adjacent* pairs (the original Meta layout, which
llama.cpp's converter produces), so GGUF tensors map 1:1 onto our parameters in both directions.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pipeline.models.base import Block, DecoderLM, KVCache, Rope, TransformerConfig, attend


class RMSNorm(nn.Module):
    """Root-mean-square norm, computed in fp32 whatever the autocast dtype."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (out * self.weight.float()).to(x.dtype)


def rope_tables(cfg: TransformerConfig, seq_len: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin of shape (seq_len, head_dim/2), in fp32."""
    half = cfg.head_dim // 2
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, half, device=device, dtype=torch.float32) * 2 / cfg.head_dim))
    if cfg.rope_freq_factors:  # as llama.cpp's freq_factors: theta_i = pos * base^(-2i/d) / factor_i
        inv_freq = inv_freq / torch.tensor(cfg.rope_freq_factors, device=device, dtype=torch.float32)
    t = torch.arange(seq_len, device=device, dtype=torch.float32)
    angles = torch.outer(t, inv_freq)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate adjacent pairs (x0,x1),(x2,x3)...; x is (B, H, T, D)."""
    xf = x.float().unflatten(-1, (-1, 2))
    x0, x1 = xf[..., 0], xf[..., 1]
    out = torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1)
    return out.flatten(-2).to(x.dtype)


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

    def forward(
        self,
        x: torch.Tensor,
        rope: Rope,
        cache: KVCache | None = None,
        layer: int = 0,
        mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`mask` (B, 1, T, T) bool, True = may attend, replaces the causal mask (packed examples)."""
        b, t, _ = x.shape
        hd = self.cfg.head_dim
        q = self.wq(x).view(b, t, self.cfg.n_head, hd).transpose(1, 2)
        k = self.wk(x).view(b, t, self.cfg.n_kv_head, hd).transpose(1, 2)
        v = self.wv(x).view(b, t, self.cfg.n_kv_head, hd).transpose(1, 2)
        cos, sin = rope
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        y = attend(q, k, v, cache, layer, mask)
        return self.wo(y.transpose(1, 2).reshape(b, t, -1))


class FeedForward(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        self.gate = nn.Linear(cfg.d_model, cfg.d_ff, bias=False)
        self.up = nn.Linear(cfg.d_model, cfg.d_ff, bias=False)
        self.down = nn.Linear(cfg.d_ff, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


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

    def embed(self, idx: torch.Tensor, start: int, segment_ids: torch.Tensor | None) -> tuple[torch.Tensor, Rope]:
        """Token vectors and the RoPE tables of positions start..; RoPE scores depend only on
        relative positions, so packed examples need no restart."""
        cos, sin = rope_tables(self.cfg, start + idx.shape[1], idx.device)
        return self.tokens(idx), (cos[start:], sin[start:])
