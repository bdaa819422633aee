"""A Vision Transformer for image classification (Dosovitskiy et al. 2020, "ViT-Tiny" sized down):
the image cut into patches, each flattened and projected (`PatchEmbedding`), a learned class token
in front, learned position embeddings added, pre-norm encoder blocks (LayerNorm, bidirectional
multi-head attention, LayerNorm, GELU MLP), a final LayerNorm and a linear head on the class token.

The encoder blocks use gpt2's module paths (attn_norm, attn.qkv, attn.proj, ffn_norm, ffn.up,
ffn.down), so their GGUF names come from the same table (`pipeline.models.names`). `loss` is what
the one training loop calls: cross-entropy of the class logits against the labels.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pipeline.errors import ConfigError, problem


@dataclass(frozen=True)
class ViTConfig:
    """Everything that fixes the ViT's shape (saved as config.json beside the weights), plus what the
    exported GGUF records for its users: the class names and the pixel normalization."""

    image_size: int
    patch_size: int
    channels: int
    d_model: int
    n_layer: int
    n_head: int
    d_ff: int
    n_classes: int
    norm_eps: float = 1e-6
    dropout: float = 0.0
    class_names: tuple[str, ...] = ()
    pixel_mean: tuple[float, ...] = ()  # per channel, subtracted by pack (after scaling to [0, 1])
    pixel_std: tuple[float, ...] = ()
    arch: str = "vit"

    @property
    def n_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2

    @property
    def patch_dim(self) -> int:
        return self.channels * self.patch_size**2

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True)

    def check(self, where: str, fix: str) -> ViTConfig:
        """Sizes torch can build and patches that tile the image; a named error otherwise."""
        sizes = ("image_size", "patch_size", "channels", "d_model", "n_layer", "n_head", "d_ff", "n_classes")
        for key in sizes:
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 2**20:
                raise ConfigError(problem(f"{where} {key}", "an integer in [1, 1048576]", f"{value!r}"[:60], fix))
        if self.image_size % self.patch_size:
            found = f"image_size={self.image_size}, patch_size={self.patch_size}"
            raise ConfigError(problem(f"{where} image_size", "a multiple of patch_size", found, fix))
        if self.d_model % self.n_head:
            raise ConfigError(problem(f"{where} n_head", f"a divisor of d_model={self.d_model}", str(self.n_head), fix))
        if len(self.class_names) not in (0, self.n_classes):
            found = f"{len(self.class_names)} names"
            raise ConfigError(problem(f"{where} class_names", f"{self.n_classes} names (n_classes)", found, fix))
        return self

    @classmethod
    def from_dict(cls, d: Any, where: str = "model config", fix: str = "re-run realize") -> ViTConfig:
        known = {f.name for f in fields(cls)}
        if not isinstance(d, dict) or set(d) - known:
            found = type(d).__name__ if not isinstance(d, dict) else f"unknown keys {sorted(set(d) - known)}"
            raise ConfigError(problem(where, f"a ViT config with keys among {sorted(known)}", found, fix))
        tuples = {k: tuple(d[k]) for k in ("class_names", "pixel_mean", "pixel_std") if isinstance(d.get(k), list)}
        try:
            cfg = cls(**{**d, **tuples})
        except TypeError as e:
            raise ConfigError(problem(where, "a complete ViT config", str(e), fix)) from None
        return cfg.check(where, fix)


class PatchEmbedding(nn.Module):
    """(B, C, H, W) -> (B, patches, d_model): non-overlapping patches, flattened (channel, row,
    column) and projected by one linear layer (a strided convolution, written as the matmul it is)."""

    def __init__(self, cfg: ViTConfig):
        super().__init__()
        self.patch = cfg.patch_size
        self.proj = nn.Linear(cfg.patch_dim, cfg.d_model)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        b, c, h, w = images.shape
        p = self.patch
        x = images.reshape(b, c, h // p, p, w // p, p).permute(0, 2, 4, 1, 3, 5)
        return self.proj(x.reshape(b, (h // p) * (w // p), c * p * p))


class Attention(nn.Module):
    """Bidirectional multi-head self-attention from one fused qkv projection."""

    def __init__(self, cfg: ViTConfig):
        super().__init__()
        self.n_head, self.dropout = cfg.n_head, cfg.dropout
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = (z.view(b, t, self.n_head, d // self.n_head).transpose(1, 2) for z in self.qkv(x).split(d, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class MLP(nn.Module):
    """down(gelu(up(x))), exact GELU as the ViT paper's."""

    def __init__(self, cfg: ViTConfig):
        super().__init__()
        self.up = nn.Linear(cfg.d_model, cfg.d_ff)
        self.down = nn.Linear(cfg.d_ff, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


class EncoderBlock(nn.Module):
    """Pre-norm: x + attn(LN(x)), then x + mlp(LN(x)), dropout on each branch."""

    def __init__(self, cfg: ViTConfig):
        super().__init__()
        self.attn_norm = nn.LayerNorm(cfg.d_model, eps=cfg.norm_eps)
        self.attn = Attention(cfg)
        self.ffn_norm = nn.LayerNorm(cfg.d_model, eps=cfg.norm_eps)
        self.ffn = MLP(cfg)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop(self.attn(self.attn_norm(x)))
        return x + self.drop(self.ffn(self.ffn_norm(x)))


class ViT(nn.Module):
    """Patch embedding, class token, position embeddings, encoder blocks, final norm, class head."""

    RESIDUAL_PROJECTIONS = ("attn.proj.weight", "ffn.down.weight")  # for `models.transformer.init_weights`

    def __init__(self, cfg: ViTConfig):
        super().__init__()
        self.cfg = cfg
        self.patch_embd = PatchEmbedding(cfg)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, cfg.d_model))
        self.pos_embd = nn.Parameter(torch.zeros(1, cfg.n_patches + 1, cfg.d_model))
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(EncoderBlock(cfg) for _ in range(cfg.n_layer))
        self.norm = nn.LayerNorm(cfg.d_model, eps=cfg.norm_eps)
        self.head = nn.Linear(cfg.d_model, cfg.n_classes)

    def features(self, images: torch.Tensor) -> torch.Tensor:
        """The final-norm class-token state (B, d_model)."""
        x = self.patch_embd(images)
        x = torch.cat((self.cls_token.expand(x.shape[0], -1, -1), x), dim=1) + self.pos_embd
        x = self.drop(x)
        for block in self.blocks:
            x = block(x)
        return self.norm(x[:, 0])

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        """Class logits (B, n_classes)."""
        return self.head(self.features(images))

    def loss(self, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy of the class logits (softmax in fp32)."""
        return F.cross_entropy(self(images).float(), labels)


def load_vit_config(path: Path, fix: str) -> ViTConfig:
    """A ViT's `config.json` (already known to say arch vit), checked."""
    return ViTConfig.from_dict(json.loads(Path(path).read_text()), str(path), fix)
