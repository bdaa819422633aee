"""The one train/val split rule: a seeded shuffle of whole items (documents, examples, topics),
the first `val_fraction` of them (at least one, never all) to val, each side in its original order."""

from __future__ import annotations

import random
from array import array

import numpy as np


def split_indices(n: int, val_fraction: float, seed: int) -> tuple[list[int], list[int]]:
    """(train indices, val indices) of `n` items, both sorted."""
    order = list(range(n))
    random.Random(seed).shuffle(order)
    n_val = val_count(n, val_fraction)
    return sorted(order[n_val:]), sorted(order[:n_val])


def val_count(n: int, val_fraction: float) -> int:
    """How many of `n` items go to val: at least one, never all."""
    return min(n - 1, max(1, round(n * val_fraction)))


def val_mask(n: int, val_fraction: float, seed: int) -> np.ndarray:
    """The same split as `split_indices` as a bool mask (True = val), in 8 bytes per item instead of
    a Python list of ints: streaming pack decides millions of documents with it once their count is known.
    It replays `random.Random.shuffle` step by step, so the split of every existing corpus is unchanged."""
    order = array("q", range(n))
    randbelow = random.Random(seed)._randbelow  # exactly what Random.shuffle draws
    for i in reversed(range(1, n)):
        j = randbelow(i + 1)
        order[i], order[j] = order[j], order[i]
    mask = np.zeros(n, dtype=bool)
    mask[np.frombuffer(order, dtype=np.int64)[: val_count(n, val_fraction)]] = True
    return mask
