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
from pipeline.model import Llama, TransformerConfig

SUPPORTED = ("llama",)


def _check(arch: str, where: str, error: type[Exception]) -> None:
    if arch not in SUPPORTED:
        raise error(
            problem(where, f"an architecture among {', '.join(SUPPORTED)}", repr(arch), "use a supported architecture")
        )


def build_model(cfg: TransformerConfig) -> nn.Module:
    """A freshly constructed (uninitialised) module for `cfg.arch`."""
    _check(cfg.arch, "model config arch", ConfigError)
    return Llama(cfg)


def export_gguf(
    model: nn.Module, path: Path, tokenizer_meta: dict[str, Any], provenance: dict[str, Any], dtype: str = "f32"
) -> Path:
    """Write `model` as a GGUF in its architecture's llama.cpp layout."""
    from pipeline.convert import export_llama

    _check(model.cfg.arch, "model config arch", ConfigError)
    return export_llama(model, path, tokenizer_meta, provenance, dtype)


def load_gguf(path: Path) -> tuple[nn.Module, GGUFFile]:
    """A whole GGUF model as our fp32 module, by its `general.architecture`."""
    from pipeline.convert import load_llama

    g = GGUFFile(path)
    _check(g.architecture, f"{path} general.architecture", GGUFError)
    return load_llama(g)
