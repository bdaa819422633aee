"""Our GPT-2 module <-> GGUF gpt2 tensors and keys, in both directions (names, shapes checked)."""

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
from pipeline.models.gpt2 import GPT2
from pipeline.models.names import GPT2_BLOCK_TENSORS, GPT2_INPUT_TENSORS, GPT2_OUTPUT_TENSORS, OUTPUT, TOKEN_EMBD

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
    rows = g.tensor_info(TOKEN_EMBD).shape[0]
    for name, want in ((TOKEN_EMBD, (rows, d_model)), ("position_embd.weight", (context, d_model))):
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
