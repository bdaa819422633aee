"""Shared fixtures: the real SmolLM2 donor (opened once) and tiny GGUFs written with GGUFWriter."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from pipeline.gguf.reader import GGUFFile, resolve_gguf_path

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
