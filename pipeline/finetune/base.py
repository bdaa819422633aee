"""A fine-tune's model: the pretrained GGUF loaded as its mode needs, with adapters attached.

Modes (`RecipeConfig.mode`): `lora` (base dequantized to fp32 and frozen, adapters train),
`qlora` (base matrices stay in their GGUF blocks, frozen, adapters train) and `full` (every base
parameter trains).
"""

from __future__ import annotations

import os

from torch import nn

from pipeline.config import FINETUNE_MODES, LoraConfig
from pipeline.errors import ConfigError, problem
from pipeline.finetune.lora import attach_lora, check_architecture, freeze
from pipeline.finetune.quant import load_quantized_base
from pipeline.gguf.reader import GGUFFile
from pipeline.models.llama_gguf import load_llama

RECIPE_NAMES = {"lora": "lora", "qlora": "qlora", "full": "full-finetune"}  # for messages: recipe=<name>


def load_base(path: str | os.PathLike[str], mode: str) -> tuple[nn.Module, GGUFFile]:
    """The base model of a fine-tune, from a GGUF, and the open GGUFFile.

    `lora`: fp32 dequantized and frozen; `qlora`: block matrices kept quantized (QuantLinear),
    frozen; `full`: fp32, every parameter trainable.
    """
    if mode not in FINETUNE_MODES:
        raise ConfigError(problem("fine-tune mode", f"one of {', '.join(FINETUNE_MODES)}", repr(mode), "pick one"))
    g = GGUFFile(path)
    check_architecture(g.architecture, f"{g.path} general.architecture", RECIPE_NAMES[mode])
    if mode == "qlora":
        return load_quantized_base(g), g
    model, g = load_llama(g)
    if mode == "lora":
        freeze(model)
    return model, g


def build_finetune(base: str | os.PathLike[str], mode: str, lora: LoraConfig | None) -> nn.Module:
    """The base GGUF as `mode` loads it, with fresh seeded adapters attached for lora/qlora."""
    model, _ = load_base(base, mode)
    if mode != "full":
        attach_lora(model, lora)
    return model
