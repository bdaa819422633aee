"""Reference implementations and glue that only the tests need (the library does not carry them)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pipeline.config import ModelConfig
from pipeline.finetune.lora import lora_layers
from pipeline.gguf.reader import GGUFFile
from pipeline.models.ops.losses import IGNORE_INDEX
from pipeline.models.transformer import TransformerConfig


def llama_config(mcfg: ModelConfig, vocab_size: int, donor_dim: int = 0) -> TransformerConfig:
    return TransformerConfig.from_hparams(mcfg, vocab_size, donor_dim)


def masked_cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-token NLL over positions whose label is not -100 (fp32 softmax): the plain reference."""
    return F.cross_entropy(logits.flatten(0, -2).float(), labels.flatten(), ignore_index=IGNORE_INDEX)


def lora_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The adapters' A and B, found by walking the wrapped layers (independently of requires_grad)."""
    return [p for m in lora_layers(model).values() for p in (m.lora_A, m.lora_B)]


def tokenizer_metadata(gguf: GGUFFile) -> dict[str, Any]:
    """All `tokenizer.*` keys of a GGUF as plain values (lists copied)."""
    return {k: (list(v) if isinstance(v, list) else v) for k, v in gguf.metadata.items() if k.startswith("tokenizer.")}


def transformers_overrides(cfg: TransformerConfig) -> dict[str, int]:
    """Config kwargs transformers needs beside `gguf_file=` to load our gpt2 GGUF ({} for GPT-2 sizes).

    transformers 5's GGUF loader maps `gpt2.context_length` to `n_ctx` and `feed_forward_length`
    to a key GPT2Config ignores, so it always builds 1024 positions and a 4*d_model MLP.
    """
    out = {}
    if cfg.context_length != 1024:
        out["n_positions"] = cfg.context_length
    if cfg.d_ff != 4 * cfg.d_model:
        out["n_inner"] = cfg.d_ff
    return out


def run_under_interpreter(test_file: str) -> None:
    """`test_file`'s CPU cases again in a child with Triton's interpreter (it must be on before Triton is
    imported): the kernels' code checked without a GPU. Every selected case must pass: the only skip
    allowed is the calling test's own (it skips in the child), so a case that skips for any other reason
    (no Triton, a missing fixture) fails here, as one that fails does."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}
    cmd = [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "-m", "not cuda", test_file]
    root = Path(__file__).resolve().parent.parent
    done = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    counts = {kind: int(n) for n, kind in re.findall(r"(\d+) (passed|skipped|failed|errors?)", done.stdout)}
    skips = [line for line in done.stdout.splitlines() if line.startswith("SKIPPED")]
    assert counts.get("passed", 0) > 0 and counts.get("skipped", 0) == 1, done.stdout[-2000:]
    assert len(skips) == 1 and "this is the interpreter's child" in skips[0], "\n".join(skips)
