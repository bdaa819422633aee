"""Quantization-aware training to the export's own GGUF type (`train.qat=q8_0|q4_0`).

From `train.qat_start` (a fraction of the steps) on, every forward and backward runs on the weights
the export will hold: each matrix round-tripped through exactly the block quantization the export
writer gives it (`pipeline.gguf.writer.encode_tensor`: the type's blocks, Q8_0 for the token table
and head below 8 bits, F16 for rows that do not split into blocks), bit for bit what gguf-py's
quantize + dequantize give. The optimizer then updates the full-precision weights with those
gradients (the straight-through estimator), and validation scores the quantized weights too. So
the exported file at that type holds exactly the weights the model was last trained and validated
with. The full-precision weights are swapped in place around each step (no module changes: the
checkpoints, resume and export are the plain model's).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

BLOCK = 32  # Q8_0 and Q4_0 block size
QAT_TYPES = ("q8_0", "q4_0")
LOW_BIT = ("q4_0",)  # the export keeps the token table / head at Q8_0 below 8 bits (as llama.cpp does)


def _roundf(x: torch.Tensor) -> torch.Tensor:
    """Round half away from zero, as ggml's roundf (gguf-py's np_roundf)."""
    a = x.abs()
    floored = a.floor()
    return x.sign() * (floored + (2 * (a - floored)).floor())


def fake_q8_0(w: torch.Tensor) -> torch.Tensor:
    """dequantize(quantize(w, Q8_0)): per 32 values an fp16 scale absmax/127 and int8 codes."""
    b = w.reshape(-1, BLOCK)
    d = b.abs().amax(1, keepdim=True) / 127
    inv = torch.where(d == 0, torch.zeros_like(d), 1 / d)
    return (_roundf(b * inv) * d.half().float()).view_as(w)


def fake_q4_0(w: torch.Tensor) -> torch.Tensor:
    """dequantize(quantize(w, Q4_0)): per 32 values an fp16 scale (the signed absmax / -8) and 4-bit codes."""
    b = w.reshape(-1, BLOCK)
    d = b.gather(1, b.abs().argmax(1, keepdim=True)) / -8
    inv = torch.where(d == 0, torch.zeros_like(d), 1 / d)
    q = torch.trunc(b * inv + 8.5).clamp(0, 15)
    return ((q - 8) * d.half().float()).view_as(w)


def fake_quant(w: torch.Tensor, ggml_type: str) -> torch.Tensor:
    """`w` (fp32) as the export stores it under `ggml_type` (Q8_0, Q4_0 or F16), dequantized."""
    if ggml_type == "F16":
        return w.half().float()
    return fake_q4_0(w) if ggml_type == "Q4_0" else fake_q8_0(w)


def targets(model: nn.Module, dtype: str) -> list[tuple[nn.Parameter, str]]:
    """Each matrix the export quantizes, with the ggml type it gets under `dtype` (the writer's rule)."""
    table = model.embedding_table() if hasattr(model, "embedding_table") else None
    head = getattr(model, "head", None)
    out = []
    for p in model.parameters():
        if p.ndim < 2:
            continue  # norms stay F32
        is_head = (table is not None and p is table) or (head is not None and p is getattr(head, "weight", None))
        kind = "Q8_0" if dtype in LOW_BIT and is_head else dtype.upper()
        out.append((p, kind if p.shape[-1] % BLOCK == 0 else "F16"))
    return out


class QuantSwap:
    """The training loop's hook: `swapped(step)` puts the export's weights in place for that step's
    forward and backward (from `start` on) and the full-precision ones back before the update."""

    def __init__(self, model: nn.Module, dtype: str, start: int):
        self.pairs = targets(model, dtype) if dtype else []
        self.start = start

    def active(self, step: int | None) -> bool:
        return bool(self.pairs) and (step is None or step >= self.start)

    @contextmanager
    def swapped(self, step: int | None) -> Iterator[None]:
        """The export's weights in place for training step `step` (from `start` on), or, with None,
        for validation: every evaluation scores what the export would hold, so the kept best is the
        best quantized model."""
        if not self.active(step):
            yield
            return
        with torch.no_grad():
            kept = [p.detach().clone() for p, _ in self.pairs]
            for p, kind in self.pairs:
                p.copy_(fake_quant(p.float(), kind).to(p.dtype))
        try:
            yield
        finally:
            with torch.no_grad():
                for (p, _), w in zip(self.pairs, kept):
                    p.copy_(w)
