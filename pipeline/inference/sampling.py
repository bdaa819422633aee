"""Decoding: next tokens from any of our models with a KV cache, sampled the way llama.cpp samples.

The sampler follows llama.cpp's default chain (and llama-cpp-python's): repetition penalty over
the last N tokens (prompt included), then greedy when temperature is 0, else top-k -> top-p ->
temperature -> draw. Note that top-p is therefore taken on the *untempered* distribution, as in
llama.cpp (transformers applies the temperature first).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from pipeline.models.transformer import KVCache


@dataclass(frozen=True)
class Sampling:
    """How each next token is chosen. `repetition_last_n`: 0 disables the penalty, -1 = whole context."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    repetition_penalty: float = 1.0
    repetition_last_n: int = 64
    seed: int = 0


def penalize_repetition(logits: torch.Tensor, seen: Sequence[int], penalty: float) -> torch.Tensor:
    """CTRL / llama.cpp repetition penalty: each distinct seen token's logit is divided by `penalty`
    if positive, multiplied if not (so penalty > 1 always makes it less likely)."""
    if penalty == 1.0 or not seen:
        return logits
    idx = torch.tensor(sorted(set(seen)), dtype=torch.long)
    vals = logits[idx]
    out = logits.clone()
    out[idx] = torch.where(vals > 0, vals / penalty, vals * penalty)
    return out


def top_k_filter(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Exactly the `k` largest logits kept (ties broken by position), the rest -inf; k <= 0: all."""
    if k <= 0 or k >= logits.numel():
        return logits
    vals, idx = torch.topk(logits, k)
    return torch.full_like(logits, float("-inf")).scatter(0, idx, vals)


def top_p_filter(logits: torch.Tensor, p: float) -> torch.Tensor:
    """Nucleus: keep the smallest set of most likely tokens whose probabilities sum to >= p."""
    if p >= 1.0:
        return logits
    probs, order = torch.sort(torch.softmax(logits.float(), -1), descending=True)
    before = torch.cumsum(probs, 0) - probs  # mass of the strictly more likely tokens
    keep_sorted = before < p  # the first token always stays (0 < p)
    keep = torch.zeros_like(keep_sorted).scatter(0, order, keep_sorted)
    return logits.masked_fill(~keep, float("-inf"))


def pick_next(
    logits: torch.Tensor,
    temperature: float,
    top_k: int,
    generator: torch.Generator,
    top_p: float = 1.0,
    repetition_penalty: float = 1.0,
    seen: Sequence[int] = (),
) -> int:
    """One token id from 1-D `logits` by llama.cpp's sampler chain (see the module docstring)."""
    logits = penalize_repetition(logits.float(), seen, repetition_penalty)
    if temperature <= 0:
        return int(logits.argmax())
    logits = top_p_filter(top_k_filter(logits, top_k), top_p)
    probs = torch.softmax(logits / temperature, -1)
    return int(torch.multinomial(probs, 1, generator=generator))


def _recent(window: list[int], last_n: int) -> list[int]:
    if last_n == 0:
        return []
    return window if last_n < 0 else window[-last_n:]


def model_device(model: nn.Module) -> torch.device:
    """Where the model's weights are (a packed decoder says so; a module has parameters)."""
    device = getattr(model, "device", None)
    return device if isinstance(device, torch.device) else next(model.parameters()).device


def new_cache(model: nn.Module) -> KVCache:
    """An empty KV cache of the kind the model writes (a packed decoder's preallocated one)."""
    return model.new_cache() if hasattr(model, "new_cache") else KVCache(model.cfg.n_layer)


def last_logits(model: nn.Module, ids: Sequence[int], cache: KVCache | None, on_device: bool = False) -> torch.Tensor:
    """fp32 logits (vocab,) after `ids`, which continue what `cache` holds, on the CPU (or left on the
    model's device: greedy reads only the argmax); a packed decoder runs its head on the last position only."""
    x = torch.tensor([list(ids)], device=model_device(model))
    out = model(x, cache, last_only=True) if hasattr(model, "new_cache") else model(x, cache)
    return out[0, -1].float() if on_device else out[0, -1].float().cpu()


@torch.inference_mode()
def stream_ids(
    model: nn.Module, prompt_ids: Sequence[int], sampling: Sampling, use_cache: bool = True
) -> Iterator[int]:
    """Yield new token ids one by one, without end: the caller decides when to stop, and the next
    forward pass only runs when the next id is asked for.

    With `use_cache=False` every step recomputes the whole window (slow; for checking the cache).
    When the context fills up, the window restarts from its last half (a sliding window) in both
    modes, so they give identical ids.
    """
    if not prompt_ids:
        raise ValueError("generation needs at least one prompt token")
    model.eval()
    generator = torch.Generator(device="cpu").manual_seed(sampling.seed)
    ctx = model.cfg.context_length
    window = list(prompt_ids)[-ctx:]
    cache = new_cache(model) if use_cache else None
    greedy = sampling.temperature <= 0 and sampling.repetition_penalty == 1.0  # the argmax is taken on the device
    logits = last_logits(model, window, cache, greedy)
    while True:
        nxt = pick_next(
            logits,
            sampling.temperature,
            sampling.top_k,
            generator,
            sampling.top_p,
            sampling.repetition_penalty,
            _recent(window, sampling.repetition_last_n),
        )
        yield nxt
        window.append(nxt)
        if len(window) > ctx:
            window = window[-(ctx // 2) :]
            cache = new_cache(model) if use_cache else None
            logits = last_logits(model, window, cache, greedy)
        elif use_cache:
            logits = last_logits(model, [nxt], cache, greedy)
        else:
            logits = last_logits(model, window, None, greedy)


def generate_ids(
    model: nn.Module,
    prompt_ids: list[int],
    max_new_tokens: int,
    temperature: float = 0.0,
    top_k: int = 0,
    seed: int = 0,
    stop_ids: tuple[int, ...] = (),
    *,
    top_p: float = 1.0,
    repetition_penalty: float = 1.0,
    repetition_last_n: int = 64,
    use_cache: bool = True,
) -> list[int]:
    """Up to `max_new_tokens` new ids after `prompt_ids` (at least one id); a stop id ends the
    continuation and is not included."""
    sampling = Sampling(temperature, top_k, top_p, repetition_penalty, repetition_last_n, seed)
    out: list[int] = []
    if max_new_tokens <= 0:
        return out
    for nxt in stream_ids(model, prompt_ids, sampling, use_cache):
        if nxt in stop_ids:
            break
        out.append(nxt)
        if len(out) >= max_new_tokens:
            break
    return out


def find_stop(text: str, stops: Sequence[str]) -> int | None:
    """Index where the earliest stop string starts in `text`, or None."""
    hits = [i for i in (text.find(s) for s in stops if s) if i >= 0]
    return min(hits) if hits else None


@dataclass
class Completion:
    """What `complete` produced: the sampled ids (a stop id excluded), the text (trimmed before a
    stop string), why it ended, and timings (prefill = prompt pass + first token)."""

    ids: list[int]
    text: str
    stop_reason: str  # "length" | "stop_id" | "stop_string"
    prefill_s: float
    decode_s: float

    @property
    def tokens_per_s(self) -> float:
        """New tokens over the whole generation time, prompt pass included."""
        total = self.prefill_s + self.decode_s
        return len(self.ids) / total if total > 0 else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        """Tokens after the first over their time: the steady decode rate (llama.cpp's "eval")."""
        return (len(self.ids) - 1) / self.decode_s if len(self.ids) > 1 and self.decode_s > 0 else 0.0


def complete(
    model: nn.Module,
    decode: Callable[[list[int]], str],
    prompt_ids: Sequence[int],
    max_new_tokens: int,
    sampling: Sampling,
    stop_ids: Sequence[int] = (),
    stop_strings: Sequence[str] = (),
    use_cache: bool = True,
) -> Completion:
    """Generate until `max_new_tokens`, a stop id, or a stop string appears in the decoded text
    (the text is cut where the stop string starts; the stop string is not included)."""
    ids: list[int] = []
    reason, text = "length", ""
    start = time.perf_counter()
    first = start
    stream = stream_ids(model, prompt_ids, sampling, use_cache)
    for nxt in stream:
        if not ids:
            first = time.perf_counter()
        if nxt in stop_ids:
            reason = "stop_id"
            break
        ids.append(nxt)
        if stop_strings:
            text = decode(ids)
            cut = find_stop(text, stop_strings)
            if cut is not None:
                text, reason = text[:cut], "stop_string"
                break
        if len(ids) >= max_new_tokens:
            break
    end = time.perf_counter()
    stream.close()
    if reason != "stop_string":
        text = decode(ids)
    return Completion(ids, text, reason, first - start, end - first)
