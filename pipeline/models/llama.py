"""The llama family (after nanoGPT's model.py and litgpt): RMSNorm, RoPE, grouped-query attention, a
gated feed-forward; everything else is the shared `DecoderLM`. Qwen2, Qwen3 and Gemma 3 are llama with
a few rules changed (`names.FAMILIES`, read from llama.cpp's graph of each): q/k/v biases, per-head
q/k norms, post-branch norms, a GELU gate, a scaled token table, sliding-window layers with a RoPE
base of their own. One module computes them all, each rule behind its flag.

Q/K weights use GGUF's row order. llama's GGUF rows rotate *adjacent* pairs (the original Meta
layout, which llama.cpp's converter produces); Qwen and Gemma files keep the Hugging Face layout,
where RoPE rotates the two halves of each head (`Family.rope_halves`). Either way the GGUF tensors
map 1:1 onto our parameters in both directions.
"""

from __future__ import annotations

import math

import numpy as np
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
    """Causal grouped-query attention with RoPE, through scaled_dot_product_attention; layer `layer`'s
    rules (a sliding window and its own RoPE table when the config says it slides)."""

    def __init__(self, cfg: TransformerConfig, layer: int = 0):
        super().__init__()
        self.cfg, family = cfg, cfg.family
        hd, bias = cfg.head_dim, family.qkv_bias
        self.wq = nn.Linear(cfg.d_model, cfg.n_head * hd, bias=bias)
        self.wk = nn.Linear(cfg.d_model, cfg.n_kv_head * hd, bias=bias)
        self.wv = nn.Linear(cfg.d_model, cfg.n_kv_head * hd, bias=bias)
        self.wo = nn.Linear(cfg.n_head * hd, cfg.d_model, bias=False)
        if family.qk_norm:
            self.q_norm, self.k_norm = RMSNorm(hd, cfg.norm_eps), RMSNorm(hd, cfg.norm_eps)
        self.local = cfg.sliding(layer)  # reads the local RoPE table and attends within the window
        self.window = cfg.sliding_window if self.local else 0
        self.halves = family.rope_halves
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
        y = attend(*self.project(x, rope), cache, layer, rows, self.window)
        return self.wo(y.transpose(1, 2).reshape(b, t, -1))

    def project(self, x: torch.Tensor, rope: Rope) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(B, H, T, D) queries and (B, H_kv, T, D) keys and values of `x`, RoPE applied: what `attend`
        reads, and what the donor's circuit probe (`pipeline.donor.circuits`) scores."""
        b, t, _ = x.shape
        hd = self.cfg.head_dim
        q = self.wq(x).view(b, t, self.cfg.n_head, hd).transpose(1, 2)
        k = self.wk(x).view(b, t, self.cfg.n_kv_head, hd).transpose(1, 2)
        v = self.wv(x).view(b, t, self.cfg.n_kv_head, hd).transpose(1, 2)
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        cos, sin = rope[2 if self.local else 0], rope[3 if self.local else 1]
        q = elementwise.rope(q, cos, sin, self.fused, self.halves)
        k = elementwise.rope(k, cos, sin, self.fused, self.halves)
        return q, k, v


class FeedForward(nn.Module):
    """A gated feed-forward: down(act(gate(x)) * up(x)), SiLU (SwiGLU) or GELU-tanh (Gemma's GeGLU)."""

    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        self.gate = nn.Linear(cfg.d_model, cfg.d_ff, bias=False)
        self.up = nn.Linear(cfg.d_model, cfg.d_ff, bias=False)
        self.down = nn.Linear(cfg.d_ff, cfg.d_model, bias=False)
        self.gelu = cfg.family.gelu
        self.fused = True  # SwiGLU through its Triton kernel on CUDA (`fused`)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gelu:
            return self.down(elementwise.geglu(self.gate(x), self.up(x)))
        return self.down(elementwise.swiglu(self.gate(x), self.up(x), self.fused))


def _block(cfg: TransformerConfig, layer: int) -> Block:
    post = (RMSNorm(cfg.d_model, cfg.norm_eps), RMSNorm(cfg.d_model, cfg.norm_eps)) if cfg.family.post_norms else None
    norm = RMSNorm(cfg.d_model, cfg.norm_eps), RMSNorm(cfg.d_model, cfg.norm_eps)
    return Block(norm[0], Attention(cfg, layer), norm[1], FeedForward(cfg), post)


class Llama(DecoderLM):
    """Token embedding (optionally donor-width + lens), blocks of `cfg.arch`'s family, final RMSNorm, (tied) head."""

    RESIDUAL_PROJECTIONS = ("attn.wo.weight", "ffn.down.weight")

    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        self._token_table(cfg)
        self.blocks = nn.ModuleList(_block(cfg, i) for i in range(cfg.n_layer))
        self._output(cfg, RMSNorm(cfg.d_model, cfg.norm_eps))
        self._inv_freq: dict[tuple[torch.device, bool], torch.Tensor] = {}  # not a buffer: no state_dict entry
        self._local = any(cfg.sliding(i) for i in range(cfg.n_layer))
        # Gemma: sqrt(d_model), rounded to fp32 as llama.cpp's sqrtf (a Python float would round each product)
        self._scale = float(np.float32(math.sqrt(cfg.d_model))) if cfg.family.embed_scale else 0.0

    def _frequencies(self, device: torch.device, local: bool = False) -> torch.Tensor:
        """`inverse_frequencies` on `device`, made once: a step captured as a CUDA graph must not copy
        host data (the freq factors) inside the capture."""
        if (device, local) not in self._inv_freq:
            self._inv_freq[device, local] = inverse_frequencies(self.cfg, device, local)
        return self._inv_freq[device, local]

    def tokens(self, idx: torch.Tensor) -> torch.Tensor:
        x = super().tokens(idx)
        return x * self._scale if self._scale else x

    def _tables(self, n: int, device: torch.device, local: bool) -> tuple[torch.Tensor, torch.Tensor]:
        return rope_tables(self.cfg, n, device, self._frequencies(device, local))

    def embed(self, idx: torch.Tensor, start: int, rows: PackedRows | None) -> tuple[torch.Tensor, Rope]:
        """Token vectors and the RoPE tables of positions start.. (or of `rows.positions`, one per token):
        (cos, sin), then the sliding layers' (cos, sin) when the model has any."""
        n = start + idx.shape[1] if rows is None else rows.longest
        at = slice(start, None) if rows is None else rows.positions
        tables = [self._tables(n, idx.device, False)] + ([self._tables(n, idx.device, True)] if self._local else [])
        return self.tokens(idx), tuple(t[at] for pair in tables for t in pair)
