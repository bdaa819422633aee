"""Scoring text with one of our models the way benchmark harnesses ask for it: the log-likelihood
of a continuation after a context, and whether greedy decoding would have produced it.

A multiple-choice benchmark (HellaSwag, ARC, PIQA ...) is only this: the answer is the choice with
the highest log-likelihood. Free of lm-eval, so the library imports without it; `pipeline.evaluate.lmeval`
adapts it to lm-eval's model interface.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from pipeline.errors import ConfigError, problem
from pipeline.models.transformer import DecoderLM

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

    Distinct model inputs run longest first in batches of `batch_size` (so a batch pads little, and
    the first batch shows whether the largest fits in memory), right-padded: the model is causal, so
    padding after a row changes none of its scored positions. Pairs with the same input (the choices
    of a multiple-choice question that are one token each, e.g. " A" / " B") share one row. Only the
    scored positions go through the head, so a long context costs no (tokens x vocab) logits.
    `on_batch(n)` is told how many pairs each batch finished.
    """
    limit = limit or model.cfg.context_length
    rows: dict[tuple[int, ...], list[int]] = {}  # distinct input -> the pairs that read it
    for i, (context, continuation) in enumerate(pairs):
        rows.setdefault(tuple(model_input(context, continuation, limit)), []).append(i)
    order = sorted(rows, key=len, reverse=True)
    out: list[tuple[float, bool]] = [(0.0, False)] * len(pairs)
    model.eval()
    step = max(1, batch_size)
    for start in range(0, len(order), step):
        batch = order[start : start + step]
        members = [(b, i) for b, row in enumerate(batch) for i in rows[row]]
        scored = _score_batch(model, [list(row) for row in batch], [(b, pairs[i][1]) for b, i in members])
        for (_, i), result in zip(members, scored):
            out[i] = result
        if on_batch is not None:
            on_batch(len(members))
    return out


@torch.inference_mode()
def _score_batch(
    model: DecoderLM, inputs: list[list[int]], wanted: list[tuple[int, Sequence[int]]]
) -> list[tuple[float, bool]]:
    """For each (row, continuation) in `wanted`: the continuation scored at the row's last positions."""
    device = next(model.parameters()).device
    width = max(len(r) for r in inputs)
    idx = torch.zeros((len(inputs), width), dtype=torch.long)
    for b, row in enumerate(inputs):
        idx[b, : len(row)] = torch.tensor(row)
    rows, cols, targets, counts = [], [], [], []
    for b, cont in wanted:
        n, end = len(cont), len(inputs[b])
        rows += [b] * n
        cols += range(end - n, end)
        targets += list(cont)
        counts.append(n)
    hidden = model.hidden(idx.to(device))
    at = (torch.tensor(rows, device=device), torch.tensor(cols, device=device))
    logits = F.linear(hidden[at], model.head_weight()).float()
    target = torch.tensor(targets, device=device)
    logp = torch.log_softmax(logits, dim=-1).gather(1, target[:, None])[:, 0]
    greedy = logits.argmax(dim=-1) == target
    return [(float(lp.sum()), bool(g.all())) for lp, g in zip(logp.double().split(counts), greedy.split(counts))]
