"""llama.cpp parity inside evaluate: the exported GGUF run by llama.cpp over a few val windows,
compared with our reading of the same file, next-token distribution by distribution.

Both sides read the same (possibly quantized) tensors, so what remains is how they compute:
llama.cpp quantizes activations for quantized matmuls and keeps K/V in f16, we dequantize to
fp32. For every export type that difference is small (mean KL per token well under 0.01); a
file llama.cpp reads differently from us (a wrong Q/K row order, a key it interprets otherwise)
gives a KL of order 1. For a quantized export this is the user's check that the file they ship
computes what evaluate measured.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from pipeline.data.packed import Packed, begin_with_bos, is_rows, window_bos
from pipeline.errors import PipelineError
from pipeline.gguf.quantize import llamacpp_installed

log = logging.getLogger(__name__)

ROWS = 64  # positions compared at a time


@dataclass(frozen=True)
class Parity:
    """Agreement of llama.cpp's next-token distributions with ours over `tokens` positions."""

    top1_agreement: float  # fraction of positions where both pick the same most likely token
    mean_kl: float  # mean over positions of KL(ours || llama.cpp), nats
    max_kl: float  # the worst position's
    windows: int
    tokens: int

    def metrics(self) -> dict[str, float]:
        return {
            "llamacpp_top1_agreement": self.top1_agreement,
            "llamacpp_mean_kl": self.mean_kl,
            "llamacpp_max_kl": self.max_kl,
            "llamacpp_tokens": float(self.tokens),
        }


def val_windows(val: np.ndarray | Packed, seq_len: int, n: int) -> list[list[int]]:
    """The first `n` windows evaluate scores: consecutive `seq_len` windows of a token stream, or
    the non-padding part of the first packed rows."""
    if is_rows(val):
        rows = []
        for ids, seg in zip(val.input_ids[:n], val.segment_ids[:n]):
            rows.append([int(t) for t in ids[seg > 0]])
        return [r for r in rows if len(r) > 1]
    count = min(n, (len(val) - 1) // seq_len)
    rows = np.stack([np.asarray(val[i * seq_len : (i + 1) * seq_len], dtype=np.int64) for i in range(count)])
    return begin_with_bos(rows, window_bos(val)).tolist() if count else []


def llamacpp_logprobs(gguf: Path, windows: list[list[int]], threads: int = 1) -> list[torch.Tensor]:
    """llama.cpp's log-softmax at every position of each window, (T, vocab) float64 each."""
    return [_log_softmax(scores) for scores in iter_llamacpp_scores(gguf, windows, threads)]


def iter_llamacpp_scores(gguf: Path, windows: list[list[int]], threads: int = 1) -> Iterator[np.ndarray]:
    """llama.cpp's logits over each window, (T, vocab) float32, one window at a time and llama.cpp
    closed after the last, so that evaluate holds one window's, not all.

    One thread: on a busy small machine ggml's spinning worker threads make it many times slower.
    """
    import llama_cpp

    n_ctx = max(len(w) for w in windows)
    try:
        llm = _open(llama_cpp, gguf, n_ctx, threads)
    except ValueError as e:  # llama-cpp-python's "Failed to load model from file"
        raise PipelineError(
            f"{gguf}: expected a GGUF llama.cpp loads, found {e}; fix: the shipped file would not run in "
            "llama.cpp: re-export it, or set evaluate.llamacpp_windows=0 to skip the check"
        ) from None
    try:
        for ids in windows:
            llm.reset()
            llm.eval(ids)
            yield np.array(llm.scores[: len(ids)], dtype=np.float32)
    finally:
        llm.close()


def _log_softmax(scores: np.ndarray) -> torch.Tensor:
    """Log-probs in float64 from llama.cpp's logits, row by row (so a slice of rows gives those rows' values)."""
    return torch.from_numpy(np.asarray(scores, dtype=np.float64)).log_softmax(-1)


def _open(llama_cpp, gguf: Path, n_ctx: int, threads: int):
    from llama_cpp._utils import suppress_stdout_stderr

    with suppress_stdout_stderr(disable=False):  # its context warnings print even with verbose=False
        return llama_cpp.Llama(
            model_path=str(gguf),
            n_ctx=n_ctx,
            n_batch=n_ctx,
            logits_all=True,
            n_threads=threads,
            n_threads_batch=threads,
            verbose=False,
        )


@torch.no_grad()
def our_logits(model: nn.Module, windows: list[list[int]]) -> list[torch.Tensor]:
    """Our logits over each window, (T, vocab) on the CPU: kept so that llama.cpp can run after the
    model is freed (evaluate never holds both)."""
    device = next(model.parameters()).device
    model.eval()
    return [model(torch.tensor([ids], device=device))[0].cpu() for ids in windows]


def compare(model: nn.Module, windows: list[list[int]], theirs: Iterable[torch.Tensor]) -> Parity:
    """Top-1 agreement and KL(ours || llama.cpp) per position, over all windows (`theirs`: llama.cpp's log-probs)."""
    kls, agree = [], 0
    for logits, lp_cpp in zip(our_logits(model, windows), theirs):
        kl, same = _kl(logits, lp_cpp)
        kls.append(kl)
        agree += same
    return _parity(kls, agree, len(windows))


def compare_logits(ours: list[torch.Tensor], theirs: Iterable[np.ndarray]) -> Parity:
    """`compare` from our logits (`our_logits`, each dropped from `ours` once used) and llama.cpp's
    (`iter_llamacpp_scores`), `ROWS` positions at a time: the same values as whole windows, but
    float64 temporaries of 64 rows instead of a window's (5 of T x 49k x 8 bytes on SmolLM2)."""
    kls, agree, n = [], 0, len(ours)
    for scores in theirs:
        logits = ours.pop(0)
        for r in range(0, len(logits), ROWS):
            kl, same = _kl(logits[r : r + ROWS], _log_softmax(scores[r : r + ROWS]))
            kls.append(kl)
            agree += same
    return _parity(kls, agree, n)


def _kl(logits: torch.Tensor, lp_cpp: torch.Tensor) -> tuple[torch.Tensor, int]:
    """KL(ours || llama.cpp) per position and the count of positions where both pick the same top token."""
    lp = logits.double().log_softmax(-1)
    lp_cpp = lp_cpp[:, : lp.shape[-1]]
    kl = (lp.exp() * (lp - lp_cpp)).sum(-1)
    return kl, int((lp.argmax(-1) == lp_cpp.argmax(-1)).sum())


def _parity(kls: list[torch.Tensor], agree: int, windows: int) -> Parity:
    kl_all = torch.cat(kls)
    return Parity(agree / kl_all.numel(), float(kl_all.mean()), float(kl_all.max()), windows, kl_all.numel())


def parity_windows(val: np.ndarray | Packed, seq_len: int, n_windows: int) -> list[list[int]]:
    """The val windows the check runs, [] (logged) when it is skipped: no llama-cpp-python,
    `n_windows` 0, no val window."""
    if n_windows <= 0 or not llamacpp_installed():
        why = "evaluate.llamacpp_windows=0" if n_windows <= 0 else "llama-cpp-python not installed (`make llamacpp`)"
        log.info(f"evaluate: llama.cpp parity skipped ({why})")
        return []
    windows = val_windows(val, seq_len, n_windows)
    if not windows:
        log.info("evaluate: llama.cpp parity skipped (no val window)")
    return windows


def llamacpp_parity(
    gguf: Path, model: nn.Module, val: np.ndarray | Packed, seq_len: int, n_windows: int, max_kl: float
) -> dict[str, float]:
    """The parity metrics, {} when skipped (no llama-cpp-python, `n_windows` 0, no val windows);
    a mean KL above `max_kl` is a one-line error."""
    windows = parity_windows(val, seq_len, n_windows)
    return check_parity(gguf, windows, our_logits(model, windows), max_kl)


def check_parity(gguf: Path, windows: list[list[int]], ours: list[torch.Tensor], max_kl: float) -> dict[str, float]:
    """`llamacpp_parity` from our logits over `windows` (consumed), llama.cpp loading `gguf` only now."""
    if not windows:
        return {}
    parity = compare_logits(ours, iter_llamacpp_scores(gguf, windows))
    log.info(
        f"evaluate: llama.cpp parity over {parity.tokens} tokens ({parity.windows} windows): top-1 agreement "
        f"{parity.top1_agreement:.1%}, mean KL {parity.mean_kl:.2e} (max {parity.max_kl:.2e})"
    )
    if parity.mean_kl > max_kl:
        raise PipelineError(
            f"{gguf}: expected llama.cpp's next-token distributions within mean KL evaluate.llamacpp_max_kl="
            f"{max_kl} of ours, found {parity.mean_kl:.4f} (top-1 agreement {parity.top1_agreement:.1%}); "
            "fix: llama.cpp reads this file differently from us: re-export it (or raise the bound if you accept it)"
        )
    return parity.metrics()
