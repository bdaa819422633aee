"""A student as its donor's draft model: greedy speculative decoding and the acceptance it gets.

The student shares the donor's vocabulary id for id, so it can propose the donor's next tokens:
the draft runs `k` cheap greedy steps, the donor checks all of them in one forward of k+1
positions, and the longest prefix the donor agrees with is kept, plus the donor's own next token.
Under greedy decoding the output is the donor's own (up to the rounding of a k+1-position forward
against one-position ones), with fewer donor forwards. `draft_acceptance` measures how often a
draft would be accepted without generating: both models' argmax over the same windows.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from pipeline.inference.decode import PackedLlama
from pipeline.inference.sampling import Completion, find_stop


@dataclass
class Speculated:
    """What a speculative decode produced and what it cost."""

    ids: list[int]
    drafted: int = 0  # draft tokens proposed
    accepted: int = 0  # of them, kept
    target_calls: int = 0  # donor forwards after the prompt's
    prefill_s: float = 0.0  # the target's prompt pass (and so its first token)
    decode_s: float = 0.0  # everything after it

    @property
    def acceptance(self) -> float:
        return self.accepted / max(self.drafted, 1)


def _argmax(model: PackedLlama, ids: Sequence[int], cache) -> torch.Tensor:
    """Greedy choices (T,) after each of `ids`, which continue what `cache` holds."""
    x = torch.tensor([list(ids)], device=model.device)
    return model(x, cache)[0].argmax(-1).cpu()


@torch.inference_mode()
def speculative_greedy(
    target: PackedLlama,
    draft: PackedLlama,
    prompt_ids: Sequence[int],
    max_new_tokens: int,
    k: int = 4,
    stop_ids: tuple[int, ...] = (),
    p_min: float = 0.0,
) -> Speculated:
    """Up to `max_new_tokens` greedy ids of `target` after `prompt_ids`, drafted up to `k` at a time
    by `draft` (a stop id ends the continuation and is not included). As llama.cpp's `--draft-p-min`,
    the draft stops proposing at a token its own softmax gives less than `p_min`: an unsure guess
    costs the target a longer check and is seldom accepted."""
    if not prompt_ids or k < 1 or not 0.0 <= p_min <= 1.0:
        raise ValueError("speculative decoding needs at least one prompt token, k >= 1 and 0 <= p_min <= 1")
    if len(prompt_ids) + max_new_tokens + k + 1 > min(target.cfg.context_length, draft.cfg.context_length):
        raise ValueError("prompt + max_new_tokens + k exceeds a model's context_length")
    seq = list(prompt_ids)
    out = Speculated(ids=[])
    t_cache, d_cache = target.new_cache(), draft.new_cache()
    start = time.perf_counter()
    pending = int(_argmax(target, seq, t_cache)[-1])  # the target's next token; in no cache yet
    out.prefill_s = time.perf_counter() - start
    while True:
        seq.append(pending)
        out.ids.append(pending)
        if pending in stop_ids or len(out.ids) >= max_new_tokens:
            break
        proposal = _draft(draft, seq, d_cache, k, p_min)
        checks = _argmax(target, [pending, *proposal], t_cache)  # the target's choice after each
        n = next((i for i, (d, g) in enumerate(zip(proposal, checks.tolist())) if d != g), len(proposal))
        out.drafted, out.accepted = out.drafted + len(proposal), out.accepted + n
        out.target_calls += 1
        for tok in proposal[:n]:
            seq.append(tok)
            out.ids.append(tok)
            if tok in stop_ids or len(out.ids) >= max_new_tokens:
                return _finish(out, stop_ids, max_new_tokens, start)
        pending = int(checks[n])
        t_cache.truncate(len(seq))  # the target keeps seq (with the accepted drafts), not `pending`
        d_cache.truncate(len(seq))
    return _finish(out, stop_ids, max_new_tokens, start)


def _draft(draft: PackedLlama, seq: list[int], cache, k: int, p_min: float) -> list[int]:
    """Up to `k` greedy draft tokens after `seq`, each with probability >= `p_min` under the draft,
    feeding the draft what its cache does not hold yet."""
    proposal: list[int] = []
    feed = seq[cache.length :]
    for _ in range(k):
        logits = draft(torch.tensor([feed], device=draft.device), cache)[0, -1].float()
        top, tok = logits.max(-1)
        if p_min > 0 and float(torch.exp(top - torch.logsumexp(logits, -1))) < p_min:  # the top token's probability
            break
        proposal.append(int(tok))
        feed = [int(tok)]
    return proposal


def _finish(out: Speculated, stop_ids: tuple[int, ...], max_new_tokens: int, start: float) -> Speculated:
    out.decode_s = time.perf_counter() - start - out.prefill_s
    ids = out.ids[:max_new_tokens]
    cut = next((i for i, t in enumerate(ids) if t in stop_ids), len(ids))
    out.ids = ids[:cut]
    return out


def draft_acceptance(target_choice: np.ndarray, draft_choice: np.ndarray, max_k: int = 8) -> dict[str, float]:
    """How a draft would fare against its target over windows where both read the same text:
    `target_choice`/`draft_choice` (windows, T) are each model's argmax at every position.

    `draft_top1_agreement`: the share of positions where they agree (a drafted token is accepted
    when it equals the target's choice). For draft length k, greedy speculation walks each window:
    at position p it keeps r = the run of agreements from p (at most k) plus the target's token,
    and moves on r + 1. `draft_accepted_k{k}` is the mean r per verification, `draft_tokens_per_call_k{k}`
    the tokens each target forward yields (r + 1)."""
    agree = np.asarray(target_choice) == np.asarray(draft_choice)
    metrics = {"draft_top1_agreement": float(agree.mean())}
    runs = [_runs(row) for row in agree]
    for k in range(1, max_k + 1):
        kept = [min(int(run[p]), k) for run in runs for p in _walk(run, k)]
        metrics[f"draft_accepted_k{k}"] = float(np.mean(kept))
        metrics[f"draft_tokens_per_call_k{k}"] = float(np.mean(kept)) + 1.0
    return metrics


def _runs(agree: np.ndarray) -> np.ndarray:
    """run[p] = how many consecutive agreements start at p."""
    run = np.zeros(len(agree) + 1, dtype=np.int64)
    for p in range(len(agree) - 1, -1, -1):
        run[p] = run[p + 1] + 1 if agree[p] else 0
    return run[:-1]


def _walk(run: np.ndarray, k: int) -> list[int]:
    """The positions where greedy speculation with draft length k verifies, along one window."""
    at, stops = 0, []
    while at < len(run):
        stops.append(at)
        at += min(int(run[at]), k) + 1
    return stops


def complete_speculative(
    target: PackedLlama,
    draft: PackedLlama,
    decode: Callable[[list[int]], str],
    prompt_ids: Sequence[int],
    max_new_tokens: int,
    k: int,
    stop_ids: tuple[int, ...] = (),
    stop_strings: Sequence[str] = (),
    p_min: float = 0.0,
) -> tuple[Completion, Speculated]:
    """`sampling.complete` for greedy decoding with a draft: the same ids, text and stop rules."""
    spec = speculative_greedy(target, draft, prompt_ids, max_new_tokens, k, stop_ids, p_min)
    text = decode(spec.ids)
    cut = find_stop(text, stop_strings)
    stopped_by_id = len(spec.ids) < max_new_tokens
    reason = "stop_string" if cut is not None else "stop_id" if stopped_by_id else "length"
    return Completion(spec.ids, text if cut is None else text[:cut], reason, spec.prefill_s, spec.decode_s), spec
