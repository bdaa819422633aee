"""The donor GGUF loaded as each recipe needs it, in one place: the teacher as a frozen fp32 module, a
llama to cut a subclone from, or only its token embeddings for the PCA recipes (a fine-tune's base:
`pipeline.finetune.model.load_base`). (`locate.py` finds the file.)"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pipeline.config import ModelConfig
from pipeline.errors import GGUFError, problem
from pipeline.gguf.reader import GGUFFile
from pipeline.models.llama import Llama
from pipeline.models.llama_gguf import SWA_PATTERN, config_from_gguf, load_llama
from pipeline.models.names import LLAMA_FAMILY
from pipeline.models.names import TOKEN_EMBD as EMBEDDING_TENSOR
from pipeline.models.registry import load_gguf
from pipeline.models.transformer import DecoderLM, TransformerConfig


@dataclass
class DonorEmbeddings:
    """The donor's token table, dequantized, with where it came from (what the PCA recipes read)."""

    path: Path
    architecture: str
    width: int
    table: np.ndarray  # (vocab, width) float32
    tensor_type: str


def read_donor_embeddings(path: Path) -> DonorEmbeddings:
    """The donor's `token_embd.weight`, dequantized, with its width checked against the header."""
    g = GGUFFile(path)
    arch = g.architecture
    width = g.int_key(f"{arch}.embedding_length")
    if not g.has_tensor(EMBEDDING_TENSOR):
        raise GGUFError(
            problem(
                str(path), f"a tensor named {EMBEDDING_TENSOR}", "no such tensor", "use a GGUF with token embeddings"
            )
        )
    info = g.tensor_info(EMBEDDING_TENSOR)
    if len(info.shape) != 2 or info.shape[1] != width:
        raise GGUFError(
            problem(
                f"{path} {EMBEDDING_TENSOR}",
                f"shape (vocab, {arch}.embedding_length={width})",
                f"shape {info.shape}",
                "the file is inconsistent; re-export it",
            )
        )
    return DonorEmbeddings(Path(path), arch, width, g.tensor(EMBEDDING_TENSOR), info.ggml_type)


def _family_donor(path: Path, what: str) -> GGUFFile:
    """The donor's file, refused by name when its architecture is not of the llama family."""
    g = GGUFFile(path)
    if g.architecture not in LLAMA_FAMILY:
        raise GGUFError(
            problem(
                f"{path} general.architecture",
                f"one of {', '.join(LLAMA_FAMILY)} ({what})",
                repr(g.architecture),
                "use a donor of a supported architecture, or a recipe that reads only the donor's embeddings "
                "(recipe=warm-start or pca-lens with model.arch=llama) or none (recipe=from-scratch model.arch=llama)",
            )
        )
    return g


def load_llama_donor(path: Path) -> tuple[Llama, GGUFFile]:
    """The subclone donor: any GGUF of the llama family; another architecture is named, with the fix."""
    return load_llama(_family_donor(path, "recipe.init=subclone cuts the student out of the donor's blocks"))


def student_config(mcfg: ModelConfig, vocab_size: int, donor: Path, donor_dim: int = 0) -> TransformerConfig:
    """The student `mcfg` describes; with `model.arch=donor`, in the donor's architecture and with its rules
    (head width unless model.head_dim is set, RoPE base, scaling and factors, norm epsilon, sliding
    layers: llama.cpp's every-6th-global pattern, which a subclone replaces by its kept layers' kinds).
    Only the header is read."""
    if mcfg.arch != "donor":
        return TransformerConfig.from_hparams(mcfg, vocab_size, donor_dim)
    rules = config_from_gguf(_family_donor(donor, "model.arch=donor builds the student in the donor's architecture"))
    head = mcfg.head_dim or rules.head_dim
    n, sliding = mcfg.n_layer, rules.sliding_window > 0
    return TransformerConfig(
        vocab_size=vocab_size,
        d_model=mcfg.d_model,
        n_layer=n,
        n_head=mcfg.n_head,
        n_kv_head=mcfg.n_kv_head,
        d_ff=mcfg.d_ff,
        context_length=mcfg.context_length,
        rope_theta=mcfg.rope_theta or rules.rope_theta,
        norm_eps=mcfg.norm_eps or rules.norm_eps,
        tie_embeddings=mcfg.tie_embeddings,
        donor_dim=donor_dim,
        arch=rules.arch,
        rope_freq_factors=rules.rope_freq_factors,
        key_length=head if head * mcfg.n_head != mcfg.d_model else 0,
        rope_scale=rules.rope_scale,
        sliding_window=rules.sliding_window,
        sliding_layers=tuple(i % SWA_PATTERN < SWA_PATTERN - 1 for i in range(n)) if sliding else (),
        rope_theta_local=rules.rope_theta_local,
    )


def load_donor(path: Path, vocab_size: int) -> DecoderLM:
    """The donor GGUF as an eval-mode fp32 module without gradients; its vocab must be the packed one."""
    model, g = load_gguf(path)
    if model.cfg.vocab_size != vocab_size:
        raise GGUFError(
            problem(
                str(g.path),
                f"the packed data's vocab of {vocab_size} tokens",
                f"{model.cfg.vocab_size}",
                "pack with this donor's tokenizer (dvc repro pack)",
            )
        )
    return model.eval().requires_grad_(False)
