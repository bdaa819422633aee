"""Our GPT-2 module <-> GGUF gpt2 tensors and keys, in both directions (names, shapes checked)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from pipeline.errors import GGUFError, problem
from pipeline.gguf.reader import GGUFFile
from pipeline.gguf.writer import FILE_TYPES, write_model_gguf
from pipeline.models.convert import TensorLayout, assign_from_gguf, check_shapes, check_tensor_set, export_tensors
from pipeline.models.gpt2 import GPT2
from pipeline.models.names import GPT2_BLOCK_TENSORS, GPT2_INPUT_TENSORS, GPT2_OUTPUT_TENSORS, OUTPUT, TOKEN_EMBD
from pipeline.models.transformer import TransformerConfig

LAYOUT = TensorLayout(GPT2_INPUT_TENSORS, GPT2_BLOCK_TENSORS, GPT2_OUTPUT_TENSORS)


def gpt2_tensors(model: GPT2) -> dict[str, np.ndarray]:
    """Every tensor under its GGUF name, fp32, lens folded in; `output.weight` only for an untied head."""
    return export_tensors(model, LAYOUT.names(model.cfg.n_layer, model.head is None))


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


def export_gpt2(
    model: GPT2, path: Path, tokenizer_meta: dict[str, Any], provenance: dict[str, Any], dtype: str = "f32"
) -> Path:
    """Write `model` as a gpt2 GGUF with the caller's tokenizer metadata and provenance keys."""
    return write_model_gguf(
        path, "gpt2", gpt2_metadata(model.cfg, dtype), gpt2_tensors(model), tokenizer_meta, provenance, dtype
    )


def gpt2_config_from_gguf(g: GGUFFile) -> TransformerConfig:
    """Our config from `gpt2.*` keys and tensor shapes; no `output.weight` means a tied head.

    Keys are type- and range-checked and every tensor's shape is checked against them before a
    module is built, so a forged key is a named error, never a torch allocation.
    """
    d_model = g.int_key("gpt2.embedding_length")
    n_head = g.int_key("gpt2.attention.head_count", high=d_model)
    n_layer = g.int_key("gpt2.block_count", low=0, high=len(g.tensor_names()))
    n_kv = g.int_key("gpt2.attention.head_count_kv", n_head)
    if d_model % n_head or n_kv != n_head:
        raise GGUFError(
            problem(
                f"{g.path} gpt2.attention.head_count(_kv)",
                f"one head count dividing {d_model}",
                f"{n_head} (kv {n_kv})",
                "the file is inconsistent or uses grouped-query attention, which gpt2 does not have",
            )
        )
    _check_tensor_names(g, n_layer)
    rows = g.tensor_info(TOKEN_EMBD).shape[0] if len(g.tensor_info(TOKEN_EMBD).shape) == 2 else 0
    eps = g.float_key("gpt2.attention.layer_norm_epsilon")
    cfg = TransformerConfig(
        vocab_size=rows,
        d_model=d_model,
        n_layer=n_layer,
        n_head=n_head,
        n_kv_head=n_head,
        d_ff=g.int_key("gpt2.feed_forward_length"),
        context_length=g.int_key("gpt2.context_length"),
        # the float32 the file holds, read back as the shortest decimal that gives it (1e-05, not 9.99999974e-06)
        norm_eps=float(str(np.float32(eps))),
        tie_embeddings=not g.has_tensor("output.weight"),
        arch="gpt2",
    )
    check_shapes(g, gpt2_shapes(cfg), "gpt2.*")
    if rows < 1:
        raise GGUFError(problem(f"{g.path} tensor {TOKEN_EMBD}", "at least one row", f"{rows}", "re-export it"))
    return cfg


def gpt2_shapes(cfg: TransformerConfig) -> dict[str, tuple[int, ...]]:
    """The numpy-order shape of every GGUF tensor a gpt2 of `cfg` has: what the header keys promise."""
    d, ff = cfg.d_model, cfg.d_ff
    block = {"attn_norm": ((d,), (d,)), "attn_qkv": ((3 * d, d), (3 * d,)), "attn_output": ((d, d), (d,))}
    block |= {"ffn_norm": ((d,), (d,)), "ffn_up": ((ff, d), (ff,)), "ffn_down": ((d, ff), (d,))}
    shapes = {TOKEN_EMBD: (cfg.vocab_size, d), "position_embd.weight": (cfg.context_length, d)}
    shapes |= {"output_norm.weight": (d,), "output_norm.bias": (d,), OUTPUT: (cfg.vocab_size, d)}
    for i in range(cfg.n_layer):
        for name, (weight, bias) in block.items():
            shapes |= {f"blk.{i}.{name}.weight": weight, f"blk.{i}.{name}.bias": bias}
    return shapes


def _check_tensor_names(g: GGUFFile, n_layer: int) -> None:
    """Exactly the tensors our module has (output.weight optional): nothing missing, nothing ignored."""
    check_tensor_set(
        g,
        LAYOUT.required(n_layer),
        {OUTPUT},
        f"the gpt2 tensors for {n_layer} blocks",
        "re-export the file; other gpt2 variants are not supported",
    )


def load_gpt2(g: GGUFFile) -> GPT2:
    """A whole gpt2 GGUF as our fp32 module (dequantizing every tensor), shapes checked by name.

    Built on the meta device and given the file's tensors as parameters: no throw-away init.
    """
    cfg = gpt2_config_from_gguf(g)
    with torch.device("meta"):
        model = GPT2(cfg)
    assign_from_gguf(model, g, LAYOUT.names(cfg.n_layer, cfg.tie_embeddings))
    return model
