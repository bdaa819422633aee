"""Text sampling from our model with a KV cache: greedy or temperature + top-k, seeded."""

from __future__ import annotations

import torch

from pipeline.model import KVCache, Llama


def pick_next(logits: torch.Tensor, temperature: float, top_k: int, generator: torch.Generator) -> int:
    """Greedy when temperature <= 0, else sample from the (top-k truncated) tempered softmax."""
    if temperature <= 0:
        return int(logits.argmax())
    logits = logits / temperature
    if 0 < top_k < logits.numel():
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return int(torch.multinomial(torch.softmax(logits, -1), 1, generator=generator))


@torch.no_grad()
def generate_ids(
    model: Llama,
    prompt_ids: list[int],
    max_new_tokens: int,
    temperature: float = 0.0,
    top_k: int = 0,
    seed: int = 0,
    stop_ids: tuple[int, ...] = (),
) -> list[int]:
    """Continue `prompt_ids` (at least one id). When the context fills up, the cache is rebuilt
    from the last half of the context (a sliding window)."""
    model.eval()
    device = next(model.parameters()).device
    generator = torch.Generator(device="cpu").manual_seed(seed)
    ctx = model.cfg.context_length
    ids = list(prompt_ids)[-ctx:]
    cache = KVCache(model.cfg.n_layer)
    logits = model(torch.tensor([ids], device=device), cache)[0, -1]
    out: list[int] = []
    for _ in range(max_new_tokens):
        nxt = pick_next(logits.float().cpu(), temperature, top_k, generator)
        if nxt in stop_ids:
            break
        ids.append(nxt)
        out.append(nxt)
        if cache.length >= ctx:
            ids = ids[-(ctx // 2) :]
            cache = KVCache(model.cfg.n_layer)
            logits = model(torch.tensor([ids], device=device), cache)[0, -1]
        else:
            logits = model(torch.tensor([[nxt]], device=device), cache)[0, -1]
    return out
