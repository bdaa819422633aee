"""Our llama module <-> GGUF llama tensors and keys, in both directions.

Names, shapes, sizes and the features a file asks for are checked on the way in, so a GGUF that
does not fit gives a named error instead of a silent mis-load.

No Q/K permutation, in either direction. llama.cpp's converter permutes the rows of
attn_q/attn_k from the Hugging Face layout (RoPE on the two halves of each head) into the
original Meta layout (RoPE on adjacent pairs), and transformers un-permutes them when it reads a
GGUF. Our attention applies RoPE to adjacent pairs (`pipeline.models.ops.elementwise.apply_rope`), i.e. it
computes in GGUF's layout, so every GGUF tensor is copied as is. tests/test_gguf_fidelity.py
proves it: our logits on SmolLM2 equal transformers' logits on the same GGUF.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pipeline.errors import GGUFError, problem
from pipeline.gguf.reader import MAX_INT, GGUFFile
from pipeline.gguf.writer import FILE_TYPES, write_model_gguf
from pipeline.models.convert import TensorLayout, assign_from_gguf, check_shapes, check_tensor_set, export_tensors
from pipeline.models.llama import Llama
from pipeline.models.names import (
    ARCHITECTURES,
    LLAMA_BLOCK_TENSORS,
    LLAMA_INPUT_TENSORS,
    LLAMA_OUTPUT_TENSORS,
    OUTPUT,
    ROPE_FREQS,
    TOKEN_EMBD,
)
from pipeline.models.transformer import TransformerConfig

LAYOUT = TensorLayout(LLAMA_INPUT_TENSORS, LLAMA_BLOCK_TENSORS, LLAMA_OUTPUT_TENSORS)


def gguf_tensors(model: Llama) -> dict[str, np.ndarray]:
    """Every tensor under its GGUF name, fp32, with a lens folded into the embedding table."""
    out = export_tensors(model, LAYOUT.names(model.cfg.n_layer, model.head is None))
    if model.cfg.rope_freq_factors:
        out[ROPE_FREQS] = np.asarray(model.cfg.rope_freq_factors, dtype=np.float32)
    return out


def llama_metadata(cfg: TransformerConfig, dtype: str) -> dict[str, Any]:
    """The `llama.*` keys llama.cpp and transformers need to rebuild the model."""
    return {
        "llama.context_length": cfg.context_length,
        "llama.embedding_length": cfg.d_model,
        "llama.feed_forward_length": cfg.d_ff,
        "llama.block_count": cfg.n_layer,
        "llama.attention.head_count": cfg.n_head,
        "llama.attention.head_count_kv": cfg.n_kv_head,
        "llama.rope.dimension_count": cfg.head_dim,
        "llama.rope.freq_base": float(cfg.rope_theta),
        "llama.attention.layer_norm_rms_epsilon": float(cfg.norm_eps),
        "llama.vocab_size": cfg.vocab_size,
        "general.file_type": FILE_TYPES[dtype],
        "general.quantization_version": 2,  # GGML_QUANT_VERSION, written by llama.cpp's converter too
    }


def export_llama(
    model: Llama, path: Path, tokenizer_meta: dict[str, Any], provenance: dict[str, Any], dtype: str = "f32"
) -> Path:
    """Write `model` as a llama GGUF with the donor's tokenizer and our provenance keys."""
    return write_model_gguf(
        path, "llama", llama_metadata(model.cfg, dtype), gguf_tensors(model), tokenizer_meta, provenance, dtype
    )


def _unsupported(g: GGUFFile, what: str, found: Any, fix: str) -> GGUFError:
    return GGUFError(problem(str(g.path), what, str(found), fix))


def _int_key(g: GGUFFile, suffix: str, default: int | None = None, low: int = 1, high: int = MAX_INT) -> int:
    """A scalar integer `llama.*` key in [low, high] (required unless a default is given); per-layer
    arrays, strings and out-of-range values are named errors."""
    return g.int_key(f"llama.{suffix}", default, low, high)


def config_from_gguf(g: GGUFFile) -> TransformerConfig:
    """Rebuild our config from `llama.*` keys, refusing what our module cannot compute exactly.

    Every key is type- and range-checked, and every tensor's shape is checked against what the keys
    imply before a module is built, so a forged key never reaches a torch allocation.
    """
    if g.architecture != "llama":
        raise GGUFError(
            problem(
                f"{g.path} general.architecture",
                f"llama for this loader (supported architectures: {', '.join(ARCHITECTURES)})",
                repr(g.architecture),
                "use a GGUF of a supported architecture, loaded through pipeline.models.registry.load_gguf",
            )
        )
    d_model = _int_key(g, "embedding_length")
    n_head, n_kv_head = _heads(g, d_model)
    n_layer = _int_key(g, "block_count", low=0, high=len(g.tensor_names()))  # each block has its own tensors
    head_dim = d_model // n_head
    _check_features(g, head_dim)
    vocab = _check_embedding(g, d_model)
    _check_tensor_names(g, n_layer)
    cfg = TransformerConfig(
        vocab_size=vocab,
        d_model=d_model,
        n_layer=n_layer,
        n_head=n_head,
        n_kv_head=n_kv_head,
        d_ff=_int_key(g, "feed_forward_length"),
        context_length=_int_key(g, "context_length"),
        rope_theta=g.float_key("llama.rope.freq_base", 10000.0),
        norm_eps=g.float_key("llama.attention.layer_norm_rms_epsilon"),
        tie_embeddings=not g.has_tensor("output.weight"),
    )
    check_shapes(g, llama_shapes(cfg), "llama.*")
    return replace(cfg, rope_freq_factors=_rope_freq_factors(g, head_dim))


def _heads(g: GGUFFile, d_model: int) -> tuple[int, int]:
    """Query and key/value head counts: heads split d_model into even-sized heads (RoPE rotates pairs),
    and the query heads into whole groups per key/value head."""
    n_head = _int_key(g, "attention.head_count", high=d_model)
    if d_model % n_head or (d_model // n_head) % 2:
        raise _unsupported(
            g, f"llama.attention.head_count dividing {d_model} into heads of even size", n_head, _INCONSISTENT
        )
    n_kv = _int_key(g, "attention.head_count_kv", n_head, high=n_head)
    if n_head % n_kv:
        raise _unsupported(g, f"llama.attention.head_count_kv dividing head_count {n_head}", n_kv, _INCONSISTENT)
    return n_head, n_kv


_INCONSISTENT = "the file is inconsistent; re-export it"


def llama_shapes(cfg: TransformerConfig) -> dict[str, tuple[int, ...]]:
    """The numpy-order shape of every GGUF tensor a llama of `cfg` has: what the header keys promise."""
    d, ff, vocab = cfg.d_model, cfg.d_ff, cfg.vocab_size
    q, kv = cfg.n_head * cfg.head_dim, cfg.n_kv_head * cfg.head_dim
    block = {"attn_norm": (d,), "attn_q": (q, d), "attn_k": (kv, d), "attn_v": (kv, d), "attn_output": (d, q)}
    block |= {"ffn_norm": (d,), "ffn_gate": (ff, d), "ffn_up": (ff, d), "ffn_down": (d, ff)}
    shapes = {TOKEN_EMBD: (vocab, d), "output_norm.weight": (d,), OUTPUT: (vocab, d)}
    for i in range(cfg.n_layer):
        shapes.update({f"blk.{i}.{name}.weight": shape for name, shape in block.items()})
    return shapes


def _check_features(g: GGUFFile, head_dim: int) -> None:
    """Keys that would change the computation in ways our module does not implement."""
    for suffix in ("rope.dimension_count", "attention.key_length", "attention.value_length"):
        value = _int_key(g, suffix, head_dim, low=0)
        if value != head_dim:
            what = "partial RoPE" if suffix.startswith("rope") else "heads of their own size (e.g. Mistral NeMo's)"
            raise _unsupported(
                g,
                f"llama.{suffix} = embedding_length / head_count = {head_dim}",
                value,
                f"{what} is not supported; use a llama GGUF whose heads tile its width",
            )
    scaling = g.str_key("llama.rope.scaling.type", "none")
    factor = g.float_key("llama.rope.scaling.factor", 1.0)
    if scaling not in ("none", "") and factor != 1.0:
        raise _unsupported(g, "no RoPE scaling", f"llama.rope.scaling.type={scaling} factor={factor}", "not supported")
    experts = _int_key(g, "expert_count", 0, low=0)
    if experts:
        raise _unsupported(g, "a dense model", f"llama.expert_count={experts}", "mixture-of-experts is not supported")


def _check_embedding(g: GGUFFile, d_model: int) -> int:
    """The vocab size: embedding rows, which the vocab key and the tokenizer must agree with."""
    shape = g.tensor_info(TOKEN_EMBD).shape
    if len(shape) != 2 or shape[0] < 1 or shape[1] != d_model:
        raise GGUFError(
            problem(
                f"{g.path} {TOKEN_EMBD}",
                f"a (vocab, llama.embedding_length={d_model}) table with at least one row",
                f"shape {shape}",
                _INCONSISTENT,
            )
        )
    rows = shape[0]
    counts = {"llama.vocab_size": g.int_key("llama.vocab_size", rows)}
    tokens = g.metadata.get("tokenizer.ggml.tokens")
    if tokens is not None:
        if not isinstance(tokens, list):
            raise GGUFError(
                problem(f"{g.path} tokenizer.ggml.tokens", "a list of token strings", repr(tokens)[:60], _INCONSISTENT)
            )
        counts["len(tokenizer.ggml.tokens)"] = len(tokens)
    for key, n in counts.items():
        if n != rows:
            raise GGUFError(
                problem(
                    f"{g.path} {key}",
                    f"{rows} (the rows of token_embd.weight)",
                    str(n),
                    "the vocab and the embedding table disagree; re-export the file",
                )
            )
    return rows


def _check_tensor_names(g: GGUFFile, n_layer: int) -> None:
    """Exactly the tensors our module has (plus an untied head and rope_freqs): nothing missing, nothing ignored."""
    check_tensor_set(
        g,
        LAYOUT.required(n_layer),
        {OUTPUT, ROPE_FREQS},
        f"the llama tensors for {n_layer} blocks",
        "this llama variant (biases, extra layers) is not supported",
    )


def _rope_freq_factors(g: GGUFFile, head_dim: int) -> tuple[float, ...]:
    """The RoPE frequency factors (`rope_freqs.weight`), () when absent or all ones."""
    if not g.has_tensor(ROPE_FREQS):
        return ()
    if g.tensor_info(ROPE_FREQS).shape != (head_dim // 2,):
        raise GGUFError(
            problem(
                f"{g.path} {ROPE_FREQS}",
                f"shape ({head_dim // 2},)",
                f"{g.tensor_info(ROPE_FREQS).shape}",
                _INCONSISTENT,
            )
        )
    factors = g.tensor(ROPE_FREQS)
    if factors.shape != (head_dim // 2,) or not np.all(np.isfinite(factors)) or np.any(factors <= 0):
        raise GGUFError(
            problem(
                f"{g.path} {ROPE_FREQS}",
                f"{head_dim // 2} positive RoPE frequency factors (one per rotated pair)",
                f"shape {factors.shape}, first values {factors.ravel()[:3].tolist()}",
                "the file is inconsistent; re-export it",
            )
        )
    return () if np.all(factors == 1.0) else tuple(float(f) for f in factors)


def load_llama(source: Path | GGUFFile) -> tuple[Llama, GGUFFile]:
    """A whole llama GGUF as our fp32 module (dequantizing every tensor), plus the open file.

    The module is built on the meta device and takes the file's tensors as its parameters, so no
    throw-away random init is computed.
    """
    g = source if isinstance(source, GGUFFile) else GGUFFile(source)
    cfg = config_from_gguf(g)
    with torch.device("meta"):
        model = Llama(cfg)
    assign_from_gguf(model, g, LAYOUT.names(cfg.n_layer, cfg.tie_embeddings))
    return model, g
