"""llama.cpp's importance-matrix statistics, collected with our own forward pass.

llama-imatrix sums, for every matrix multiplication whose weight is a block tensor (`blk.*`; the
head only with --process-output, which it leaves off), the square of each input column over every
token it sees, and counts the tokens. Our forward hooks do the same on each block's nn.Linear,
named by its GGUF tensor: attn_q, attn_k and attn_v see the same input, and each gets its entry.
"""

from __future__ import annotations

from functools import partial

import numpy as np
import torch
from torch import nn

from pipeline.models import gpt2_gguf, llama_gguf

LAYOUTS = {"llama": llama_gguf.LAYOUT, "gpt2": gpt2_gguf.LAYOUT}  # our parameter names -> GGUF names


def gguf_names(model: nn.Module) -> dict[str, str] | None:
    """Our parameter name -> GGUF tensor name, for the architectures llama.cpp quantizes (else None)."""
    layout = LAYOUTS.get(getattr(getattr(model, "cfg", None), "arch", ""))
    return None if layout is None else layout.names(model.cfg.n_layer, model.head is None)


def block_matmuls(model: nn.Module) -> dict[str, nn.Linear]:
    """Each block's nn.Linear under its weight's GGUF name (blk.N.attn_q.weight, ...)."""
    modules = dict(model.named_modules())
    out = {}
    for ours, gguf in (gguf_names(model) or {}).items():
        module = modules.get(ours.removesuffix(".weight"))
        if gguf.startswith("blk.") and ours.endswith(".weight") and isinstance(module, nn.Linear):
            out[gguf] = module
    return out


def _accumulate(total: torch.Tensor, _module: nn.Module, args: tuple[torch.Tensor, ...]) -> None:
    x = args[0].detach()
    total += x.reshape(-1, x.shape[-1]).double().square().sum(0)


def collect_sums(
    model: nn.Module, windows: np.ndarray, batch_size: int, device: torch.device
) -> tuple[dict[str, np.ndarray], int]:
    """Per block matmul (GGUF name), the sum over all tokens of `windows` (n, seq_len) of each squared
    input column, and the number of tokens: llama-imatrix's in_sum2 and counts."""
    matmuls = block_matmuls(model)
    sums = {n: torch.zeros(m.in_features, dtype=torch.float64, device=device) for n, m in matmuls.items()}
    hooks = [m.register_forward_pre_hook(partial(_accumulate, sums[n])) for n, m in matmuls.items()]
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            for start in range(0, len(windows), batch_size):
                batch = torch.as_tensor(np.asarray(windows[start : start + batch_size], dtype=np.int64), device=device)
                model.hidden(batch)
    finally:
        for h in hooks:
            h.remove()
        model.train(was_training)
    return {n: s.float().cpu().numpy() for n, s in sums.items()}, int(windows.size)
