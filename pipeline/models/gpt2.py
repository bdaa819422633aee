"""The GPT-2 architecture (after nanoGPT's model.py): LayerNorm with bias, GELU (tanh approximation,
as GPT-2 and llama.cpp compute it), learned absolute positions, biases on every linear, one fused
qkv projection; everything else is the shared `DecoderLM`.

Our `nn.Linear` weights are (out, in), which is exactly GGUF's gpt2 tensor layout (llama.cpp's
converter transposes HF's Conv1D weights into it), so tensors map 1:1.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pipeline.models.ops.varlen import PackedRows
from pipeline.models.transformer import Block, DecoderLM, KVCache, Rope, TransformerConfig, attend


class Attention(nn.Module):
    """Causal multi-head attention from one fused qkv projection (q, k, v stacked on the out dim)."""

    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        self.cfg = cfg
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)

    def forward(
        self,
        x: torch.Tensor,
        rope: Rope = None,
        cache: KVCache | None = None,
        layer: int = 0,
        rows: PackedRows | None = None,
    ) -> torch.Tensor:
        """`rope` is unused (positions are added at the input); `rows` as in llama's attention."""
        b, t, d = x.shape
        q, k, v = (
            z.view(b, t, self.cfg.n_head, self.cfg.head_dim).transpose(1, 2) for z in self.qkv(x).split(d, dim=2)
        )
        y = attend(q, k, v, cache, layer, rows)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class FeedForward(nn.Module):
    """down(gelu_tanh(up(x)))."""

    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        self.up = nn.Linear(cfg.d_model, cfg.d_ff)
        self.down = nn.Linear(cfg.d_ff, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x), approximate="tanh"))


class GPT2(DecoderLM):
    """Token (optionally donor-width + lens) and position embeddings, blocks, final LayerNorm, head."""

    RESIDUAL_PROJECTIONS = ("attn.proj.weight", "ffn.down.weight")

    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        self._token_table(cfg)
        self.pos_embd = nn.Embedding(cfg.context_length, cfg.d_model)
        self.blocks = nn.ModuleList(
            Block(
                nn.LayerNorm(cfg.d_model, eps=cfg.norm_eps),
                Attention(cfg),
                nn.LayerNorm(cfg.d_model, eps=cfg.norm_eps),
                FeedForward(cfg),
            )
            for _ in range(cfg.n_layer)
        )
        self._output(cfg, nn.LayerNorm(cfg.d_model, eps=cfg.norm_eps))

    def embed(self, idx: torch.Tensor, start: int, rows: PackedRows | None) -> tuple[torch.Tensor, Rope]:
        """Token plus position vectors; packed examples (`rows`) each start at position 0."""
        if rows is None:
            positions = torch.arange(start, start + idx.shape[1], device=idx.device)
        else:
            positions = rows.positions
        return self.tokens(idx) + self.pos_embd(positions), None
