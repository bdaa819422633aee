"""The one train/val split rule: a seeded shuffle of whole items (documents, examples, topics),
the first `val_fraction` of them (at least one, never all) to val, each side in its original order."""

from __future__ import annotations

import random


def split_indices(n: int, val_fraction: float, seed: int) -> tuple[list[int], list[int]]:
    """(train indices, val indices) of `n` items, both sorted."""
    order = list(range(n))
    random.Random(seed).shuffle(order)
    n_val = min(n - 1, max(1, round(n * val_fraction)))
    return sorted(order[n_val:]), sorted(order[:n_val])
