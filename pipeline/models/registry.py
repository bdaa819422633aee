"""Which module class and which GGUF layout go with each architecture name.

Everything that builds, exports or loads a model goes through here, so adding an architecture
means adding one entry, not touching every stage.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.errors import ConfigError, GGUFError, problem
from pipeline.gguf.reader import GGUFFile
from pipeline.gguf.writer import check_export_dtype
from pipeline.models.gpt2 import GPT2
from pipeline.models.gpt2_gguf import export_gpt2, load_gpt2
from pipeline.models.llama import Llama
from pipeline.models.llama_gguf import export_llama, load_llama
from pipeline.models.names import ARCHITECTURES, LLAMA_FAMILY
from pipeline.models.transformer import DecoderLM, TransformerConfig
from pipeline.models.vit import ViT
from pipeline.models.vit_gguf import export_vit, load_vit

SUPPORTED = ARCHITECTURES


@dataclass(frozen=True)
class Architecture:
    module: type[DecoderLM]
    export: Callable[..., Path]
    load: Callable[[GGUFFile], DecoderLM]


REGISTRY: dict[str, Architecture] = {
    **{arch: Architecture(Llama, export_llama, lambda g: load_llama(g)[0]) for arch in LLAMA_FAMILY},
    "gpt2": Architecture(GPT2, export_gpt2, load_gpt2),
    "vit": Architecture(ViT, export_vit, load_vit),  # image classification: no tokenizer, no llama.cpp
}


def _entry(arch: str, where: str, error: type[Exception]) -> Architecture:
    if arch not in REGISTRY:
        raise error(
            problem(where, f"an architecture among {', '.join(SUPPORTED)}", repr(arch), "use a supported architecture")
        )
    return REGISTRY[arch]


def build_model(cfg: TransformerConfig) -> DecoderLM:
    """A freshly constructed (uninitialised) module for `cfg.arch`."""
    return _entry(cfg.arch, "model config arch", ConfigError).module(cfg)


def export_gguf(
    model: DecoderLM, path: Path, tokenizer_meta: dict[str, Any], provenance: dict[str, Any], dtype: str = "f32"
) -> Path:
    """Write `model` as a GGUF in its architecture's llama.cpp layout."""
    check_export_dtype(dtype)
    return _entry(model.cfg.arch, "model config arch", ConfigError).export(
        model, path, tokenizer_meta, provenance, dtype
    )


def load_gguf(path: Path) -> tuple[DecoderLM, GGUFFile]:
    """A whole GGUF model as our fp32 module, by its `general.architecture`."""
    g = GGUFFile(path)
    return _entry(g.architecture, f"{path} general.architecture", GGUFError).load(g), g


def gguf_context_length(path: Path) -> int:
    """The context length a GGUF model declares, from its header alone (no weights read): a stage
    checks what it limits (train.seq_len) before paying for the load."""
    g = GGUFFile(path)
    _entry(g.architecture, f"{path} general.architecture", GGUFError)  # an unknown one named as load_gguf does
    return g.int_key(f"{g.architecture}.context_length")
