"""What every architecture shares: the config dataclass, the block, attention over a KV cache, the
token table with its optional donor lens, the (tied) head and the loss, the seeded init.

An architecture (`llama.py`, `gpt2.py`) supplies its attention and feed-forward modules, its norm,
how positions enter (`embed`), and which projections are residual; everything else lives here, so
the two cannot drift apart.
"""

from __future__ import annotations

import json
import math
import zlib
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pipeline.errors import ConfigError, problem
from pipeline.models.devices import to_device
from pipeline.models.names import FAMILIES, Family
from pipeline.models.ops.head_rows import HeadVocab
from pipeline.models.ops.losses import linear_cross_entropy, linear_distill_loss, linear_nll, select_targets
from pipeline.models.ops.varlen import PackedRows

Rope = tuple[torch.Tensor, ...] | None  # (cos, sin[, the sliding layers' cos, sin]) for RoPE architectures, else None


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
    key_length: int = 0  # the width of a head (GGUF attention.key_length); 0 = d_model / n_head
    rope_scale: float = 1.0  # linear RoPE scaling: positions divided by this (GGUF rope.scaling.factor)
    sliding_window: int = 0  # keys a sliding layer's query sees, itself included (0: no sliding layers)
    sliding_layers: tuple[bool, ...] = ()  # per layer, whether it slides (GGUF attention.sliding_window_pattern)
    rope_theta_local: float = 10000.0  # the RoPE base of sliding layers (GGUF rope.freq_base_swa)

    @property
    def head_dim(self) -> int:
        return self.key_length or self.d_model // self.n_head

    @property
    def family(self) -> Family:
        """What this llama-family architecture changes in llama's block (`names.FAMILIES`)."""
        return FAMILIES[self.arch]

    def sliding(self, layer: int) -> bool:
        """Whether `layer` attends within `sliding_window` keys (with the local RoPE base)."""
        return bool(self.sliding_window) and layer < len(self.sliding_layers) and self.sliding_layers[layer]

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True)

    @classmethod
    def from_hparams(cls, hparams: Any, vocab_size: int, donor_dim: int = 0) -> TransformerConfig:
        """The architecture a `ModelConfig` asks for, with the vocabulary the tokenizer fixes."""
        shared = {f.name: getattr(hparams, f.name) for f in fields(cls) if hasattr(hparams, f.name)}
        head = getattr(hparams, "head_dim", 0)
        shared["key_length"] = head if head and head * hparams.n_head != hparams.d_model else 0
        return cls(**{**shared, "vocab_size": vocab_size, "donor_dim": donor_dim})

    @classmethod
    def from_dict(cls, d: Any, where: str = "model config", fix: str = "re-run realize") -> TransformerConfig:
        """A config read back from JSON, every field type- and range-checked: a corrupt file is a named
        error, not a TypeError or a huge allocation when the model is built."""
        known = {f.name for f in fields(cls)}
        if not isinstance(d, dict):
            raise ConfigError(problem(where, "a JSON object of model settings", type(d).__name__, fix))
        unknown, missing = sorted(set(d) - known), sorted(_REQUIRED - set(d))
        if unknown or missing:
            found = f"unknown keys {unknown}" if unknown else f"missing keys {missing}"
            raise ConfigError(problem(where, f"keys among {sorted(known)}", found, fix))
        for key, value in d.items():
            if not _CHECKS[key](value):
                raise ConfigError(problem(f"{where} {key}", _EXPECTED[key], f"{value!r}"[:60], fix))
        if (not d.get("key_length") and d["d_model"] % d["n_head"]) or d["n_head"] % d["n_kv_head"]:
            found = f"d_model={d['d_model']}, n_head={d['n_head']}, n_kv_head={d['n_kv_head']}"
            raise ConfigError(problem(where, "n_head dividing d_model and n_kv_head dividing n_head", found, fix))
        if len(d.get("sliding_layers", ())) not in (0, d["n_layer"]):
            found = f"{len(d['sliding_layers'])} entries for n_layer={d['n_layer']}"
            raise ConfigError(problem(f"{where} sliding_layers", "one entry per layer", found, fix))
        return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in d.items()})

    @classmethod
    def load(cls, path: Path, fix: str = "re-run realize") -> TransformerConfig:
        """`config.json` as written by `to_json`; `fix` names the stage that writes it."""
        try:
            d = json.loads(Path(path).read_text())
        except (OSError, ValueError) as e:  # ValueError: bad JSON or bytes that are not UTF-8
            found = f"unreadable ({type(e).__name__}: {' '.join(str(e).split())[:80]})"
            raise ConfigError(problem(str(path), "a model config.json", found, fix)) from None
        return cls.from_dict(d, str(path), fix)


_MAX_SIZE = 2**31 - 1  # sizes are int32 in llama.cpp; larger is a corrupt file


def _size(low: int) -> Any:
    return lambda v: isinstance(v, int) and not isinstance(v, bool) and low <= v <= _MAX_SIZE


def _positive(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0


_CHECKS = {name: _size(1) for name in ("vocab_size", "d_model", "n_head", "n_kv_head", "d_ff", "context_length")}
_CHECKS |= {"n_layer": _size(0), "donor_dim": _size(0), "rope_theta": _positive, "norm_eps": _positive}
_CHECKS |= {"tie_embeddings": lambda v: isinstance(v, bool), "arch": lambda v: isinstance(v, str)}
_CHECKS["rope_freq_factors"] = lambda v: isinstance(v, (list, tuple)) and all(_positive(x) for x in v)
_CHECKS |= {"key_length": _size(0), "sliding_window": _size(0), "rope_scale": _positive, "rope_theta_local": _positive}
_CHECKS["sliding_layers"] = lambda v: isinstance(v, (list, tuple)) and all(isinstance(x, bool) for x in v)
_EXPECTED = {name: f"an integer in [1, {_MAX_SIZE}]" for name in _CHECKS}
_EXPECTED |= {"n_layer": f"an integer in [0, {_MAX_SIZE}]", "donor_dim": f"an integer in [0, {_MAX_SIZE}]"}
_EXPECTED |= {"rope_theta": "a positive number", "norm_eps": "a positive number", "tie_embeddings": "true or false"}
_EXPECTED |= {"arch": "an architecture name", "rope_freq_factors": "a list of positive numbers"}
_EXPECTED |= {"key_length": f"an integer in [0, {_MAX_SIZE}]", "sliding_window": f"an integer in [0, {_MAX_SIZE}]"}
_EXPECTED |= {"rope_scale": "a positive number", "rope_theta_local": "a positive number"}
_EXPECTED["sliding_layers"] = "a list of true/false, one per layer"
_REQUIRED = {"vocab_size", "d_model", "n_layer", "n_head", "n_kv_head", "d_ff", "context_length"}


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


def causal_mask(t_q: int, t_k: int, device: torch.device, window: int = 0) -> torch.Tensor | None:
    """None when no mask is needed (one new token sees every cached key, within its window); else query i
    sees keys up to its own position, and with `window` only the last `window` of them (itself included),
    as llama.cpp's sliding layers do."""
    if t_q == 1 and not 0 < window < t_k:
        return None
    query = torch.arange(t_k - t_q, t_k, device=device)[:, None]
    key = torch.arange(t_k, device=device)[None, :]
    seen = key <= query
    return seen & (query - key < window) if 0 < window < t_k else seen


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cache: KVCache | None,
    layer: int,
    rows: PackedRows | None,
    window: int = 0,
) -> torch.Tensor:
    """Causal attention of (B, H, T, D) queries over the keys, cached ones included; with `rows`
    (packed examples, padding dropped: B = 1) each example attends to itself only; `window` > 0: each
    query sees only the last `window` keys.

    Grouped-query attention: query head h reads kv head h // groups, as llama.cpp does.
    """
    if rows is not None:
        if 0 < window < rows.longest:
            raise ValueError(f"packed examples of {rows.longest} tokens exceed the sliding window of {window}")
        return rows.attend(q, k, v)
    if cache is not None:
        k, v = cache.append(layer, k, v)
    groups = q.shape[1] // k.shape[1]
    if groups > 1:
        k = k.repeat_interleave(groups, dim=1)
        v = v.repeat_interleave(groups, dim=1)
    if cache is None and not 0 < window < k.shape[2]:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=causal_mask(q.shape[2], k.shape[2], q.device, window))


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(norm(x)), then + ffn(norm(x)); with post norms (Gemma 3)
    each branch's output is normalised before it is added."""

    def __init__(
        self,
        attn_norm: nn.Module,
        attn: nn.Module,
        ffn_norm: nn.Module,
        ffn: nn.Module,
        post_norms: tuple[nn.Module, nn.Module] | None = None,
    ):
        super().__init__()
        self.attn_norm, self.attn, self.ffn_norm, self.ffn = attn_norm, attn, ffn_norm, ffn
        if post_norms is not None:
            self.post_attn_norm, self.post_ffn_norm = post_norms

    def forward(
        self,
        x: torch.Tensor,
        rope: Rope = None,
        cache: KVCache | None = None,
        layer: int = 0,
        rows: PackedRows | None = None,
    ) -> torch.Tensor:
        a = self.attn(self.attn_norm(x), rope, cache, layer, rows)
        if hasattr(self, "post_attn_norm"):
            x = x + self.post_attn_norm(a)
            return x + self.post_ffn_norm(self.ffn(self.ffn_norm(x)))
        x = x + a
        return x + self.ffn(self.ffn_norm(x))


class DecoderLM(nn.Module):
    """A decoder-only language model: token table (optionally donor-width + lens), blocks, final
    norm, (tied) head. Subclasses build the modules and say how positions enter (`embed`)."""

    cfg: TransformerConfig
    tok_embd: nn.Embedding
    lens: nn.Linear | None
    blocks: nn.ModuleList
    norm: nn.Module
    head: nn.Linear | None
    RESIDUAL_PROJECTIONS: tuple[str, ...] = ()  # parameter name endings initialised at std/sqrt(2*n_layer)
    head_vocab: HeadVocab | None = None  # training's softmax rows (`ops.head_rows`); None: the whole vocabulary

    def _token_table(self, cfg: TransformerConfig) -> None:
        """The token table (donor-width when a lens projects it) and the lens: the first parameters."""
        self.cfg = cfg
        self.tok_embd = nn.Embedding(cfg.vocab_size, cfg.donor_dim or cfg.d_model)
        self.lens = nn.Linear(cfg.donor_dim, cfg.d_model, bias=False) if cfg.donor_dim else None

    def _output(self, cfg: TransformerConfig, norm: nn.Module) -> None:
        """The final norm and an untied head: the last parameters."""
        self.norm = norm
        self.head = None if cfg.tie_embeddings else nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)

    def embed(self, idx: torch.Tensor, start: int, rows: PackedRows | None) -> tuple[torch.Tensor, Rope]:
        """Input of the first block for tokens at positions start.., or at `rows.positions` (one per token
        of `idx` (1, N): packed examples), and the RoPE tables, if any."""
        raise NotImplementedError

    def tokens(self, idx: torch.Tensor) -> torch.Tensor:
        return self.tok_embd(idx) if self.lens is None else self.lens(self.tok_embd(idx))

    def embedding_table(self) -> torch.Tensor:
        """The (vocab, d_model) table the model actually uses: the lens folded in when present."""
        return self.tok_embd.weight if self.lens is None else self.lens(self.tok_embd.weight)

    def head_weight(self) -> torch.Tensor:
        return self.embedding_table() if self.head is None else self.head.weight

    def hidden(self, idx: torch.Tensor, cache: KVCache | None = None) -> torch.Tensor:
        """Final-norm hidden states (B, T, d_model); with a cache, `idx` continues the cached tokens."""
        start = 0 if cache is None else cache.length
        if start + idx.shape[1] > self.cfg.context_length:
            raise ValueError(
                f"sequence of {start + idx.shape[1]} tokens exceeds context_length {self.cfg.context_length}"
            )
        x, rope = self.embed(idx, start, None)
        for i, block in enumerate(self.blocks):
            x = block(x, rope, cache, i)
        return self.norm(x)

    def packed_hidden(self, idx: torch.Tensor, rows: PackedRows) -> torch.Tensor:
        """Final-norm hidden states (N, d_model) of the real tokens of packed rows `idx` (B, T): padding
        is never computed, each example sees only itself, positions restart at each example."""
        if idx.shape[1] > self.cfg.context_length:
            raise ValueError(f"rows of {idx.shape[1]} tokens exceed context_length {self.cfg.context_length}")
        x, rope = self.embed(rows.select(idx).unsqueeze(0), 0, rows)
        for i, block in enumerate(self.blocks):
            x = block(x, rope, None, i, rows)
        return self.norm(x)[0]

    def forward(self, idx: torch.Tensor, cache: KVCache | None = None) -> torch.Tensor:
        """Logits (B, T, vocab)."""
        return F.linear(self.hidden(idx, cache), self.head_weight())

    def loss(self, idx: torch.Tensor, targets: torch.Tensor, segment_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Mean next-token cross-entropy (softmax in fp32) over targets that are not IGNORE_INDEX.

        With gradients on, the head and the softmax run chunked (`linear_cross_entropy`), so the
        (tokens x vocab) fp32 logits are never materialised; without, the plain path a chunk of rows
        at a time (`linear_nll`). `targets` and `segment_ids` may be on the host with `idx` on a GPU:
        the positions that count are then found on the host, without waiting for the device.
        """
        if segment_ids is None:
            h, t = select_targets(self.hidden(idx).flatten(0, 1), targets.flatten())
        else:  # packed rows: only the real tokens are computed (`pipeline.models.ops.varlen`)
            rows = PackedRows(segment_ids, idx.device)
            h, t = select_targets(self.packed_hidden(idx, rows), rows.select(targets))
        w, t, bias = self.head_rows(t)
        if torch.is_grad_enabled():
            return linear_cross_entropy(h, w, t, bias=bias)
        return linear_nll(h, w, t)

    def head_rows(self, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The head rows a loss runs over, `targets` as positions among them, and the rows' logit offsets
        (None: none): the whole head, or with `head_vocab` the corpus's rows (and a training step's
        sampled others)."""
        if self.head_vocab is None:
            return self.head_weight(), targets, None
        rows, bias = self.head_vocab.rows(torch.is_grad_enabled())
        w = self.head_weight()
        return w.index_select(0, to_device(rows, w.device)), self.head_vocab.map(targets), bias

    def distill_loss(
        self,
        idx: torch.Tensor,
        targets: torch.Tensor,
        teacher: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
        weight: float,
        temperature: float,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`(1-weight)*CE + weight*T^2*KL` against the donor's top-k `teacher` = (ids, log-probs, tail)
        of every position (token windows: no ignored targets), and its detached (CE, KD) parts;
        chunked as `loss` is (`pipeline.models.ops.losses.linear_distill_loss`)."""
        h = self.hidden(idx).flatten(0, 1)
        w, t, bias = self.head_rows(to_device(targets.flatten(), h.device))
        if self.head_vocab is not None:
            teacher = (self.head_vocab.map(teacher[0]), *teacher[1:])
        return linear_distill_loss(h, w, t, teacher, weight, temperature, bias=bias)


def init_weights(model: DecoderLM, std: float, seed: int) -> None:
    """GPT-2 style init: N(0, std), residual projections std/sqrt(2*n_layer), norms 1, biases 0.

    Each parameter draws from its own generator seeded by (seed, name), so a parameter's init
    does not depend on which other parameters exist (e.g. `lens` and `pca` get the same blocks).
    """
    resid_std = std / math.sqrt(2 * model.cfg.n_layer)
    with torch.no_grad():
        for name, p in model.named_parameters():
            generator = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
            if "norm." in name:
                p.fill_(1.0 if name.endswith("weight") else 0.0)
            elif name.endswith("bias"):
                p.zero_()
            elif name.endswith(model.RESIDUAL_PROJECTIONS):
                p.normal_(0.0, resid_std, generator=generator)
            else:
                p.normal_(0.0, std, generator=generator)


def count_parameters(model: nn.Module, trainable_only: bool = False) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad or not trainable_only)
