"""The llama-shape model: a config dataclass and one nn.Module per block (after litgpt/nanoGPT).

Q/K weights use GGUF's row order: RoPE rotates *adjacent* pairs (the original Meta layout, which
llama.cpp's converter produces), so GGUF tensors map 1:1 onto our parameters in both directions.
"""

from __future__ import annotations

import json
import math
import zlib
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from pipeline.errors import ConfigError, problem
from pipeline.losses import linear_cross_entropy, select_targets


@dataclass(frozen=True)
class TransformerConfig:
    """Everything that fixes the model's shape; saved as JSON beside the weights.

    One dataclass for every architecture (`arch`); fields an architecture does not use (e.g.
    `n_kv_head` and `rope_theta` for gpt2) are ignored by it.
    """

    vocab_size: int
    d_model: int
    n_layer: int
    n_head: int
    n_kv_head: int
    d_ff: int
    context_length: int
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = True
    donor_dim: int = 0  # >0: embedding table is donor-width, projected by a trainable lens
    arch: str = "llama"
    rope_freq_factors: tuple[float, ...] = ()  # llama3-style per-dimension divisors (GGUF rope_freqs); () = plain

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True)

    @classmethod
    def from_dict(cls, d: dict) -> TransformerConfig:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ConfigError(
                problem("model config", f"keys among {sorted(known)}", f"unknown keys {unknown}", "re-run realize")
            )
        if "rope_freq_factors" in d:
            d = {**d, "rope_freq_factors": tuple(d["rope_freq_factors"])}
        return cls(**d)

    @classmethod
    def load(cls, path: Path) -> TransformerConfig:
        return cls.from_dict(json.loads(Path(path).read_text()))


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
        cos: torch.Tensor,
        sin: torch.Tensor,
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
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if cache is not None:
            k, v = cache.append(layer, k, v)
        groups = self.cfg.n_head // self.cfg.n_kv_head
        if groups > 1:  # query head h reads kv head h // groups, as llama.cpp does
            k = k.repeat_interleave(groups, dim=1)
            v = v.repeat_interleave(groups, dim=1)
        if mask is not None:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        elif cache is None:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=_causal_mask(t, k.shape[2], x.device))
        return self.wo(y.transpose(1, 2).reshape(b, t, -1))


def _causal_mask(t_q: int, t_k: int, device: torch.device) -> torch.Tensor | None:
    """None when no mask is needed (one new token); else queries see keys up to their position."""
    if t_q == 1:
        return None
    offset = t_k - t_q
    return torch.ones(t_q, t_k, dtype=torch.bool, device=device).tril(diagonal=offset)


def segment_causal_mask(segment_ids: torch.Tensor) -> torch.Tensor:
    """(B, T) segment ids -> (B, 1, T, T) bool, True where query i may attend key j: same segment
    and j <= i. Padding (segment 0) attends to padding only, so no row of the mask is empty.
    RoPE scores depend only on relative positions, so positions need not restart per segment."""
    t = segment_ids.shape[-1]
    same = segment_ids.unsqueeze(-1) == segment_ids.unsqueeze(-2)
    causal = torch.ones(t, t, dtype=torch.bool, device=segment_ids.device).tril()
    return (same & causal).unsqueeze(1)


class KVCache:
    """Keys and values of the tokens seen so far, per layer: (B, n_kv_head, T, head_dim)."""

    def __init__(self, n_layer: int):
        self.k: list[torch.Tensor | None] = [None] * n_layer
        self.v: list[torch.Tensor | None] = [None] * n_layer

    @property
    def length(self) -> int:
        return 0 if self.k[0] is None else self.k[0].shape[2]

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.k[layer] is not None:
            k = torch.cat((self.k[layer], k), dim=2)
            v = torch.cat((self.v[layer], v), dim=2)
        self.k[layer], self.v[layer] = k, v
        return k, v


class FeedForward(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        self.gate = nn.Linear(cfg.d_model, cfg.d_ff, bias=False)
        self.up = nn.Linear(cfg.d_model, cfg.d_ff, bias=False)
        self.down = nn.Linear(cfg.d_ff, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


class Block(nn.Module):
    """Pre-norm transformer block."""

    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attn = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.ffn = FeedForward(cfg)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cache: KVCache | None = None,
        layer: int = 0,
        mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin, cache, layer, mask)
        return x + self.ffn(self.ffn_norm(x))


class Llama(nn.Module):
    """Token embedding (optionally donor-width + lens), blocks, final norm, (tied) head."""

    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        self.cfg = cfg
        emb_dim = cfg.donor_dim or cfg.d_model
        self.tok_embd = nn.Embedding(cfg.vocab_size, emb_dim)
        self.lens = nn.Linear(cfg.donor_dim, cfg.d_model, bias=False) if cfg.donor_dim else None
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.head = None if cfg.tie_embeddings else nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)

    def embedding_table(self) -> torch.Tensor:
        """The (vocab, d_model) table the model actually uses: the lens folded in when present."""
        if self.lens is None:
            return self.tok_embd.weight
        return self.lens(self.tok_embd.weight)

    def hidden(
        self, idx: torch.Tensor, cache: KVCache | None = None, segment_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Final-norm hidden states (B, T, d_model); with a cache, `idx` continues the cached tokens.

        `segment_ids` (B, T) keeps attention inside each packed example (`segment_causal_mask`).
        """
        start = 0 if cache is None else cache.length
        end = start + idx.shape[1]
        if end > self.cfg.context_length:
            raise ValueError(f"sequence of {end} tokens exceeds context_length {self.cfg.context_length}")
        x = self.tok_embd(idx) if self.lens is None else self.lens(self.tok_embd(idx))
        cos, sin = rope_tables(self.cfg, end, idx.device)
        cos, sin = cos[start:], sin[start:]
        if segment_ids is not None and cache is not None:
            raise ValueError("segment_ids are for training rows, not for cached decoding")
        mask = None if segment_ids is None else segment_causal_mask(segment_ids)
        for i, block in enumerate(self.blocks):
            x = block(x, cos, sin, cache, i, mask)
        return self.norm(x)

    def head_weight(self) -> torch.Tensor:
        return self.embedding_table() if self.head is None else self.head.weight

    def forward(self, idx: torch.Tensor, cache: KVCache | None = None) -> torch.Tensor:
        """Logits (B, T, vocab)."""
        return F.linear(self.hidden(idx, cache), self.head_weight())

    def loss(self, idx: torch.Tensor, targets: torch.Tensor, segment_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Mean next-token cross-entropy (softmax in fp32) over targets that are not IGNORE_INDEX.

        With gradients on, the head and the softmax run chunked (`linear_cross_entropy`), so the
        (tokens x vocab) fp32 logits are never materialised; without, the plain path.
        """
        h, t = select_targets(self.hidden(idx, segment_ids=segment_ids).flatten(0, 1), targets.flatten())
        if torch.is_grad_enabled():
            return linear_cross_entropy(h, self.head_weight(), t)
        return F.cross_entropy(F.linear(h, self.head_weight()).float(), t)


def init_weights(model: Llama, std: float, seed: int) -> None:
    """GPT-2 style init: N(0, std), residual projections scaled by 1/sqrt(2*n_layer), norms 1.

    Each parameter draws from its own generator seeded by (seed, name), so a parameter's init
    does not depend on which other parameters exist (e.g. `lens` and `pca` get the same blocks).
    """
    resid_std = std / math.sqrt(2 * model.cfg.n_layer)
    with torch.no_grad():
        for name, p in model.named_parameters():
            generator = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith(("attn.wo.weight", "ffn.down.weight")):
                p.normal_(0.0, resid_std, generator=generator)
            else:
                p.normal_(0.0, std, generator=generator)


def count_parameters(model: nn.Module, trainable_only: bool = False) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad or not trainable_only)
