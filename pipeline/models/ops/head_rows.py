"""Training's softmax over the tokens the corpus uses, for a large vocabulary (`train.vocab`).

Gemma 3's head has 262,144 rows: at a student's width its matmul, forward and backward, costs several
times the blocks' (measured in docs/donor.md). A pydoc corpus uses ~6k of those ids, and the donor's
top-k a few thousand more. So training's softmax runs over `HeadVocab.ids`: every id of the packed
train and val splits and every id the teach cache holds; the model, its table and its export keep every
row, and llama.cpp tokenizes and runs the export as the donor. What the student never sees in a target
it must still not give mass to: each training step adds `negatives` ids drawn uniformly from the rest
(the host's torch generator, which checkpoints save: resume stays exact), their logits raised by
log(rest / negatives) so that they stand for all the others (sampled softmax, as in Jean et al. 2015).
Validation scores over `ids` alone (every val target is among them); evaluate scores the export over
the whole vocabulary.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch

AUTO_ABOVE = 65536  # train.vocab=auto restricts the softmax of vocabularies larger than this


@dataclass
class HeadVocab:
    """The ids the softmax runs over, and how a full-vocabulary id maps into them."""

    ids: torch.Tensor  # (S,) int64, ascending
    index: torch.Tensor  # (V,) int64: position of an id in `ids`, -1 outside
    rest: torch.Tensor  # (V - S,) int64: every other id
    negatives: int  # drawn from `rest` per training step

    @classmethod
    def of(cls, used: np.ndarray, vocab_size: int, negatives: int) -> HeadVocab:
        """From a boolean (V,) mask of the ids in use."""
        ids = torch.from_numpy(np.flatnonzero(used)).long()
        index = torch.full((vocab_size,), -1, dtype=torch.long)
        index[ids] = torch.arange(len(ids))
        rest = torch.from_numpy(np.flatnonzero(~used)).long()
        return cls(ids, index, rest, min(negatives, len(rest)))

    def rows(self, training: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The head rows of this step (the corpus ids, then a training step's negatives) and the logit
        offset of each (None: none), on the host."""
        if not training or not self.negatives:
            return self.ids, None
        drawn = self.rest[torch.randint(len(self.rest), (self.negatives,))]
        bias = torch.zeros(len(self.ids) + self.negatives)
        bias[len(self.ids) :] = math.log(len(self.rest) / self.negatives)
        return torch.cat((self.ids, drawn)), bias

    def map(self, ids: torch.Tensor) -> torch.Tensor:
        """Full-vocabulary ids (targets, a teacher's top-k) as positions among the head rows."""
        index = self.index if self.index.device == ids.device else self.index.to(ids.device)
        return index[ids.long()]


@contextmanager
def whole_vocabulary(model: torch.nn.Module) -> Iterator[None]:
    """`model` scored over its whole head inside the block (the figures a run reports: before and after)."""
    vocab = getattr(model, "head_vocab", None)
    model.head_vocab = None
    try:
        yield
    finally:
        model.head_vocab = vocab


def corpus_vocabulary(splits: list[np.ndarray], teacher_ids: np.ndarray | None, vocab_size: int) -> np.ndarray:
    """(V,) bool: the ids the token streams `splits` and a teacher's cached top-k hold."""
    used = np.zeros(vocab_size, dtype=bool)
    for tokens in [*splits, *([] if teacher_ids is None else [teacher_ids])]:
        for start in range(0, len(tokens), 1 << 24):  # a memmap a slice at a time
            used[np.unique(np.asarray(tokens[start : start + (1 << 24)]))] = True
    return used


def wants_corpus_vocab(setting: str, vocab_size: int) -> bool:
    """`train.vocab`: full, corpus, or auto (corpus above AUTO_ABOVE tokens)."""
    return setting == "corpus" or (setting == "auto" and vocab_size > AUTO_ABOVE)
