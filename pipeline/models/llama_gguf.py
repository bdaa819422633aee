"""Our llama-family module <-> GGUF tensors and keys of llama, qwen2, qwen3 and gemma3, both ways.

Names, shapes, sizes and the features a file asks for are checked on the way in, so a GGUF that
does not fit gives a named error instead of a silent mis-load.

No Q/K permutation, in either direction. llama.cpp's converter permutes llama's attn_q/attn_k rows
from the Hugging Face layout (RoPE on the two halves of each head) into the original Meta layout
(RoPE on adjacent pairs), and leaves Qwen's and Gemma's as they are (llama.cpp's NEOX RoPE); our
attention rotates whichever layout the family's file holds (`Family.rope_halves`), so every GGUF
tensor is copied as is. tests/test_gguf_fidelity.py and tests/test_families.py prove it: our logits
equal transformers' own classes' on the same weights.
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
    LLAMA_FAMILY,
    LLAMA_INPUT_TENSORS,
    LLAMA_OUTPUT_TENSORS,
    OUTPUT,
    ROPE_FREQS,
    TOKEN_EMBD,
    block_tensors,
)
from pipeline.models.transformer import TransformerConfig

LAYOUTS = {arch: TensorLayout(LLAMA_INPUT_TENSORS, block_tensors(arch), LLAMA_OUTPUT_TENSORS) for arch in LLAMA_FAMILY}
LAYOUT = LAYOUTS["llama"]
SWA_PATTERN = 6  # llama.cpp's gemma3: every 6th layer global when the file names no pattern


def gguf_tensors(model: Llama) -> dict[str, np.ndarray]:
    """Every tensor under its GGUF name, fp32, with a lens folded into the embedding table."""
    out = export_tensors(model, LAYOUTS[model.cfg.arch].names(model.cfg.n_layer, model.head is None))
    if model.cfg.rope_freq_factors:
        out[ROPE_FREQS] = np.asarray(model.cfg.rope_freq_factors, dtype=np.float32)
    return out


def llama_metadata(cfg: TransformerConfig, dtype: str) -> dict[str, Any]:
    """The `<arch>.*` keys llama.cpp and transformers need to rebuild the model."""
    a = cfg.arch
    keys: dict[str, Any] = {
        f"{a}.context_length": cfg.context_length,
        f"{a}.embedding_length": cfg.d_model,
        f"{a}.feed_forward_length": cfg.d_ff,
        f"{a}.block_count": cfg.n_layer,
        f"{a}.attention.head_count": cfg.n_head,
        f"{a}.attention.head_count_kv": cfg.n_kv_head,
        f"{a}.rope.dimension_count": cfg.head_dim,
        f"{a}.rope.freq_base": float(cfg.rope_theta),
        f"{a}.attention.layer_norm_rms_epsilon": float(cfg.norm_eps),
        f"{a}.vocab_size": cfg.vocab_size,
    }
    if a != "llama" or cfg.head_dim * cfg.n_head != cfg.d_model:
        keys |= {f"{a}.attention.key_length": cfg.head_dim, f"{a}.attention.value_length": cfg.head_dim}
    if cfg.rope_scale != 1.0:
        keys |= {f"{a}.rope.scaling.type": "linear", f"{a}.rope.scaling.factor": float(cfg.rope_scale)}
    if cfg.family.sliding and cfg.sliding_window:
        keys[f"{a}.attention.sliding_window"] = cfg.sliding_window
        keys[f"{a}.attention.sliding_window_pattern"] = [bool(x) for x in cfg.sliding_layers]
        keys[f"{a}.rope.freq_base_swa"] = float(cfg.rope_theta_local)
    keys["general.file_type"] = FILE_TYPES[dtype]
    keys["general.quantization_version"] = 2  # GGML_QUANT_VERSION, written by llama.cpp's converter too
    return keys


def export_llama(
    model: Llama, path: Path, tokenizer_meta: dict[str, Any], provenance: dict[str, Any], dtype: str = "f32"
) -> Path:
    """Write `model` as a GGUF of its architecture with the donor's tokenizer and our provenance keys."""
    arch = model.cfg.arch
    return write_model_gguf(
        path, arch, llama_metadata(model.cfg, dtype), gguf_tensors(model), tokenizer_meta, provenance, dtype
    )


def _unsupported(g: GGUFFile, what: str, found: Any, fix: str) -> GGUFError:
    return GGUFError(problem(str(g.path), what, str(found), fix))


def _int_key(g: GGUFFile, suffix: str, default: int | None = None, low: int = 1, high: int = MAX_INT) -> int:
    """A scalar integer `<arch>.*` key in [low, high] (required unless a default is given); per-layer
    arrays, strings and out-of-range values are named errors."""
    return g.int_key(f"{g.architecture}.{suffix}", default, low, high)


def config_from_gguf(g: GGUFFile) -> TransformerConfig:
    """Rebuild our config from the `<arch>.*` keys, refusing what our module cannot compute exactly.

    Every key is type- and range-checked, and every tensor's shape is checked against what the keys
    imply before a module is built, so a forged key never reaches a torch allocation.
    """
    arch = g.architecture
    if arch not in LLAMA_FAMILY:
        raise GGUFError(
            problem(
                f"{g.path} general.architecture",
                f"one of {', '.join(LLAMA_FAMILY)} for this loader (supported: {', '.join(ARCHITECTURES)})",
                repr(arch),
                "use a GGUF of a supported architecture, loaded through pipeline.models.registry.load_gguf",
            )
        )
    d_model = _int_key(g, "embedding_length")
    n_head, n_kv_head, head_dim = _heads(g, d_model)
    n_layer = _int_key(g, "block_count", low=0, high=len(g.tensor_names()))  # each block has its own tensors
    _check_features(g, head_dim, n_layer)
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
        rope_theta=g.float_key(f"{arch}.rope.freq_base", 10000.0),
        norm_eps=g.float_key(f"{arch}.attention.layer_norm_rms_epsilon"),
        tie_embeddings=not g.has_tensor("output.weight"),
        arch=arch,
        key_length=head_dim if head_dim * n_head != d_model else 0,
        rope_scale=_rope_scale(g),
        **_sliding(g, n_layer),
    )
    check_shapes(g, llama_shapes(cfg), f"{arch}.*")
    return replace(cfg, rope_freq_factors=_rope_freq_factors(g, head_dim))


def _heads(g: GGUFFile, d_model: int) -> tuple[int, int, int]:
    """Query and key/value head counts and the head width (`attention.key_length`, by default d_model
    split evenly): heads of even width (RoPE rotates pairs), the query heads in whole groups per kv head."""
    n_head = _int_key(g, "attention.head_count", high=d_model)
    arch = g.architecture
    explicit = f"{arch}.attention.key_length" in g.metadata
    if not explicit and d_model % n_head:
        raise _unsupported(g, f"{arch}.attention.head_count dividing {d_model} into heads", n_head, _INCONSISTENT)
    head_dim = _int_key(g, "attention.key_length", d_model // n_head, high=65536)
    if head_dim % 2:
        raise _unsupported(g, f"{arch}.attention.key_length even (RoPE rotates pairs)", head_dim, _INCONSISTENT)
    n_kv = _int_key(g, "attention.head_count_kv", n_head, high=n_head)
    if n_head % n_kv:
        raise _unsupported(g, f"{arch}.attention.head_count_kv dividing head_count {n_head}", n_kv, _INCONSISTENT)
    return n_head, n_kv, head_dim


_INCONSISTENT = "the file is inconsistent; re-export it"


def llama_shapes(cfg: TransformerConfig) -> dict[str, tuple[int, ...]]:
    """The numpy-order shape of every GGUF tensor a model of `cfg` has: what the header keys promise."""
    d, ff, vocab, hd = cfg.d_model, cfg.d_ff, cfg.vocab_size, cfg.head_dim
    q, kv = cfg.n_head * hd, cfg.n_kv_head * hd
    block = {"attn_norm": (d,), "attn_q": (q, d), "attn_k": (kv, d), "attn_v": (kv, d), "attn_output": (d, q)}
    block |= {"ffn_norm": (d,), "ffn_gate": (ff, d), "ffn_up": (ff, d), "ffn_down": (d, ff)}
    block |= {"attn_q_norm": (hd,), "attn_k_norm": (hd,), "post_attention_norm": (d,), "post_ffw_norm": (d,)}
    biases = {"attn_q.bias": (q,), "attn_k.bias": (kv,), "attn_v.bias": (kv,)}
    shapes = {TOKEN_EMBD: (vocab, d), "output_norm.weight": (d,), OUTPUT: (vocab, d)}
    for i in range(cfg.n_layer):
        shapes.update({f"blk.{i}.{name}.weight": shape for name, shape in block.items()})
        shapes.update({f"blk.{i}.{name}": shape for name, shape in biases.items()})
    return shapes


def _check_features(g: GGUFFile, head_dim: int, n_layer: int) -> None:
    """Keys that would change the computation in ways our module does not implement."""
    arch = g.architecture
    for suffix in ("rope.dimension_count", "attention.value_length"):
        value = _int_key(g, suffix, head_dim, low=0)
        if value != head_dim:
            what = "partial RoPE" if suffix.startswith("rope") else "values of another width than keys"
            raise _unsupported(g, f"{arch}.{suffix} = the head width {head_dim}", value, f"{what} is not supported")
    experts = _int_key(g, "expert_count", 0, low=0)
    if experts:
        raise _unsupported(g, "a dense model", f"{arch}.expert_count={experts}", "mixture-of-experts is not supported")
    for key in ("final_logit_softcapping", "attn_logit_softcapping"):
        cap = g.float_key(f"{arch}.{key}", 0.0, positive=False)
        if cap:
            raise _unsupported(g, f"no {arch}.{key}", cap, "logit soft-capping (Gemma 2) is not supported")
    if arch == "gemma3" and n_layer == 62:  # llama.cpp scales Gemma 3 27B's queries by its own rule
        raise _unsupported(g, "a Gemma 3 of up to 48 layers", "62 layers (27B)", "Gemma 3 27B is not supported")


def _rope_scale(g: GGUFFile) -> float:
    """The linear RoPE scaling factor (1: none); YaRN and the other schemes are refused by name."""
    arch = g.architecture
    scaling = g.str_key(f"{arch}.rope.scaling.type", "none")
    factor = g.float_key(f"{arch}.rope.scaling.factor", 1.0)
    if scaling in ("none", "") or factor == 1.0:
        return 1.0
    if scaling != "linear":
        found = f"{arch}.rope.scaling.type={scaling} factor={factor}"
        raise _unsupported(g, "no RoPE scaling or linear scaling", found, "this scaling is not supported")
    return factor


def _sliding(g: GGUFFile, n_layer: int) -> dict[str, Any]:
    """Gemma 3's sliding layers as llama.cpp reads them: the window, a per-layer pattern (an array of
    bools, or every `n`-th layer global, 6 by default), the local RoPE base (10000 by default)."""
    arch = g.architecture
    window = _int_key(g, "attention.sliding_window", 0, low=0)
    if arch != "gemma3" or not window:
        return {}
    key = f"{arch}.attention.sliding_window_pattern"
    pattern = g.metadata.get(key, SWA_PATTERN)
    if isinstance(pattern, list):
        if len(pattern) != n_layer or not all(isinstance(x, bool) for x in pattern):
            raise _unsupported(g, f"{key}: {n_layer} booleans", repr(pattern)[:60], _INCONSISTENT)
        layers = tuple(pattern)
    else:
        n = g.int_key(key, SWA_PATTERN, low=0)
        layers = tuple(n == 0 or i % n < n - 1 for i in range(n_layer))
    local = g.float_key(f"{arch}.rope.freq_base_swa", 10000.0)
    return {"sliding_window": window, "sliding_layers": layers, "rope_theta_local": local}


def _check_embedding(g: GGUFFile, d_model: int) -> int:
    """The vocab size: embedding rows, which the vocab key and the tokenizer must agree with."""
    shape = g.tensor_info(TOKEN_EMBD).shape
    if len(shape) != 2 or shape[0] < 1 or shape[1] != d_model:
        raise GGUFError(
            problem(
                f"{g.path} {TOKEN_EMBD}",
                f"a (vocab, {g.architecture}.embedding_length={d_model}) table with at least one row",
                f"shape {shape}",
                _INCONSISTENT,
            )
        )
    rows = shape[0]
    counts = {f"{g.architecture}.vocab_size": g.int_key(f"{g.architecture}.vocab_size", rows)}
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
    arch = g.architecture
    check_tensor_set(
        g,
        LAYOUTS[arch].required(n_layer),
        {OUTPUT, ROPE_FREQS} if arch == "llama" else {OUTPUT},
        f"the {arch} tensors for {n_layer} blocks",
        f"this {arch} variant (biases, extra layers) is not supported",
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
    """A whole llama-family GGUF as our fp32 module (dequantizing every tensor), plus the open file.

    The module is built on the meta device and takes the file's tensors as its parameters, so no
    throw-away random init is computed.
    """
    g = source if isinstance(source, GGUFFile) else GGUFFile(source)
    cfg = config_from_gguf(g)
    with torch.device("meta"):
        model = Llama(cfg)
    assign_from_gguf(model, g, LAYOUTS[cfg.arch].names(cfg.n_layer, cfg.tie_embeddings))
    return model, g
