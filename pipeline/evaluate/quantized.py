"""What the user ships at 4-8 bits: the export quantized to each of `evaluate.quant_types`, scored on
the same val windows as the export itself.

People run GGUFs at 4-5 bits, and small models lose the most to quantization, so the f32 val loss
alone does not say what a user gets. Each type is written the way `export.dtype` would write it
(gguf-py's numpy quantizer for the legacy block types, llama.cpp's quantizer for the K-quant mixes),
read back through our reader, and scored beside the export: val loss, its rise over the export's,
and the mean KL(export || quantized) per token. With llama-cpp-python installed, llama.cpp also
runs each quantized file over the parity windows, so the loss is the shipped file's in the engine
that will run it, not only in ours.
"""

from __future__ import annotations

import logging
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from pipeline.data.packed import begin_with_bos, window_bos
from pipeline.evaluate.metric_names import QUANT_PREFIX
from pipeline.evaluate.parity import iter_llamacpp_scores
from pipeline.models.registry import export_gguf, load_gguf
from pipeline.tokenizer.pretokenizers import donor_tokenizer_metadata
from pipeline.training.validation import evaluate_loss

log = logging.getLogger(__name__)
WRITER_KEYS = ("general.architecture", "general.file_type", "general.quantization_version", "general.alignment")


def write_quantized(export: Path, dtype: str, dst: Path) -> Path:
    """`export` (an f32 GGUF) written again at `dtype`, keys and tokenizer kept, as export.dtype would."""
    model, g = load_gguf(export)
    keep = {k: g.typed_field(k) for k in g.metadata if k.startswith(("general.", "pipeline.")) and k not in WRITER_KEYS}
    return export_gguf(model, dst, donor_tokenizer_metadata(g), keep, dtype)


@torch.no_grad()
def loss_and_kl(
    ref: nn.Module, quant: nn.Module, val: np.ndarray, seq_len: int, batch: int, device: torch.device
) -> tuple[float, float]:
    """The quantized model's mean NLL over evaluate's val windows and the mean KL(ref || quant) per token."""
    n = (len(val) - 1) // seq_len
    tokens = torch.from_numpy(np.asarray(val[: n * seq_len + 1], dtype=np.int64))
    x_all, y_all = begin_with_bos(tokens[:-1].view(n, seq_len).clone(), window_bos(val)), tokens[1:].view(n, seq_len)
    nll = kl = 0.0
    for i in range(0, n, batch):
        x, y = x_all[i : i + batch].to(device), y_all[i : i + batch].to(device)
        lp_ref = ref(x).float().log_softmax(-1).flatten(0, 1)
        lp_q = quant(x).float().log_softmax(-1).flatten(0, 1)
        nll += F.nll_loss(lp_q, y.flatten(), reduction="sum").item()
        kl += F.kl_div(lp_q, lp_ref, log_target=True, reduction="sum").item()
    return nll / (n * seq_len), kl / (n * seq_len)


def window_loss(logits: list[torch.Tensor], windows: list[list[int]]) -> float:
    """Mean NLL of each window's next tokens from its logits (T, vocab) per window."""
    total = count = 0.0
    for lg, ids in zip(logits, windows):
        target = torch.tensor(ids[1:])
        total += F.cross_entropy(lg[:-1].double(), target, reduction="sum").item()
        count += len(target)
    return total / count


@dataclass(frozen=True)
class _Windows:
    """What every type is scored on: the val split's windows, and the parity windows llama.cpp runs."""

    val: np.ndarray
    seq_len: int
    batch: int
    device: torch.device
    parity: list[list[int]]


def quant_metrics(
    export: Path,
    types: list[str],
    val: np.ndarray,
    seq_len: int,
    batch: int,
    device: torch.device,
    windows: list[list[int]],
) -> dict[str, float]:
    """Every type's metrics against the export (read again here: one reference model, one quantized)."""
    if not types:
        return {}
    ref, g = load_gguf(export)
    g.release_pages()
    ref.to(device).eval()
    on = _Windows(val, seq_len, batch, device, windows)
    base = evaluate_loss(ref, val, seq_len, batch, device)
    metrics: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="quant-") as tmp:
        for dtype in types:
            path = write_quantized(export, dtype, Path(tmp) / f"{dtype}.gguf")
            metrics.update(_one_type(ref, base, path, dtype, on))
            path.unlink()
    return metrics


def _one_type(ref: nn.Module, base: float, path: Path, dtype: str, on: _Windows) -> dict[str, float]:
    quant, g = load_gguf(path)
    g.release_pages()
    quant.to(on.device).eval()
    loss, kl = loss_and_kl(ref, quant, on.val, on.seq_len, on.batch, on.device)
    key = f"{QUANT_PREFIX}{dtype}_"
    out = {f"{key}val_loss": loss, f"{key}val_loss_rise": loss - base, f"{key}kl": kl}
    out[f"{key}mb"] = path.stat().st_size / 1e6
    if on.parity:  # the same windows through llama.cpp and through our reading of the same file
        with torch.no_grad():
            ours = [quant(torch.tensor([ids], device=on.device))[0].float().cpu() for ids in on.parity]
        theirs = [torch.from_numpy(s) for s in iter_llamacpp_scores(path, on.parity)]
        out[f"{key}ours_window_loss"] = window_loss(ours, on.parity)
        out[f"{key}llamacpp_window_loss"] = window_loss(theirs, on.parity)
    log.info(
        f"evaluate: {dtype} ({out[f'{key}mb']:.1f} MB): val loss {loss:.4f} (+{loss - base:.4f} over the export), "
        f"KL {kl:.2e}" + (f", llama.cpp {out[f'{key}llamacpp_window_loss']:.4f} on its windows" if on.parity else "")
    )
    return out
