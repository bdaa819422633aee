"""Quantization-aware training to the export's own GGUF type (`train.qat=q8_0|q4_0|q6_k|q5_k_m|q4_k_m`).

From `train.qat_start` (a fraction of the steps) on, every forward and backward runs on the weights
the export will hold: each matrix round-tripped through exactly the block quantization the export
writer gives it (`pipeline.gguf.writer.encode_tensor`: the type's blocks, Q8_0 for the token table
and head below 8 bits, F16 for rows that do not split into blocks), bit for bit what gguf-py's
quantize + dequantize give. The optimizer then updates the full-precision weights with those
gradients (the straight-through estimator), and validation scores the quantized weights too. So
the exported file at that type holds exactly the weights the model was last trained and validated
with. The full-precision weights are swapped in place around each step (no module changes: the
checkpoints, resume and export are the plain model's).

The K-quant mixes are llama.cpp's: each matrix gets the type llama.cpp's quantizer gives it (Q4_K
for most of Q4_K_M, Q6_K for the token table and some attn_v/ffn_down), learnt once by quantizing
the model's own f32 export with `llama_model_quantize` (not a copy of its policy), and its round trip
is ggml's own quantizer and dequantizer (`pipeline.gguf.ggml`), on the CPU, so bit for bit the
weights llama.cpp writes.
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from weakref import WeakKeyDictionary

import numpy as np
import torch
from gguf import GGMLQuantizationType
from torch import nn

from pipeline.errors import ConfigError, problem
from pipeline.gguf import ggml
from pipeline.gguf.ggml import tensor_types
from pipeline.gguf.quantize import K_QUANTS
from pipeline.gguf.writer import tensor_type
from pipeline.models.imatrix import gguf_names
from pipeline.models.registry import export_gguf

BLOCK = 32  # Q8_0 and Q4_0 block size
QAT_TYPES = ("q8_0", "q4_0", *K_QUANTS)
_IMATRIX: WeakKeyDictionary[nn.Module, dict[str, np.ndarray]] = WeakKeyDictionary()  # see use_imatrix
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


def named_targets(model: nn.Module, dtype: str) -> list[tuple[nn.Parameter, str, str]]:
    """Each matrix with the ggml type its export of `dtype` gets, and its GGUF name. For the K-quant
    mixes llama.cpp's own types: the model's f32 export quantized once by llama.cpp, the types read
    back (they depend on names and shapes only); for the legacy types the writer's rule."""
    names = gguf_names(model)
    if names is None or getattr(model, "lens", None) is not None:
        raise ConfigError(
            problem(
                "config key train.qat", f"{dtype}: a llama or gpt2 without a lens", type(model).__name__, "use q8_0"
            )
        )
    types: dict[str, str] = {}
    if dtype in K_QUANTS:
        with tempfile.TemporaryDirectory(prefix="qat-types-") as tmp:
            f32 = export_gguf(model, Path(tmp) / "f32.gguf", {}, {}, "f32")
            types = tensor_types(f32, dtype, torch.get_num_threads())
    params = dict(model.named_parameters())
    out = []
    for ours, gguf in names.items():
        p = params[ours]
        if p.ndim >= 2:
            out.append((p, types[gguf] if types else tensor_type(tuple(p.shape), dtype, gguf).name, gguf))
    return out


def use_imatrix(model: nn.Module, weights: dict[str, np.ndarray]) -> None:
    """The export's importance matrix (GGUF name -> column weights) for `model`'s QAT: the train stage
    sets it before training, and the loop's QuantSwap then passes it to ggml as the export does."""
    _IMATRIX[model] = weights


def ggml_fake_quant(w: torch.Tensor, ggml_type: str, imatrix: np.ndarray | None = None) -> torch.Tensor:
    """`w` round-tripped through ggml's own quantizer for `ggml_type` (with `imatrix`'s column weights),
    on the CPU: bit for bit the values llama.cpp's file of that type holds."""
    if ggml_type in ("F32", "F16"):
        return w.float() if ggml_type == "F32" else w.half().float()
    flat = w.detach().float().cpu().numpy().reshape(-1, w.shape[-1])
    out = ggml.round_trip(flat, GGMLQuantizationType[ggml_type], imatrix, torch.get_num_threads())
    return torch.from_numpy(out).view(w.shape).to(w.device)


class QuantSwap:
    """The training loop's hook: `swapped(step)` puts the export's weights in place for that step's
    forward and backward (from `start` on) and the full-precision ones back before the update.
    `imatrix` (GGUF tensor name -> column weights; by default the one `use_imatrix` set): the export's
    importance matrix, which the fake quant then passes to ggml's quantizer as the export does."""

    def __init__(self, model: nn.Module, dtype: str, start: int, imatrix: dict[str, np.ndarray] | None = None):
        self.start, self.imatrix = start, imatrix if imatrix is not None else _IMATRIX.get(model, {})
        self.ggml = bool(dtype) and (dtype in K_QUANTS or bool(self.imatrix))
        if self.ggml:
            self.pairs = named_targets(model, dtype)
        else:
            self.pairs = [(p, kind, "") for p, kind in targets(model, dtype)] if dtype else []

    def active(self, step: int | None) -> bool:
        return bool(self.pairs) and (step is None or step >= self.start)

    def fake(self, p: torch.Tensor, kind: str, name: str) -> torch.Tensor:
        if self.ggml:
            return ggml_fake_quant(p, kind, self.imatrix.get(name))
        return fake_quant(p.float(), kind)

    @contextmanager
    def swapped(self, step: int | None) -> Iterator[None]:
        """The export's weights in place for training step `step` (from `start` on), or, with None,
        for validation: every evaluation scores what the export would hold, so the kept best is the
        best quantized model."""
        if not self.active(step):
            yield
            return
        with torch.no_grad():
            kept = [p.detach().clone() for p, _, _ in self.pairs]
            for p, kind, name in self.pairs:
                p.copy_(self.fake(p, kind, name).to(p.dtype))
        try:
            yield
        finally:
            with torch.no_grad():
                for (p, _, _), w in zip(self.pairs, kept):
                    p.copy_(w)
