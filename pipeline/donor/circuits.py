"""The donor's copy circuit, measured: which attention heads attend to the previous token and which
complete an induction match (attend to the token just after an earlier occurrence of the current
one), on a random sequence of the corpus's own tokens shown twice (Olsson et al., 2022). Random
tokens can only be predicted by copying, so these heads are the donor's copying.

SmolLM2-135M's induction heads sit in layers 17-18, fed by a previous-token head in layer 16; their
ShortGPT influence ranks them near the bottom, so the importance cut drops them, and a student copies
far worse than its donor: on code and documentation, where identifiers repeat, most of its gap
(docs/subclone.md, "Layers"). `recipe.subclone.layers=circuit` keeps them.
"""

from __future__ import annotations

import numpy as np
import torch

from pipeline.models.llama import Llama

COPY_MIN = 0.4  # a head is part of the circuit when this share of its attention lands on the copy target
PROBE_SEQUENCES, PROBE_LENGTH = 16, 48  # random sequences, each shown twice: 16 x 96 tokens, one forward


def probe_sequences(ids: torch.Tensor, n: int = PROBE_SEQUENCES, length: int = PROBE_LENGTH) -> torch.Tensor:
    """(n, 2 * length) token ids: `length` tokens drawn from `ids` (the calibration windows), then the same
    again; seeded, so one donor and one corpus always give one probe."""
    pool = ids.flatten()
    g = torch.Generator().manual_seed(0)
    first = pool[torch.randint(len(pool), (n, length), generator=g)]
    return torch.cat([first, first], dim=1)


@torch.no_grad()
def attention_maps(model: Llama, ids: torch.Tensor) -> list[torch.Tensor]:
    """Per layer, the (H, T, T) causal attention probabilities averaged over the batch, in fp32."""
    maps: list[torch.Tensor] = []

    def record(attn: torch.nn.Module, args: tuple) -> None:
        q, k, _ = attn.project(args[0].float(), args[1])
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        t = q.shape[2]
        scores = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
        causal = torch.ones(t, t, dtype=torch.bool, device=q.device).triu(1)
        maps.append(scores.masked_fill(causal, float("-inf")).softmax(-1).mean(0))

    handles = [block.attn.register_forward_pre_hook(record) for block in model.blocks]
    try:
        model.hidden(ids)
    finally:
        for h in handles:
            h.remove()
    return maps


def copy_scores(model: Llama, ids: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """(induction, previous): (L, H) arrays, each head's mean attention from the repeat's positions to
    the token after the first occurrence, and from every position to the one before it."""
    probe = probe_sequences(ids)
    n = probe.shape[1] // 2
    maps = attention_maps(model, probe)
    t = torch.arange(n, 2 * n)
    induction = [a[:, t, t - n + 1].mean(-1) for a in maps]
    s = torch.arange(1, 2 * n)
    previous = [a[:, s, s - 1].mean(-1) for a in maps]
    return torch.stack(induction).numpy(), torch.stack(previous).numpy()


def circuit_layers(induction: np.ndarray, previous: np.ndarray, n: int) -> tuple[int, ...]:
    """The donor layers a cut of `n` layers keeps for copying, at most n // 4 (a shallow cut keeps its
    most influential layers instead): those with an induction head past COPY_MIN, strongest first, then
    the layer of the strongest previous-token head below the earliest of them (the head an induction
    head's keys read)."""
    room = n // 4
    strength = induction.max(1)
    ranked = [int(i) for i in np.argsort(-strength, kind="stable") if strength[i] >= COPY_MIN]
    if room < 2 or not ranked:
        return ()
    kept = ranked[: room - 1]
    below = previous.max(1)[: min(kept)]
    if len(below) and below.max() >= COPY_MIN:
        kept.append(int(below.argmax()))
    return tuple(sorted(set(kept)))


def copy_head(induction: np.ndarray, previous: np.ndarray) -> int | None:
    """The layer's (H,) strongest copy head, induction or previous-token, if it passes COPY_MIN."""
    score = np.maximum(induction, previous)
    best = int(score.argmax())
    return best if score[best] >= COPY_MIN else None
