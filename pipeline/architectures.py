"""Which module class and which GGUF layout go with each architecture name.

Everything that builds, exports or loads a model goes through here, so adding an architecture
means adding one entry, not touching every stage.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torch import nn

from pipeline.errors import ConfigError, GGUFError, problem
from pipeline.gguf_io import GGUFFile
from pipeline.gpt2 import GPT2, export_gpt2, init_gpt2, load_gpt2
from pipeline.model import Llama, TransformerConfig, init_weights

SUPPORTED = ("llama", "gpt2")


def _check(arch: str, where: str, error: type[Exception]) -> None:
    if arch not in SUPPORTED:
        raise error(
            problem(where, f"an architecture among {', '.join(SUPPORTED)}", repr(arch), "use a supported architecture")
        )


def build_model(cfg: TransformerConfig) -> nn.Module:
    """A freshly constructed (uninitialised) module for `cfg.arch`."""
    _check(cfg.arch, "model config arch", ConfigError)
    return GPT2(cfg) if cfg.arch == "gpt2" else Llama(cfg)


def init_model(model: nn.Module, std: float, seed: int) -> None:
    """Seeded random init in place, by `model.cfg.arch` (gpt2 zeroes its biases and LayerNorm shifts)."""
    if model.cfg.arch == "gpt2":
        init_gpt2(model, std, seed)
    else:
        init_weights(model, std, seed)


def export_gguf(
    model: nn.Module, path: Path, tokenizer_meta: dict[str, Any], provenance: dict[str, Any], dtype: str = "f32"
) -> Path:
    """Write `model` as a GGUF in its architecture's llama.cpp layout."""
    from pipeline.convert import export_llama

    _check(model.cfg.arch, "model config arch", ConfigError)
    if model.cfg.arch == "gpt2":
        return export_gpt2(model, path, tokenizer_meta, provenance, dtype)
    return export_llama(model, path, tokenizer_meta, provenance, dtype)


def load_gguf(path: Path) -> tuple[nn.Module, GGUFFile]:
    """A whole GGUF model as our fp32 module, by its `general.architecture`."""
    from pipeline.convert import load_llama

    g = GGUFFile(path)
    _check(g.architecture, f"{path} general.architecture", GGUFError)
    if g.architecture == "gpt2":
        return load_gpt2(g), g
    return load_llama(g)
