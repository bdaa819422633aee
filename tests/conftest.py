"""Shared fixtures: the real SmolLM2 donor (opened once) and tiny GGUFs written with GGUFWriter."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from pipeline.gguf.reader import GGUFFile, resolve_gguf_path
from pipeline.models.base import TransformerConfig, init_weights
from pipeline.models.llama import Llama
from pipeline.models.llama_gguf import export_llama

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def one_thread():
    """Small matmuls run faster on one thread, and a busy shared box stalls two-thread ops badly.
    A module opts in with `pytestmark = pytest.mark.usefixtures("one_thread")`."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    return resolve_gguf_path("smollm2")


@pytest.fixture(scope="session")
def smollm2(smollm2_path: Path) -> GGUFFile:
    return GGUFFile(smollm2_path)


def write_tiny_gguf(
    path: Path,
    vocab: int = 64,
    width: int = 16,
    arch: str = "llama",
    declared_width: int | None = None,
    embd_type: str = "f32",
    with_embd: bool = True,
    seed: int = 0,
) -> Path:
    """A minimal GGUF with an embedding table (optionally Q8_0) and the width key."""
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(path, arch)
    w.add_embedding_length(declared_width if declared_width is not None else width)
    w.add_block_count(0)
    if with_embd:
        table = rng.standard_normal((vocab, width)).astype(np.float32)
        # give the table a clear principal structure so PCA has something to find
        table[:, 0] *= 5.0
        if embd_type == "q8_0":
            q = gguf.quants.quantize(table, gguf.GGMLQuantizationType.Q8_0)
            w.add_tensor("token_embd.weight", q, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            w.add_tensor("token_embd.weight", table)
    else:
        w.add_tensor("output_norm.weight", np.ones(width, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def write_tiny_llama_gguf(
    path: Path,
    vocab: int = 64,
    d_model: int = 32,
    n_layer: int = 4,
    n_head: int = 4,
    n_kv_head: int = 2,
    d_ff: int = 48,
    rope_theta: float = 100000.0,
    seed: int = 0,
) -> Path:
    """A whole random llama donor as an f32 GGUF (tied head, no tokenizer), with norm weights far
    from 1 (some negative) and a few "massive" residual coordinates, as real donors have."""
    cfg = TransformerConfig(vocab, d_model, n_layer, n_head, n_kv_head, d_ff, 128, rope_theta, 1e-5)
    model = Llama(cfg)
    init_weights(model, 0.2, seed)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.5 + 0.5 * torch.randn(p.shape, generator=g))
                p[:2] = torch.tensor([-1.5, 0.7])
        model.tok_embd.weight[:, :3] *= 20.0  # outlier coordinates
    return export_llama(model, path, {}, {"general.name": "tiny-donor"}, "f32")
