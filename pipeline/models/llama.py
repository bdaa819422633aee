"""The llama architecture (after nanoGPT's model.py and litgpt): RMSNorm, RoPE, grouped-query
attention, SwiGLU; everything else is the shared `DecoderLM`.

Q/K weights use GGUF's row order: RoPE rotates *adjacent* pairs (the original Meta layout, which
llama.cpp's converter produces), so GGUF tensors map 1:1 onto our parameters in both directions.
"""

from __future__ import annotations

import torch
from torch import nn

from pipeline.models.ops import elementwise
from pipeline.models.ops.elementwise import inverse_frequencies, rope_tables
from pipeline.models.ops.varlen import PackedRows
from pipeline.models.transformer import Block, DecoderLM, KVCache, Rope, TransformerConfig, attend


class RMSNorm(nn.Module):
    """Root-mean-square norm, computed in fp32 whatever the autocast dtype (`fused`: its Triton kernels on CUDA)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.fused = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return elementwise.rms_norm(x, self.weight, self.eps, self.fused)


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
        q, k = elementwise.rope(q, cos, sin, self.fused), elementwise.rope(k, cos, sin, self.fused)
        y = attend(q, k, v, cache, layer, rows)
        return self.wo(y.transpose(1, 2).reshape(b, t, -1))


class FeedForward(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        self.gate = nn.Linear(cfg.d_model, cfg.d_ff, bias=False)
        self.up = nn.Linear(cfg.d_model, cfg.d_ff, bias=False)
        self.down = nn.Linear(cfg.d_ff, cfg.d_model, bias=False)
        self.fused = True  # SwiGLU through its Triton kernel on CUDA (`fused`)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(elementwise.swiglu(self.gate(x), self.up(x), self.fused))


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
