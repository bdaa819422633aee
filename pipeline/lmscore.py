"""Scoring text with one of our models the way benchmark harnesses ask for it: the log-likelihood
of a continuation after a context, and whether greedy decoding would have produced it.

A multiple-choice benchmark (HellaSwag, ARC, PIQA ...) is only this: the answer is the choice with
the highest log-likelihood. Free of lm-eval, so the library imports without it; `pipeline.lmeval`
adapts it to lm-eval's model interface.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from pipeline.errors import ConfigError, problem
from pipeline.models.base import DecoderLM

Pair = tuple[Sequence[int], Sequence[int]]  # (context ids, continuation ids)


def model_input(context: Sequence[int], continuation: Sequence[int], limit: int) -> list[int]:
    """What the model reads to score `continuation`: context + continuation without its last token
    (nothing predicts past it), cut from the left to the model's `limit` tokens."""
    if not continuation:
        raise ConfigError(problem("loglikelihood request", "a continuation of at least one token", "none", _FIX))
    if len(continuation) > limit:
        raise ConfigError(
            problem(
                "loglikelihood request",
                f"a continuation of at most the model's {limit} tokens",
                f"{len(continuation)} tokens",
                "score shorter continuations (or use loglikelihood_rolling for whole documents)",
            )
        )
    whole = [*context, *continuation]
    if len(whole) < 2:
        raise ConfigError(problem("loglikelihood request", "a context of at least one token", "none", _FIX))
    return whole[:-1][-limit:]


_FIX = "give every request a non-empty context (a BOS/EOS id when the text has none)"


def score_continuations(
    model: DecoderLM,
    pairs: Sequence[Pair],
    batch_size: int,
    limit: int | None = None,
    on_batch: Callable[[int], None] | None = None,
) -> list[tuple[float, bool]]:
    """(sum of the continuation's token log-probs, every token the argmax) for each pair, in order.

    Pairs run longest first in batches of `batch_size` (so a batch pads little, and the first batch
    shows whether the largest fits in memory), right-padded: the model is causal, so padding after a
    row changes none of its scored positions. Only the continuation's positions go through the
    head, so a long context costs no (tokens x vocab) logits. `on_batch(n)` is told each batch's size.
    """
    limit = limit or model.cfg.context_length
    inputs = [model_input(c, t, limit) for c, t in pairs]
    order = sorted(range(len(pairs)), key=lambda i: -len(inputs[i]))
    out: list[tuple[float, bool]] = [(0.0, False)] * len(pairs)
    model.eval()
    for start in range(0, len(order), max(1, batch_size)):
        rows = order[start : start + max(1, batch_size)]
        scored = _score_batch(model, [inputs[i] for i in rows], [pairs[i][1] for i in rows])
        for i, result in zip(rows, scored):
            out[i] = result
        if on_batch is not None:
            on_batch(len(rows))
    return out


@torch.inference_mode()
def _score_batch(
    model: DecoderLM, inputs: list[list[int]], continuations: list[Sequence[int]]
) -> list[tuple[float, bool]]:
    device = next(model.parameters()).device
    width = max(len(r) for r in inputs)
    idx = torch.zeros((len(inputs), width), dtype=torch.long)
    rows, cols, targets, counts = [], [], [], []
    for b, (row, cont) in enumerate(zip(inputs, continuations)):
        idx[b, : len(row)] = torch.tensor(row)
        n = len(cont)
        rows += [b] * n
        cols += range(len(row) - n, len(row))
        targets += list(cont)
        counts.append(n)
    hidden = model.hidden(idx.to(device))
    at = (torch.tensor(rows, device=device), torch.tensor(cols, device=device))
    logits = F.linear(hidden[at], model.head_weight()).float()
    target = torch.tensor(targets, device=device)
    logp = torch.log_softmax(logits, dim=-1).gather(1, target[:, None])[:, 0]
    greedy = logits.argmax(dim=-1) == target
    return [(float(lp.sum()), bool(g.all())) for lp, g in zip(logp.double().split(counts), greedy.split(counts))]
