"""A fine-tune's model: the pretrained GGUF loaded as its mode needs, with adapters attached.

Modes (`RecipeConfig.mode`): `lora` (base matrices frozen in their GGUF blocks and, for training,
also kept dequantized in the matmul dtype: fast steps, exact fp32 validation), `qlora` (base
matrices only in their GGUF blocks, rebuilt per matmul, plus the token table's copy: least memory) and `full` (the base
dequantized to fp32, every parameter trains). lora and qlora compute identical losses.
"""

from __future__ import annotations

import os

import torch
from torch import nn

from pipeline.config import FINETUNE_MODES, LoraConfig
from pipeline.errors import ConfigError, problem
from pipeline.finetune.lora import attach_lora, check_architecture
from pipeline.finetune.quant import QuantEmbedding, cache_weights, load_quantized_base
from pipeline.gguf.reader import GGUFFile
from pipeline.models.llama_gguf import load_llama

RECIPE_NAMES = {"lora": "lora", "qlora": "qlora", "full": "full-finetune"}  # for messages: recipe=<name>


def load_base(path: str | os.PathLike[str], mode: str) -> tuple[nn.Module, GGUFFile]:
    """The base model of a fine-tune, from a GGUF, and the open GGUFFile.

    `lora`, `qlora`: block matrices kept in their blocks (QuantLinear), everything frozen; `full`:
    fp32, every parameter trainable.
    """
    if mode not in FINETUNE_MODES:
        raise ConfigError(problem("fine-tune mode", f"one of {', '.join(FINETUNE_MODES)}", repr(mode), "pick one"))
    g = GGUFFile(path)
    check_architecture(g.architecture, f"{g.path} general.architecture", RECIPE_NAMES[mode])
    if mode != "full":
        return load_quantized_base(g), g
    return load_llama(g)


def build_finetune(base: str | os.PathLike[str], mode: str, lora: LoraConfig | None) -> nn.Module:
    """The base GGUF as `mode` loads it, with fresh seeded adapters attached for lora/qlora."""
    model, _ = load_base(base, mode)
    if mode != "full":
        attach_lora(model, lora)
    return model


def prepare_training(model: nn.Module, mode: str, dtype: torch.dtype) -> None:
    """recipe=lora trains with its frozen matrices dequantized once into the matmul dtype (bf16: half
    of fp32's bytes, and no step re-casts them); qlora rebuilds its block matrices per matmul but keeps
    the token table's copy too (the tied head: rebuilding all of it each step was 6% of a SmolLM2 step,
    for 57 MB); full trains fp32."""
    if mode == "lora":
        cache_weights(model, dtype)
    elif mode == "qlora":
        cache_weights(model, dtype, QuantEmbedding)
