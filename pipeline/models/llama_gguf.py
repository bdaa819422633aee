"""Our llama module <-> GGUF llama tensors and keys, in both directions.

Names, shapes, sizes and the features a file asks for are checked on the way in, so a GGUF that
does not fit gives a named error instead of a silent mis-load.

No Q/K permutation, in either direction. llama.cpp's converter permutes the rows of
attn_q/attn_k from the Hugging Face layout (RoPE on the two halves of each head) into the
original Meta layout (RoPE on adjacent pairs), and transformers un-permutes them when it reads a
GGUF. Our attention applies RoPE to adjacent pairs (`pipeline.models.llama.apply_rope`), i.e. it
computes in GGUF's layout, so every GGUF tensor is copied as is. tests/test_gguf_fidelity.py
proves it: our logits on SmolLM2 equal transformers' logits on the same GGUF.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from pipeline.errors import GGUFError, problem
from pipeline.gguf.reader import GGUFFile
from pipeline.gguf.writer import FILE_TYPES, write_model_gguf
from pipeline.models.base import TransformerConfig
from pipeline.models.convert import TensorLayout, assign_from_gguf, check_tensor_set, export_tensors
from pipeline.models.llama import Llama
from pipeline.models.names import (
    ARCHITECTURES,
    LLAMA_BLOCK_TENSORS,
    LLAMA_INPUT_TENSORS,
    LLAMA_OUTPUT_TENSORS,
    OUTPUT,
    ROPE_FREQS,
)

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


def _int_key(g: GGUFFile, suffix: str, default: int | None = None) -> int:
    """A scalar integer `llama.*` key (required unless a default is given); per-layer arrays are refused."""
    key = f"llama.{suffix}"
    value = g.require(key) if default is None else g.metadata.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int):
        raise _unsupported(g, f"{key} as one integer", repr(value), "per-layer values are not supported")
    return value


def config_from_gguf(g: GGUFFile) -> TransformerConfig:
    """Rebuild our config from `llama.*` keys, refusing what our module cannot compute exactly."""
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
    n_head = _int_key(g, "attention.head_count")
    n_layer = _int_key(g, "block_count")
    if n_head <= 0 or d_model % n_head:
        raise _unsupported(g, f"llama.attention.head_count dividing {d_model}", n_head, "the file is inconsistent")
    head_dim = d_model // n_head
    _check_features(g, head_dim)
    vocab = _check_embedding(g, d_model)
    _check_tensor_names(g, n_layer)
    factors = _rope_freq_factors(g, head_dim)
    return TransformerConfig(
        vocab_size=vocab,
        d_model=d_model,
        n_layer=n_layer,
        n_head=n_head,
        n_kv_head=_int_key(g, "attention.head_count_kv", n_head),
        d_ff=_int_key(g, "feed_forward_length"),
        context_length=_int_key(g, "context_length"),
        rope_theta=float(g.metadata.get("llama.rope.freq_base", 10000.0)),
        norm_eps=float(g.arch_key("attention.layer_norm_rms_epsilon")),
        tie_embeddings=not g.has_tensor("output.weight"),
        rope_freq_factors=factors,
    )


def _check_features(g: GGUFFile, head_dim: int) -> None:
    """Keys that would change the computation in ways our module does not implement."""
    for suffix in ("rope.dimension_count", "attention.key_length", "attention.value_length"):
        value = _int_key(g, suffix, head_dim)
        if value != head_dim:
            raise _unsupported(
                g, f"llama.{suffix} = head size {head_dim}", value, "partial RoPE / MLA is not supported"
            )
    scaling = str(g.metadata.get("llama.rope.scaling.type", "none"))
    factor = float(g.metadata.get("llama.rope.scaling.factor", 1.0))
    if scaling not in ("none", "") and factor != 1.0:
        raise _unsupported(g, "no RoPE scaling", f"llama.rope.scaling.type={scaling} factor={factor}", "not supported")
    experts = _int_key(g, "expert_count", 0)
    if experts:
        raise _unsupported(g, "a dense model", f"llama.expert_count={experts}", "mixture-of-experts is not supported")


def _check_embedding(g: GGUFFile, d_model: int) -> int:
    """The vocab size: embedding rows, which the vocab key and the tokenizer must agree with."""
    rows, width = g.tensor_info("token_embd.weight").shape
    if width != d_model:
        raise GGUFError(
            problem(
                f"{g.path} token_embd.weight",
                f"width llama.embedding_length={d_model}",
                f"width {width}",
                "the file is inconsistent; re-export it",
            )
        )
    counts = {"llama.vocab_size": g.metadata.get("llama.vocab_size")}
    if "tokenizer.ggml.tokens" in g.metadata:
        counts["len(tokenizer.ggml.tokens)"] = len(g.metadata["tokenizer.ggml.tokens"])
    for key, n in counts.items():
        if n is not None and n != rows:
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
