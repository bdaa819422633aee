"""The donor GGUF loaded as each recipe needs it, in one place: the teacher as a frozen fp32 module, a
llama to cut a subclone from, or only its token embeddings for the PCA recipes (a fine-tune's base:
`pipeline.finetune.model.load_base`). (`locate.py` finds the file.)"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pipeline.errors import GGUFError, problem
from pipeline.gguf.reader import GGUFFile
from pipeline.models.llama import Llama
from pipeline.models.llama_gguf import load_llama
from pipeline.models.names import TOKEN_EMBD as EMBEDDING_TENSOR
from pipeline.models.registry import load_gguf
from pipeline.models.transformer import DecoderLM


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


def load_llama_donor(path: Path) -> tuple[Llama, GGUFFile]:
    """The subclone donor: any llama GGUF; another architecture is named for what it is, with the fix."""
    g = GGUFFile(path)
    if g.architecture != "llama":
        raise GGUFError(
            problem(
                f"{path} general.architecture",
                "llama (recipe.init=subclone cuts a llama student out of a llama donor)",
                repr(g.architecture),
                "use a llama GGUF as donor.path, or a recipe that reads only the donor's embeddings "
                "(recipe=warm-start or pca-lens) or none (recipe=from-scratch)",
            )
        )
    return load_llama(g)


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
