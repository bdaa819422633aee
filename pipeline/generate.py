"""Text sampling from our model: greedy or temperature + top-k, seeded."""

from __future__ import annotations

import torch

from pipeline.model import Llama


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
    """Continue `prompt_ids`; temperature 0 is greedy. Recomputes the window each step (small models)."""
    model.eval()
    device = next(model.parameters()).device
    generator = torch.Generator(device="cpu").manual_seed(seed)
    ids = list(prompt_ids)
    out: list[int] = []
    for _ in range(max_new_tokens):
        window = torch.tensor([ids[-model.cfg.context_length :]], device=device)
        logits = model(window)[0, -1].float().cpu()
        if temperature <= 0:
            nxt = int(logits.argmax())
        else:
            logits = logits / temperature
            if top_k > 0:
                kth = torch.topk(logits, min(top_k, logits.numel())).values[-1]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            nxt = int(torch.multinomial(torch.softmax(logits, -1), 1, generator=generator))
        if nxt in stop_ids:
            break
        ids.append(nxt)
        out.append(nxt)
    return out
