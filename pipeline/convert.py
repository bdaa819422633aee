"""Our llama module <-> GGUF llama tensors and keys, in both directions.

The mapping is one table; names and shapes are checked on the way in so a GGUF that does not
fit gives a named error instead of a silent mis-load.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from pipeline.errors import GGUFError, problem
from pipeline.gguf_io import GGUFFile, write_gguf
from pipeline.model import Llama, TransformerConfig

# our parameter name (per block, after "blocks.{i}.") -> GGUF name (after "blk.{i}.")
BLOCK_TENSORS = {
    "attn_norm.weight": "attn_norm.weight",
    "attn.wq.weight": "attn_q.weight",
    "attn.wk.weight": "attn_k.weight",
    "attn.wv.weight": "attn_v.weight",
    "attn.wo.weight": "attn_output.weight",
    "ffn_norm.weight": "ffn_norm.weight",
    "ffn.gate.weight": "ffn_gate.weight",
    "ffn.up.weight": "ffn_up.weight",
    "ffn.down.weight": "ffn_down.weight",
}
FILE_TYPES = {"f32": 0, "f16": 1}


def gguf_tensors(model: Llama) -> dict[str, np.ndarray]:
    """Every tensor under its GGUF name, fp32, with a lens folded into the embedding table."""
    with torch.no_grad():
        out = {"token_embd.weight": model.embedding_table().float().cpu().numpy()}
        for i, block in enumerate(model.blocks):
            params = dict(block.named_parameters())
            for ours, theirs in BLOCK_TENSORS.items():
                out[f"blk.{i}.{theirs}"] = params[ours].float().cpu().numpy()
        out["output_norm.weight"] = model.norm.weight.float().cpu().numpy()
        if model.head is not None:
            out["output.weight"] = model.head.weight.float().cpu().numpy()
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
    }


def export_llama(
    model: Llama, path: Path, tokenizer_meta: dict[str, Any], provenance: dict[str, Any], dtype: str = "f32"
) -> Path:
    """Write `model` as a llama GGUF with the donor's tokenizer and our provenance keys."""
    if dtype not in FILE_TYPES:
        raise GGUFError(problem("export.dtype", f"one of {sorted(FILE_TYPES)}", repr(dtype), "pick a supported type"))
    metadata: dict[str, Any] = {"general.type": "model"}
    metadata.update(provenance)
    metadata.update(llama_metadata(model.cfg, dtype))
    metadata.update(tokenizer_meta)
    return write_gguf(path, "llama", metadata, gguf_tensors(model), dtype=dtype)


def config_from_gguf(g: GGUFFile) -> TransformerConfig:
    """Rebuild our config from `llama.*` keys, checking what we do not support."""
    if g.architecture != "llama":
        raise GGUFError(
            problem(str(g.path), "general.architecture = llama", repr(g.architecture), "use a llama-architecture GGUF")
        )
    d_model = int(g.arch_key("embedding_length"))
    n_head = int(g.arch_key("attention.head_count"))
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
    rope_dims = int(g.metadata.get("llama.rope.dimension_count", d_model // n_head))
    if rope_dims != d_model // n_head:
        raise GGUFError(
            problem(
                str(g.path),
                f"llama.rope.dimension_count = head size {d_model // n_head}",
                rope_dims,
                "partial RoPE is not supported",
            )
        )
    return TransformerConfig(
        vocab_size=rows,
        d_model=d_model,
        n_layer=int(g.arch_key("block_count")),
        n_head=n_head,
        n_kv_head=int(g.metadata.get("llama.attention.head_count_kv", n_head)),
        d_ff=int(g.arch_key("feed_forward_length")),
        context_length=int(g.arch_key("context_length")),
        rope_theta=float(g.metadata.get("llama.rope.freq_base", 10000.0)),
        norm_eps=float(g.arch_key("attention.layer_norm_rms_epsilon")),
        tie_embeddings=not g.has_tensor("output.weight"),
    )


def load_llama(source: Path | GGUFFile) -> tuple[Llama, GGUFFile]:
    """A whole llama GGUF as our fp32 module (dequantizing every tensor), plus the open file."""
    g = source if isinstance(source, GGUFFile) else GGUFFile(source)
    cfg = config_from_gguf(g)
    model = Llama(cfg)
    state = {}
    names = {"tok_embd.weight": "token_embd.weight", "norm.weight": "output_norm.weight"}
    if not cfg.tie_embeddings:
        names["head.weight"] = "output.weight"
    for i in range(cfg.n_layer):
        for ours, theirs in BLOCK_TENSORS.items():
            names[f"blocks.{i}.{ours}"] = f"blk.{i}.{theirs}"
    expected = dict(model.state_dict())
    for ours, theirs in names.items():
        arr = g.tensor(theirs)
        want = tuple(expected[ours].shape)
        if arr.shape != want:
            raise GGUFError(
                problem(f"{g.path} tensor {theirs}", f"shape {want}", f"shape {arr.shape}", "the file is inconsistent")
            )
        state[ours] = torch.from_numpy(arr)
    model.load_state_dict(state, strict=True)
    return model, g


def donor_tokenizer_metadata(donor: GGUFFile) -> dict[str, Any]:
    """Every `tokenizer.*` key of the donor with its exact GGUF type, to copy into an export."""
    return {k: donor.typed_field(k) for k in donor.metadata if k.startswith("tokenizer.")}


def run_export(
    train_dir: Path, donor_path: Path, out_path: Path, dtype: str, provenance: dict[str, Any]
) -> dict[str, float]:
    """The export stage: trained weights + donor tokenizer -> a llama.cpp-loadable GGUF."""
    from pipeline.architectures import export_gguf
    from pipeline.realize import load_model

    model = load_model(train_dir)
    tok_meta = donor_tokenizer_metadata(GGUFFile(donor_path))
    n_tokens = len(tok_meta["tokenizer.ggml.tokens"].value) if "tokenizer.ggml.tokens" in tok_meta else 0
    if n_tokens != model.cfg.vocab_size:
        raise GGUFError(
            problem(
                f"{donor_path} tokenizer.ggml.tokens",
                f"{model.cfg.vocab_size} tokens (the trained model's vocab)",
                str(n_tokens),
                "export with the donor the model was packed with",
            )
        )
    path = export_gguf(model, out_path, tok_meta, provenance, dtype)
    return {"file_bytes": float(path.stat().st_size), "tensors": float(len(gguf_tensors(model)))}
