"""The GPT-2 architecture (after nanoGPT's model.py) and its GGUF layout, both directions.

LayerNorm with bias, GELU (tanh approximation, as GPT-2 and llama.cpp compute it), learned absolute
position embeddings, biases on every linear, one fused qkv projection, (tied) head. It exposes
the same interface as `pipeline.model.Llama`, so the training loop, evaluation and generation
take either. Our `nn.Linear` weights are (out, in), which is exactly GGUF's gpt2 tensor layout
(llama.cpp's converter transposes HF's Conv1D weights into it), so tensors map 1:1.
"""

from __future__ import annotations

import math
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from pipeline.errors import GGUFError, problem
from pipeline.gguf_io import FILE_TYPES, GGUFFile
from pipeline.losses import linear_cross_entropy
from pipeline.model import KVCache, TransformerConfig

# our parameter name (per block, after "blocks.{i}.") -> GGUF name (after "blk.{i}.")
BLOCK_TENSORS = {
    "attn_norm.weight": "attn_norm.weight",
    "attn_norm.bias": "attn_norm.bias",
    "attn.qkv.weight": "attn_qkv.weight",
    "attn.qkv.bias": "attn_qkv.bias",
    "attn.proj.weight": "attn_output.weight",
    "attn.proj.bias": "attn_output.bias",
    "ffn_norm.weight": "ffn_norm.weight",
    "ffn_norm.bias": "ffn_norm.bias",
    "ffn.up.weight": "ffn_up.weight",
    "ffn.up.bias": "ffn_up.bias",
    "ffn.down.weight": "ffn_down.weight",
    "ffn.down.bias": "ffn_down.bias",
}


class Attention(nn.Module):
    """Causal multi-head attention from one fused qkv projection (q, k, v stacked on the out dim)."""

    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        self.cfg = cfg
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor, cache: KVCache | None = None, layer: int = 0) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = (
            z.view(b, t, self.cfg.n_head, self.cfg.head_dim).transpose(1, 2) for z in self.qkv(x).split(d, dim=2)
        )
        if cache is None:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            k, v = cache.append(layer, k, v)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=_causal_mask(t, k.shape[2], x.device))
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


def _causal_mask(t_q: int, t_k: int, device: torch.device) -> torch.Tensor | None:
    """None for one new token (it sees every cached key); else query i sees keys up to its position."""
    if t_q == 1:
        return None
    return torch.ones(t_q, t_k, dtype=torch.bool, device=device).tril(diagonal=t_k - t_q)


class FeedForward(nn.Module):
    """down(gelu_tanh(up(x)))."""

    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        self.up = nn.Linear(cfg.d_model, cfg.d_ff)
        self.down = nn.Linear(cfg.d_ff, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x), approximate="tanh"))


class Block(nn.Module):
    """Pre-LayerNorm transformer block."""

    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        self.attn_norm = nn.LayerNorm(cfg.d_model, eps=cfg.norm_eps)
        self.attn = Attention(cfg)
        self.ffn_norm = nn.LayerNorm(cfg.d_model, eps=cfg.norm_eps)
        self.ffn = FeedForward(cfg)

    def forward(self, x: torch.Tensor, cache: KVCache | None = None, layer: int = 0) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cache, layer)
        return x + self.ffn(self.ffn_norm(x))


class GPT2(nn.Module):
    """Token (optionally donor-width + lens) and position embeddings, blocks, final LayerNorm, head."""

    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_embd = nn.Embedding(cfg.vocab_size, cfg.donor_dim or cfg.d_model)
        self.lens = nn.Linear(cfg.donor_dim, cfg.d_model, bias=False) if cfg.donor_dim else None
        self.pos_embd = nn.Embedding(cfg.context_length, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.norm = nn.LayerNorm(cfg.d_model, eps=cfg.norm_eps)
        self.head = None if cfg.tie_embeddings else nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)

    def embedding_table(self) -> torch.Tensor:
        """The (vocab, d_model) token table the model actually uses: the lens folded in when present."""
        if self.lens is None:
            return self.tok_embd.weight
        return self.lens(self.tok_embd.weight)

    def hidden(self, idx: torch.Tensor, cache: KVCache | None = None) -> torch.Tensor:
        """Final-norm hidden states (B, T, d_model); with a cache, `idx` continues the cached tokens."""
        start = 0 if cache is None else cache.length
        end = start + idx.shape[1]
        if end > self.cfg.context_length:
            raise ValueError(f"sequence of {end} tokens exceeds context_length {self.cfg.context_length}")
        x = self.tok_embd(idx) if self.lens is None else self.lens(self.tok_embd(idx))
        x = x + self.pos_embd(torch.arange(start, end, device=idx.device))
        for i, block in enumerate(self.blocks):
            x = block(x, cache, i)
        return self.norm(x)

    def head_weight(self) -> torch.Tensor:
        return self.embedding_table() if self.head is None else self.head.weight

    def forward(self, idx: torch.Tensor, cache: KVCache | None = None) -> torch.Tensor:
        """Logits (B, T, vocab)."""
        return F.linear(self.hidden(idx, cache), self.head_weight())

    def loss(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean next-token cross-entropy (softmax in fp32); chunked head + softmax when training."""
        h = self.hidden(idx).flatten(0, 1)
        if torch.is_grad_enabled():
            return linear_cross_entropy(h, self.head_weight(), targets.flatten())
        return F.cross_entropy(F.linear(h, self.head_weight()).float(), targets.flatten())


def init_gpt2(model: GPT2, std: float, seed: int) -> None:
    """GPT-2 init: weights N(0, std), residual projections std/sqrt(2*n_layer), biases 0, LayerNorms 1.

    Each parameter draws from its own generator seeded by (seed, name), as `pipeline.model.init_weights`
    does, so adding a lens does not change the blocks' init.
    """
    resid_std = std / math.sqrt(2 * model.cfg.n_layer)
    with torch.no_grad():
        for name, p in model.named_parameters():
            generator = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
            if "norm." in name:
                p.fill_(1.0 if name.endswith("weight") else 0.0)
            elif name.endswith("bias"):
                p.zero_()
            elif name.endswith(("attn.proj.weight", "ffn.down.weight")):
                p.normal_(0.0, resid_std, generator=generator)
            else:
                p.normal_(0.0, std, generator=generator)


def gpt2_tensors(model: GPT2) -> dict[str, np.ndarray]:
    """Every tensor under its GGUF name, fp32, lens folded in; `output.weight` only for an untied head.

    A tied head is left out, as llama.cpp's converter does since llama.cpp PR #12456 (March 2025):
    llama.cpp then reads token_embd as the head and transformers sets tie_word_embeddings.
    """

    def arr(t: torch.Tensor) -> np.ndarray:
        return t.detach().float().cpu().numpy()

    with torch.no_grad():
        table = arr(model.embedding_table())
        out = {"token_embd.weight": table, "position_embd.weight": arr(model.pos_embd.weight)}
        for i, block in enumerate(model.blocks):
            params = dict(block.named_parameters())
            for ours, theirs in BLOCK_TENSORS.items():
                out[f"blk.{i}.{theirs}"] = arr(params[ours])
        out["output_norm.weight"] = arr(model.norm.weight)
        out["output_norm.bias"] = arr(model.norm.bias)
        if model.head is not None:
            out["output.weight"] = arr(model.head.weight)
    return out


def gpt2_metadata(cfg: TransformerConfig, dtype: str) -> dict[str, Any]:
    """The `gpt2.*` keys llama.cpp and transformers read to rebuild the model."""
    return {
        "gpt2.context_length": cfg.context_length,
        "gpt2.embedding_length": cfg.d_model,
        "gpt2.feed_forward_length": cfg.d_ff,
        "gpt2.block_count": cfg.n_layer,
        "gpt2.attention.head_count": cfg.n_head,
        "gpt2.attention.layer_norm_epsilon": float(cfg.norm_eps),
        "general.file_type": FILE_TYPES[dtype],
        "general.quantization_version": 2,  # GGML_QUANT_VERSION, as llama.cpp's converter writes
    }


def transformers_overrides(cfg: TransformerConfig) -> dict[str, int]:
    """Config kwargs transformers needs beside `gguf_file=` to load our gpt2 GGUF ({} for GPT-2 sizes).

    transformers 5's GGUF loader maps `gpt2.context_length` to `n_ctx` and `feed_forward_length`
    to a key GPT2Config ignores, so it always builds 1024 positions and a 4*d_model MLP.
    """
    out = {}
    if cfg.context_length != 1024:
        out["n_positions"] = cfg.context_length
    if cfg.d_ff != 4 * cfg.d_model:
        out["n_inner"] = cfg.d_ff
    return out


def export_gpt2(
    model: GPT2, path: Path, tokenizer_meta: dict[str, Any], provenance: dict[str, Any], dtype: str = "f32"
) -> Path:
    """Write `model` as a gpt2 GGUF with the caller's tokenizer metadata and provenance keys."""
    from pipeline.convert import write_model_gguf

    return write_model_gguf(
        path, "gpt2", gpt2_metadata(model.cfg, dtype), gpt2_tensors(model), tokenizer_meta, provenance, dtype
    )


def gpt2_config_from_gguf(g: GGUFFile) -> TransformerConfig:
    """Our config from `gpt2.*` keys and tensor shapes; no `output.weight` means a tied head."""
    d_model = int(g.arch_key("embedding_length"))
    n_head = int(g.arch_key("attention.head_count"))
    n_layer = int(g.arch_key("block_count"))
    context = int(g.arch_key("context_length"))
    n_kv = int(g.metadata.get("gpt2.attention.head_count_kv", n_head))
    if n_head <= 0 or d_model % n_head or n_kv != n_head:
        raise GGUFError(
            problem(
                f"{g.path} gpt2.attention.head_count(_kv)",
                f"one head count dividing {d_model}",
                f"{n_head} (kv {n_kv})",
                "the file is inconsistent or uses grouped-query attention, which gpt2 does not have",
            )
        )
    _check_tensor_names(g, n_layer)
    rows = g.tensor_info("token_embd.weight").shape[0]
    for name, want in (("token_embd.weight", (rows, d_model)), ("position_embd.weight", (context, d_model))):
        found = g.tensor_info(name).shape
        if found != want:
            raise GGUFError(
                problem(f"{g.path} tensor {name}", f"shape {want} (from gpt2.* keys)", f"shape {found}", "re-export it")
            )
    return TransformerConfig(
        vocab_size=rows,
        d_model=d_model,
        n_layer=n_layer,
        n_head=n_head,
        n_kv_head=n_head,
        d_ff=int(g.arch_key("feed_forward_length")),
        context_length=context,
        # the float32 the file holds, read back as the shortest decimal that gives it (1e-05, not 9.99999974e-06)
        norm_eps=float(str(np.float32(g.arch_key("attention.layer_norm_epsilon")))),
        tie_embeddings=not g.has_tensor("output.weight"),
        arch="gpt2",
    )


def _check_tensor_names(g: GGUFFile, n_layer: int) -> None:
    """Exactly the tensors our module has (output.weight optional): nothing missing, nothing ignored."""
    expected = {"token_embd.weight", "position_embd.weight", "output_norm.weight", "output_norm.bias"}
    expected |= {f"blk.{i}.{theirs}" for i in range(n_layer) for theirs in BLOCK_TENSORS.values()}
    present = set(g.tensor_names())
    missing, extra = sorted(expected - present), sorted(present - expected - {"output.weight"})
    if missing or extra:
        raise GGUFError(
            problem(
                str(g.path),
                f"the gpt2 tensors for {n_layer} blocks",
                f"missing {missing[:4]}, unexpected {extra[:4]}",
                "re-export the file; other gpt2 variants are not supported",
            )
        )


def load_gpt2(g: GGUFFile) -> GPT2:
    """A whole gpt2 GGUF as our fp32 module (dequantizing every tensor), shapes checked by name.

    Built on the meta device and given the file's tensors as parameters: no throw-away init.
    """
    cfg = gpt2_config_from_gguf(g)
    with torch.device("meta"):
        model = GPT2(cfg)
    names = {
        "tok_embd.weight": "token_embd.weight",
        "pos_embd.weight": "position_embd.weight",
        "norm.weight": "output_norm.weight",
        "norm.bias": "output_norm.bias",
    }
    if not cfg.tie_embeddings:
        names["head.weight"] = "output.weight"
    for i in range(cfg.n_layer):
        for ours, theirs in BLOCK_TENSORS.items():
            names[f"blocks.{i}.{ours}"] = f"blk.{i}.{theirs}"
    expected = model.state_dict()
    state = {}
    for ours, theirs in names.items():
        arr = g.tensor(theirs)
        want = tuple(expected[ours].shape)
        if arr.shape != want:
            raise GGUFError(
                problem(f"{g.path} tensor {theirs}", f"shape {want}", f"shape {arr.shape}", "the file is inconsistent")
            )
        state[ours] = torch.from_numpy(arr)
    model.load_state_dict(state, strict=True, assign=True)
    return model
