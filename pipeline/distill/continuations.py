"""The donor's own text to distil on (`train.distill.source=donor`): its greedy continuations of
prompts taken from the train split, with its top-k next-token distribution at every position.

A draft model is judged on text its donor writes, not on the corpus: under speculative decoding
every context the draft sees is the donor's own greedy output. An instruct donor continues a corpus
prompt in its own style (it explains, lists, repeats), which a student trained on the corpus does not
predict. Caching the donor's distribution over its own continuations is sequence-level
distillation: the student learns the donor's choices where the donor will ask for them. The
targets come free with generation (each step's logits are the next position's targets); the donor
decodes a batch of prompts at once with a KV cache (`pipeline.inference.decode.PackedLlama`, in the
teach stage's precision: bf16 weights by default, the softmax in fp32).
"""

from __future__ import annotations

import numpy as np
import torch

from pipeline.data.packed import begin_with_bos, window_bos
from pipeline.inference.decode import PackedLlama
from pipeline.models.ops.losses import top_k_targets
from pipeline.models.transformer import DecoderLM
from pipeline.progress import Progress

BATCH = 128  # continuations decoded together: 1,088 positions/s on 2 cores at 128, 660 at 32, 950 at 192


def prompt_starts(n: int, sequences: int, prompt_tokens: int) -> np.ndarray:
    """Where each of `sequences` prompts starts, evenly spread over a train split of `n` tokens."""
    return np.linspace(0, max(n - prompt_tokens, 0), sequences).astype(np.int64)


def sequences_for(budget: int, n: int, sequence: int) -> int:
    """How many continuations of `sequence` tokens fill `budget` positions (0 = as many as the split
    has windows), at least one. A small split gives more prompts than windows: they overlap, and
    each still starts a continuation of its own."""
    return max(1, budget // sequence if budget else n // sequence)


@torch.no_grad()
def build_continuations(
    model: DecoderLM,
    train: np.ndarray,
    sequences: int,
    prompt_tokens: int,
    sequence: int,
    arrays: tuple[np.ndarray, ...],
    device: torch.device,
    progress: bool = True,
    precision: str = "bf16",
) -> tuple[np.ndarray, list[list[int]]]:
    """Fill `arrays` (ids, log-probs, tail; `sequences * sequence` rows) with the donor's top-k at
    every position of its continuations; returns their tokens end to end and the prompts' spans."""
    packed = PackedLlama(model, precision, device)
    k = arrays[0].shape[1]
    starts = prompt_starts(len(train), sequences, prompt_tokens)
    tokens = np.zeros(sequences * sequence, dtype=np.int64)
    with Progress("teach", total=len(tokens), unit="tok", enabled=progress) as bar:
        for i in range(0, sequences, BATCH):
            group = starts[i : i + BATCH]
            prompts = np.stack([np.asarray(train[s : s + prompt_tokens], dtype=np.int64) for s in group])
            prompts = begin_with_bos(prompts, window_bos(train))
            ids, targets = _continue(packed, torch.from_numpy(prompts).to(device), sequence, k)
            lo, hi = i * sequence, (i + len(group)) * sequence
            tokens[lo:hi] = ids.reshape(-1)
            for out, t in zip(arrays, targets):
                out[lo:hi] = t.reshape(hi - lo, *t.shape[2:])
            bar.update(hi - lo)
    return tokens, [[int(s), int(s) + prompt_tokens] for s in starts]


def _continue(packed: PackedLlama, prompts: torch.Tensor, sequence: int, k: int) -> tuple[np.ndarray, list[np.ndarray]]:
    """Greedy continuations of `prompts` (B, P) to `sequence` tokens, and the donor's (ids, log-probs,
    tail) at each of their positions, as numpy arrays (B, sequence, ...)."""
    cache = packed.new_cache()
    logits = packed(prompts, cache)  # (B, P, V): the targets of the prompt's positions
    ids, parts = [prompts], [top_k_targets(logits.flatten(0, 1), k)]
    for _ in range(sequence - prompts.shape[1]):
        nxt = logits[:, -1:].argmax(-1)
        ids.append(nxt)
        logits = packed(nxt, cache)  # the last position's targets too: a window's every position has one
        parts.append(top_k_targets(logits.flatten(0, 1), k))
    b = prompts.shape[0]
    targets = [torch.cat([p[j].view(b, -1, *p[j].shape[1:]) for p in parts], 1) for j in range(3)]
    return torch.cat(ids, 1).cpu().numpy(), [t.cpu().numpy() for t in targets]
