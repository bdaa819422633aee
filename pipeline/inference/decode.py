"""A llama model packed for decoding: the generate and chat paths, not training.

Per token, eager PyTorch spends most of its time in Python and small ops, and in reading the
weights. So, once at load: q|k|v and gate|up become one matmul each, the RoPE rotations are
computed for the whole context, and the weights are stored as `precision` says:

- `int8`: each weight row as int8 with one bf16 scale (symmetric, max |w| -> 127), multiplied by
  `torch.ops.aten._weight_int8pack_mm` on CPU (bf16 activations): half the bytes of bf16;
- `int4` (CPU only): the block weights as 4-bit Q4_1-style blocks of 32 (`_int4_blocks`, through
  `_weight_int4pack_mm_for_cpu`), the head as int8 rows: a quarter of bf16's bytes, and
  near-exact for a Q4_0/Q4_1 GGUF (its weights are already on such a grid), lossy otherwise;
- `bf16`: bf16 weights and activations;
- `fp32`: the model's own weights (no rounding; the reference the others are checked against).

A quantized head's best RESCORED candidates are recomputed from the bf16 rows (which the token
lookup reads too), so its rounding cannot reorder the top of the distribution. Norms, RoPE, the
residual stream and attention stay fp32 in every mode (CPU attention in bf16 is
slower, and less exact); the KV cache is a fp32 buffer preallocated and written in place
(`StaticKVCache`), grown by doubling, never by a cat per step.

On CUDA a one-token step runs with static shapes (`_static_step`: the position is a device tensor,
attention reads the whole cache under a mask) and is replayed as a CUDA graph (`GraphedCall`), one
per cache buffer: eagerly, the step's ~400 small kernel launches cost more than the kernels.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from pipeline.config.tools_schema import DECODE_PRECISIONS
from pipeline.errors import ConfigError, problem
from pipeline.models.cuda_graph import GraphedCall
from pipeline.models.llama import Llama
from pipeline.models.ops.elementwise import rope_tables
from pipeline.models.transformer import TransformerConfig, causal_mask

log = logging.getLogger(__name__)
PRECISIONS = DECODE_PRECISIONS  # int8, int4, bf16, fp32
INT4_GROUP = 32  # weights per int4 block, as Q4_0/Q4_1
RESCORED = 64  # candidates of a quantized head recomputed exactly (generate's top_k is 40)
_FIRST_CAPACITY = 256  # cache positions allocated at first; doubled as needed up to context_length
_GRAPHS_KEPT = 8  # captured steps a decoder keeps (one per cache buffer and batch size)


def check_precision(precision: str, where: str = "precision") -> None:
    """A decode precision other than PRECISIONS is a one-line named error."""
    if precision not in PRECISIONS:
        raise ConfigError(problem(where, f"one of {', '.join(PRECISIONS)}", repr(precision), f"use {where}=int8"))


class PackedLinear:
    """`x @ W.T` with W stored for `precision` (see the module docstring); no bias (llama has none).
    `int4` needs in_features divisible by the group (32); other shapes fall back to int8 rows."""

    def __init__(self, weight: torch.Tensor, precision: str):
        w = weight.detach().float()
        self.out_features, self.in_features = w.shape
        self.scale: torch.Tensor | None = None
        self.kind = "int8" if precision == "int4" and self.in_features % INT4_GROUP else precision
        if self.kind == "int4":
            self.weight, self.scale = _int4_blocks(w)
        elif self.kind == "int8":
            scale = (w.abs().amax(1) / 127).clamp(min=1e-12).to(torch.bfloat16)
            self.weight = torch.round(w / scale.float()[:, None]).clamp(-127, 127).to(torch.int8).contiguous()
            self.scale = scale
        else:
            self.weight = w.to(torch.bfloat16 if precision == "bf16" else torch.float32).contiguous()

    def dequantized(self) -> torch.Tensor:
        """The weight this layer multiplies by, in fp32 (for tests and the embedding lookup)."""
        if self.kind == "int4":  # the kernel itself, on the identity
            eye = torch.eye(self.in_features, dtype=torch.bfloat16, device=self.weight.device)
            return self(eye).float().T
        w = self.weight.float()
        return w if self.scale is None else w * self.scale.float()[:, None]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.scale is None:
            return F.linear(x, self.weight)
        if x.device.type != "cpu":  # no int8 kernel everywhere: dequantize per call (still half the memory)
            return F.linear(x, self.weight.to(x.dtype)) * self.scale
        flat = x.reshape(-1, self.in_features)
        if self.kind == "int4":
            out = torch.ops.aten._weight_int4pack_mm_for_cpu(flat, self.weight, INT4_GROUP, self.scale)
        else:
            out = torch.ops.aten._weight_int8pack_mm(flat, self.weight, self.scale)
        return out.view(*x.shape[:-1], self.out_features)

    def to(self, device: torch.device) -> PackedLinear:
        self.weight = self.weight.to(device)
        self.scale = None if self.scale is None else self.scale.to(device)
        return self


def _int4_blocks(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_1-style blocks of INT4_GROUP weights, w = q * d + m with q in 0..15 (d = (max - min)/15,
    m = min), packed for `_weight_int4pack_mm_for_cpu`, which computes (q - 8) * d + (m + 8d) with
    bf16 d and m + 8d: weights dequantized from Q4_1 land on the same grid again."""
    n, k = w.shape
    blocks = w.view(n, k // INT4_GROUP, INT4_GROUP)
    low, high = blocks.amin(-1, keepdim=True), blocks.amax(-1, keepdim=True)
    d = ((high - low) / 15).clamp(min=1e-12).to(torch.bfloat16).float()
    zero = (low + 8 * d).to(torch.bfloat16).float()
    q = torch.round((blocks - zero) / d + 8).clamp(0, 15).to(torch.int32).view(n, k)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
    scales_zeros = torch.stack([d.view(n, -1).T, zero.view(n, -1).T], dim=-1).to(torch.bfloat16).contiguous()
    return packed, scales_zeros


def effective_weight(module: nn.Module) -> torch.Tensor:
    """The fp32 weight a linear layer applies: a LoRA wrapper's base plus its delta, a quantized
    (QLoRA) base dequantized, else the plain weight."""
    if hasattr(module, "delta_weight"):
        return module.base_weight() + module.delta_weight()
    if hasattr(module, "dequantize"):
        return module.dequantize()
    return module.weight.float()


class StaticKVCache:
    """Keys and values of every layer in one preallocated buffer (n_layer, B, n_kv_head, capacity,
    head_dim), written in place; `length` positions are valid. `truncate` just moves `length` back."""

    def __init__(self, cfg: TransformerConfig, dtype: torch.dtype, device: torch.device):
        self.cfg, self.dtype, self.device = cfg, dtype, device
        self.k = self.v = torch.empty(0)
        self.length = 0

    def reserve(self, batch: int, n: int) -> None:
        """Room for `n` positions (at most context_length), keeping what is cached."""
        if self.k.numel() and self.k.shape[1] == batch and self.k.shape[3] >= n:
            return
        first = _FIRST_CAPACITY * (4 if self.device.type == "cuda" else 1)  # each new buffer: a new CUDA graph
        capacity = min(max(first, n, 2 * (self.k.shape[3] if self.k.numel() else 0)), self.cfg.context_length)
        shape = (self.cfg.n_layer, batch, self.cfg.n_kv_head, capacity, self.cfg.head_dim)
        k, v = (torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(2))
        if self.length:
            k[:, :, :, : self.length] = self.k[:, :, :, : self.length]
            v[:, :, :, : self.length] = self.v[:, :, :, : self.length]
        self.k, self.v = k, v

    def truncate(self, length: int) -> None:
        self.length = min(self.length, length)


def to_pairs(t: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Rows of whole heads from the halves layout (RoPE on (x_i, x_i+d/2)) into adjacent pairs: the
    decoder rotates pairs only (a complex product), and attention is the same under this reordering."""
    return t.reshape(-1, 2, head_dim // 2, *t.shape[1:]).transpose(1, 2).reshape(t.shape)


def _norm_weight(module: nn.Module | None) -> torch.Tensor | None:
    return None if module is None else module.weight.detach().float().clone()


class PackedLayer:
    """One block's weights, packed; q and k rows (their biases and norms too) in adjacent-pairs order."""

    def __init__(self, block: nn.Module, precision: str, halves: bool = False):
        attn, ffn = block.attn, block.ffn
        hd = attn.cfg.head_dim
        q, k, v = (effective_weight(m) for m in (attn.wq, attn.wk, attn.wv))
        biases = [getattr(m, "bias", None) for m in (attn.wq, attn.wk, attn.wv)]
        self.q_norm, self.k_norm = (
            _norm_weight(getattr(attn, "q_norm", None)),
            _norm_weight(getattr(attn, "k_norm", None)),
        )
        if halves:
            q, k = to_pairs(q, hd), to_pairs(k, hd)
            biases[:2] = [None if b is None else to_pairs(b.detach(), hd) for b in biases[:2]]
            self.q_norm, self.k_norm = (None if w is None else to_pairs(w, hd) for w in (self.q_norm, self.k_norm))
        self.qkv = PackedLinear(torch.cat([q, k, v]), precision)
        self.qkv_bias = None if biases[0] is None else torch.cat([b.detach().float() for b in biases])
        self.wo = PackedLinear(effective_weight(attn.wo), precision)
        self.gate_up = PackedLinear(torch.cat([effective_weight(ffn.gate), effective_weight(ffn.up)]), precision)
        self.down = PackedLinear(effective_weight(ffn.down), precision)
        self.gelu = ffn.gelu
        self.attn_norm = block.attn_norm.weight.detach().float().clone()
        self.ffn_norm = block.ffn_norm.weight.detach().float().clone()
        self.post_attn_norm = _norm_weight(getattr(block, "post_attn_norm", None))
        self.post_ffn_norm = _norm_weight(getattr(block, "post_ffn_norm", None))
        self.local, self.window = attn.local, attn.window

    def to(self, device: torch.device) -> PackedLayer:
        for name in ("qkv", "wo", "gate_up", "down"):
            getattr(self, name).to(device)
        for name in ("attn_norm", "ffn_norm", "post_attn_norm", "post_ffn_norm", "q_norm", "k_norm", "qkv_bias"):
            value = getattr(self, name)
            setattr(self, name, None if value is None else value.to(device))
        return self


class PackedLlama(nn.Module):
    """A `Llama` packed for decoding: `model(idx, cache)` gives the same logits as the source model
    (exactly in fp32 up to summation order; within the rounding of `precision` otherwise)."""

    def __init__(self, model: Llama, precision: str, device: torch.device | str = "cpu"):
        super().__init__()
        check_precision(precision)
        cfg = model.cfg
        self.cfg, self.precision = cfg, precision
        self.device = torch.device(device)
        # how a one-token step with a cache runs: "graph" (CUDA), "static" (the graph's step, eager), "dynamic"
        self.step_mode = "graph" if self.device.type == "cuda" else "dynamic"
        self.graphs: dict[tuple, GraphedCall] = {}  # each with its own memory pool: replayed in any order
        if precision == "int4" and self.device.type != "cpu":
            found = f"device {self.device.type}"
            raise ConfigError(
                problem("precision=int4", "the CPU (its kernel is CPU-only)", found, "use precision=int8")
            )
        self.dtype = torch.float32 if precision == "fp32" else torch.bfloat16
        with torch.no_grad():
            halves = cfg.family.rope_halves
            self.layers = [PackedLayer(b, precision, halves).to(self.device) for b in model.blocks]
            self.norm = model.norm.weight.detach().float().clone().to(self.device)
            self.table = model.embedding_table().detach().to(self.device, self.dtype)  # looked up: stays exact
            self.embed_scale = model._scale  # Gemma's sqrt(d_model); 0: none
            head = self.table if model.head is None else effective_weight(model.head).to(self.device, self.dtype)
            self.head = PackedLinear(head, "int8" if precision == "int4" else precision).to(self.device)
            self.head_rows = None if self.head.scale is None else head  # rescores the quantized head's best
            # (context, head_dim/2): RoPE as a complex product; the sliding layers' with their own base
            self.ropes = [
                torch.complex(
                    *rope_tables(cfg, cfg.context_length, self.device, model._frequencies(self.device, local))
                )
                for local in (False, True)
            ]

    def new_cache(self) -> StaticKVCache:
        return StaticKVCache(self.cfg, torch.float32, self.device)  # CPU attention in bf16 is slower

    def _embed(self, idx: torch.Tensor) -> torch.Tensor:
        x = F.embedding(idx, self.table).float()
        return x * self.embed_scale if self.embed_scale else x

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        """The head; a quantized one's RESCORED best candidates recomputed with the unquantized rows,
        so its rounding cannot reorder the top of the distribution (what greedy and top-k see)."""
        logits = self.head(h).float()
        if self.head_rows is None:
            return logits
        best = logits.topk(min(RESCORED, logits.shape[-1]), dim=-1).indices
        exact = torch.einsum("btd,btkd->btk", h.float(), F.embedding(best, self.head_rows).float())
        return logits.scatter(-1, best, exact)

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), weight, self.cfg.norm_eps).to(self.dtype)

    def _qkv(self, layer: int, h: torch.Tensor, rope: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """fp32 q (B, n_head, T, hd), k and v (B, n_kv_head, T, hd) of `h` (B, T, d_model); `rope`: (T, hd/2)."""
        cfg, w = self.cfg, self.layers[layer]
        b, t, _ = h.shape
        nq, nkv, hd = cfg.n_head, cfg.n_kv_head, cfg.head_dim
        qkv = w.qkv(h) if w.qkv_bias is None else w.qkv(h).float() + w.qkv_bias
        qk = qkv[..., : (nq + nkv) * hd].float().view(b, t, nq + nkv, hd)
        if w.q_norm is not None:  # per-head norms (Qwen3, Gemma 3), before RoPE
            eps = cfg.norm_eps
            qk = torch.cat(
                [F.rms_norm(qk[:, :, :nq], (hd,), w.q_norm, eps), F.rms_norm(qk[:, :, nq:], (hd,), w.k_norm, eps)], 2
            )
        qk = torch.view_as_complex(qk.view(b, t, nq + nkv, hd // 2, 2))
        qk = torch.view_as_real(qk * rope[:, None]).flatten(-2)
        v = qkv[..., (nq + nkv) * hd :].float().view(b, t, nkv, hd).transpose(1, 2)
        return qk[:, :, :nq].transpose(1, 2), qk[:, :, nq:].transpose(1, 2), v

    def _attention(self, layer: int, h: torch.Tensor, start: int, cache: StaticKVCache | None) -> torch.Tensor:
        """Grouped-query attention of `h` (B, T, d_model) at positions start.. over the cache."""
        cfg, w = self.cfg, self.layers[layer]
        b, t, _ = h.shape
        nq, hd = cfg.n_head, cfg.head_dim
        q, k, v = self._qkv(layer, h, self.ropes[w.local][start : start + t])
        if cache is not None:
            cache.k[layer, :, :, start : start + t] = k
            cache.v[layer, :, :, start : start + t] = v
            k, v = cache.k[layer, :, :, : start + t], cache.v[layer, :, :, : start + t]
        slides = 0 < w.window < start + t
        if t == 1 and not slides:
            y = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
        elif start == 0 and not slides:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        else:
            mask = causal_mask(t, start + t, h.device, w.window)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        return w.wo(y.transpose(1, 2).reshape(b, t, nq * hd).to(self.dtype))

    def _branch(self, x: torch.Tensor, out: torch.Tensor, post: torch.Tensor | None) -> torch.Tensor:
        """The residual add of a branch's output, normalised first where the family says (Gemma 3)."""
        return x + (out if post is None else F.rms_norm(out.float(), (out.shape[-1],), post, self.cfg.norm_eps))

    def _ffn(self, w: PackedLayer, x: torch.Tensor) -> torch.Tensor:
        gate, up = w.gate_up(self._norm(x, w.ffn_norm)).chunk(2, dim=-1)
        act = F.gelu(gate, approximate="tanh") if w.gelu else F.silu(gate)
        return self._branch(x, w.down(act * up), w.post_ffn_norm)

    def forward(self, idx: torch.Tensor, cache: StaticKVCache | None = None, last_only: bool = False) -> torch.Tensor:
        """fp32 logits (B, T, vocab), or (B, 1, vocab) of the last position with `last_only`; with a
        cache, `idx` continues the cached tokens."""
        b, t = idx.shape
        start = 0 if cache is None else cache.length
        if start + t > self.cfg.context_length:
            raise ValueError(f"sequence of {start + t} tokens exceeds context_length {self.cfg.context_length}")
        if cache is not None:
            cache.reserve(b, start + t)
            if t == 1 and self.step_mode != "dynamic":
                logits = self._one_step(idx, cache)
                cache.length = start + 1
                return logits
        x = self._embed(idx)
        for i, w in enumerate(self.layers):
            x = self._branch(x, self._attention(i, self._norm(x, w.attn_norm), start, cache), w.post_attn_norm)
            x = self._ffn(w, x)
        if cache is not None:
            cache.length = start + t
        if last_only:
            x = x[:, -1:]
        return self._logits(self._norm(x, self.norm))

    def _one_step(self, idx: torch.Tensor, cache: StaticKVCache) -> torch.Tensor:
        """The next position's logits (B, 1, vocab) by the static step: replayed as a CUDA graph
        (captured on first use for this cache buffer), or run eagerly with step_mode="static"."""
        pos = torch.full((1,), cache.length, dtype=torch.long, device=self.device)
        if self.step_mode == "static":
            return self._static_step(idx, pos, cache.k, cache.v)
        key = (idx.shape[0], cache.k.data_ptr(), cache.v.data_ptr(), cache.k.shape)
        graph = self.graphs.get(key)
        if graph is None:
            while len(self.graphs) >= _GRAPHS_KEPT:
                self.graphs.pop(next(iter(self.graphs)))
            k, v = cache.k, cache.v
            try:
                graph = self.graphs[key] = GraphedCall(lambda i, p: self._static_step(i, p, k, v), (idx, pos))
            except RuntimeError as e:  # a GPU or driver without graph capture: the same step, launched eagerly
                log.warning(f"decode: CUDA graph capture failed ({e}); decoding without graphs")
                self.step_mode = "static"
                return self._static_step(idx, pos, k, v)
        return graph(idx, pos).clone()  # the graph's output is overwritten by its next replay

    def _static_step(self, idx: torch.Tensor, pos: torch.Tensor, k_all: torch.Tensor, v_all: torch.Tensor):
        """One token per row at position `pos` (a (1,) device tensor), written into the cache buffers
        `k_all`/`v_all` (n_layer, B, n_kv_head, capacity, head_dim); attention reads every cached
        position under a mask of those <= pos. Fixed shapes, no host reads: a CUDA graph can hold it."""
        cfg = self.cfg
        b, nq, nkv, hd = idx.shape[0], cfg.n_head, cfg.n_kv_head, cfg.head_dim
        at = torch.arange(k_all.shape[3], device=idx.device)
        seen = (at <= pos).view(1, 1, 1, -1)
        ropes = [r.index_select(0, pos) for r in self.ropes]
        x = self._embed(idx)
        for i, w in enumerate(self.layers):
            q, k, v = self._qkv(i, self._norm(x, w.attn_norm), ropes[w.local])
            k_all[i].index_copy_(2, pos, k)
            v_all[i].index_copy_(2, pos, v)
            q = q.reshape(b, nkv, nq // nkv, hd)  # a query head group per kv head (GQA)
            mask = seen & (at > pos - w.window).view(1, 1, 1, -1) if w.window else seen
            scores = (q @ k_all[i].transpose(-1, -2)).mul_(hd**-0.5).masked_fill_(~mask, float("-inf"))
            y = torch.softmax(scores, dim=-1) @ v_all[i]
            x = self._branch(x, w.wo(y.reshape(b, 1, nq * hd).to(self.dtype)), w.post_attn_norm)
            x = self._ffn(w, x)
        return self._logits(self._norm(x, self.norm))


class Int8Linear(nn.Module):
    """An `nn.Linear` with int8 rows (`PackedLinear`) and a bf16 bias: int8 for other architectures."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.packed = PackedLinear(effective_weight(linear), "int8").to(linear.weight.device)
        bias = getattr(linear, "bias", None)
        self.bias = None if bias is None else nn.Parameter(bias.detach().to(torch.bfloat16), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.packed(x.to(torch.bfloat16))
        return out if self.bias is None else out + self.bias


def quantize_linears(model: nn.Module) -> nn.Module:
    """Every linear layer of `model` as an `Int8Linear`, the rest in bf16 (a tied head stays bf16)."""
    for name, module in list(model.named_modules()):
        if isinstance(module, nn.Linear):
            parent, _, attr = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, attr, Int8Linear(module))
    return model.to(torch.bfloat16)


def for_decoding(model: nn.Module, precision: str, device: torch.device | str = "cpu") -> nn.Module:
    """The model to decode with: a llama packed for `precision` (`PackedLlama`); another
    architecture as its own modules, in bf16/fp32 or with int8 linear layers (for int8 and int4)."""
    check_precision(precision)
    if isinstance(model, Llama):
        return PackedLlama(model, precision, device)
    model = model.to(device)
    if precision in ("int8", "int4"):
        return quantize_linears(model)
    return model.to(dtype=torch.bfloat16 if precision == "bf16" else torch.float32)
