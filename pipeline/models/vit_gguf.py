"""Our ViT <-> a GGUF of its own architecture (`general.architecture = vit`), in both directions.

Every hyper-parameter is a `vit.*` key (image size, patch size, channels, width, blocks, heads, MLP
width, classes, LayerNorm epsilon, dropout), with the class names and the pixel normalization the
model expects (pixels scaled to [0, 1], minus `vit.image_mean`, over `vit.image_std`, per channel).
No llama.cpp program runs this architecture; our reader loads it back (`load_vit`), every key typed
and ranged and every tensor shape checked against the keys before a module is built.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from pipeline.errors import ConfigError, GGUFError, problem
from pipeline.gguf.reader import GGUFFile
from pipeline.gguf.writer import FILE_TYPES, write_model_gguf
from pipeline.models.convert import TensorLayout, assign_from_gguf, check_shapes, check_tensor_set, export_tensors
from pipeline.models.names import GPT2_BLOCK_TENSORS, VIT_INPUT_TENSORS, VIT_OUTPUT_TENSORS
from pipeline.models.vit import ViT, ViTConfig

LAYOUT = TensorLayout(VIT_INPUT_TENSORS, GPT2_BLOCK_TENSORS, VIT_OUTPUT_TENSORS)
DTYPES = ("f32", "f16", "bf16")  # a ViT this small gains nothing from block quantization
_FIX = "re-export the model (dvc repro -f export)"


def vit_metadata(cfg: ViTConfig, dtype: str) -> dict[str, Any]:
    """The `vit.*` keys that rebuild the model, and how its input pixels are normalized."""
    meta: dict[str, Any] = {
        "vit.image_size": cfg.image_size,
        "vit.patch_size": cfg.patch_size,
        "vit.num_channels": cfg.channels,
        "vit.embedding_length": cfg.d_model,
        "vit.block_count": cfg.n_layer,
        "vit.attention.head_count": cfg.n_head,
        "vit.feed_forward_length": cfg.d_ff,
        "vit.class_count": cfg.n_classes,
        "vit.attention.layer_norm_epsilon": float(cfg.norm_eps),
        "vit.dropout": float(cfg.dropout),
        "general.file_type": FILE_TYPES[dtype],
    }
    if cfg.class_names:
        meta["vit.class_names"] = list(cfg.class_names)
    if cfg.pixel_mean:
        meta["vit.image_mean"] = [float(x) for x in cfg.pixel_mean]
        meta["vit.image_std"] = [float(x) for x in cfg.pixel_std]
    return meta


def export_vit(
    model: ViT, path: Path, tokenizer_meta: dict[str, Any], provenance: dict[str, Any], dtype: str = "f32"
) -> Path:
    """Write `model` as a vit GGUF (atomically) with the caller's provenance keys; it has no tokenizer."""
    if dtype not in DTYPES:
        raise GGUFError(problem("config key export.dtype", f"one of {', '.join(DTYPES)} for vit", dtype, "use f32"))
    tensors = export_tensors(model, LAYOUT.names(model.cfg.n_layer, tied=True))
    return write_model_gguf(path, "vit", vit_metadata(model.cfg, dtype), tensors, tokenizer_meta, provenance, dtype)


def f32(x: float) -> float:
    """The float32 a file holds, as the shortest decimal that gives it (1e-05, not 9.99999974e-06)."""
    return float(str(np.float32(x)))


def vit_config_from_gguf(g: GGUFFile) -> ViTConfig:
    """Our config from the `vit.*` keys, each typed and ranged; names and normalization if present."""
    d_model = g.int_key("vit.embedding_length", high=1 << 16)
    classes = g.int_key("vit.class_count", high=1 << 20)
    names = g.metadata.get("vit.class_names", [])
    mean, std = g.metadata.get("vit.image_mean", []), g.metadata.get("vit.image_std", [])
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise GGUFError(problem(f"{g.path} vit.class_names", "an array of strings", repr(names)[:60], _FIX))
    if not all(isinstance(x, list) and all(isinstance(v, float) for v in x) for x in (mean, std)):
        raise GGUFError(problem(f"{g.path} vit.image_mean/std", "arrays of floats", repr((mean, std))[:60], _FIX))
    cfg = ViTConfig(
        image_size=g.int_key("vit.image_size", high=1 << 14),
        patch_size=g.int_key("vit.patch_size", high=1 << 14),
        channels=g.int_key("vit.num_channels", high=64),
        d_model=d_model,
        n_layer=g.int_key("vit.block_count", low=0, high=len(g.tensor_names())),
        n_head=g.int_key("vit.attention.head_count", high=d_model),
        d_ff=g.int_key("vit.feed_forward_length", high=1 << 20),
        n_classes=classes,
        norm_eps=f32(g.float_key("vit.attention.layer_norm_epsilon")),
        dropout=g.float_key("vit.dropout", 0.0, positive=False),
        class_names=tuple(names),
        pixel_mean=tuple(f32(x) for x in mean),
        pixel_std=tuple(f32(x) for x in std),
    )
    try:
        return cfg.check(f"{g.path} vit.*", _FIX)
    except ConfigError as e:  # the config's own error, as a file error
        raise GGUFError(str(e)) from None


def expected_shapes(cfg: ViTConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor's numpy-order shape, from the keys."""
    d, f = cfg.d_model, cfg.d_ff
    shapes = {
        "patch_embd.weight": (d, cfg.patch_dim),
        "patch_embd.bias": (d,),
        "cls_token": (1, 1, d),
        "position_embd": (1, cfg.n_patches + 1, d),
        "output_norm.weight": (d,),
        "output_norm.bias": (d,),
        "output.weight": (cfg.n_classes, d),
        "output.bias": (cfg.n_classes,),
    }
    block = {"attn_norm": (d,), "attn_qkv": (3 * d, d), "attn_output": (d, d), "ffn_norm": (d,)}
    block |= {"ffn_up": (f, d), "ffn_down": (d, f)}
    for i in range(cfg.n_layer):
        for name, shape in block.items():
            shapes[f"blk.{i}.{name}.weight"] = shape
            shapes[f"blk.{i}.{name}.bias"] = (shape[0],)
    return shapes


def load_vit(g: GGUFFile) -> ViT:
    """A vit GGUF as our fp32 module, in eval mode."""
    cfg = vit_config_from_gguf(g)
    names = LAYOUT.names(cfg.n_layer, tied=True)
    check_tensor_set(g, set(names.values()), set(), "the tensors of a vit model", _FIX)
    check_shapes(g, expected_shapes(cfg), "vit.*")
    with torch.device("meta"):
        model = ViT(cfg)
    assign_from_gguf(model, g, names)
    return model.eval()
