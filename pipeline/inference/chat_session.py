"""Multi-turn chat with the GGUF's chat template, streaming, and the KV cache kept across turns.

Each turn renders the whole conversation with the template (as llama.cpp's server does), tokenizes
it, and feeds the model only the tokens after the longest prefix already in the cache: the
previous turns' prompt and answer tokens are computed once. The cache holds exactly the ids fed
so far (`ChatSession.fed`); when the re-rendered history differs from them (a template that
rewrites earlier turns, or the answer's text re-tokenizing differently) the cache is cut back to
the common prefix, so the result always equals a fresh run over the rendered text.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from pipeline.errors import ConfigError, problem
from pipeline.inference.sampling import Sampling, last_logits, new_cache, pick_next
from pipeline.models.transformer import KVCache
from pipeline.tokenizer.chat_template import default_stop_ids, render_messages
from pipeline.tokenizer.gguf_tokenizer import GGUFTokenizer


@dataclass
class TurnStats:
    """What a turn cost: prompt tokens fed vs reused from the cache, and the answer's length."""

    prompt_tokens: int  # the whole rendered conversation
    new_prompt_tokens: int  # fed to the model this turn
    reused_tokens: int  # already in the cache
    answer_tokens: int
    seconds: float
    stop_reason: str  # stop_id | length


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def truncate_cache(cache: KVCache, length: int) -> None:
    """Keep the first `length` positions of every layer's keys and values."""
    if hasattr(cache, "truncate"):  # a packed decoder's preallocated cache
        cache.truncate(length)
        return
    for i, (k, v) in enumerate(zip(cache.k, cache.v)):
        if k is not None:
            cache.k[i], cache.v[i] = k[:, :, :length], v[:, :, :length]


def cap_answer(max_new_tokens: int, context_length: int) -> tuple[int, str]:
    """`max_new_tokens` capped at half the context, and a line saying so when it was.

    An answer longer than that would leave too little room for a prompt (on a 256-token model the
    default 256 leaves none, and every message would be refused); half is also what generate's
    sliding window keeps when the context fills.
    """
    half = max(1, context_length // 2)
    if max_new_tokens <= half:
        return max_new_tokens, ""
    return half, (
        f"chat: max_new_tokens={max_new_tokens} leaves too little of the model's context_length={context_length} "
        f"for a prompt; answers are capped at {half} tokens (half the context)"
    )


@dataclass
class ChatSession:
    """A conversation with `model`; `system` (optional) opens every conversation, `/reset` included."""

    model: nn.Module
    tok: GGUFTokenizer
    template: str
    sampling: Sampling = field(default_factory=Sampling)
    max_new_tokens: int = 256
    system: str = ""
    messages: list[dict[str, str]] = field(default_factory=list)
    fed: list[int] = field(default_factory=list)
    cache: KVCache | None = None
    note: str = field(default="", init=False)  # why max_new_tokens was capped, for the REPL to show

    def __post_init__(self) -> None:
        self.max_new_tokens, self.note = cap_answer(self.max_new_tokens, self.model.cfg.context_length)
        self.reset()
        self.stop_ids = default_stop_ids(self.tok, chat=True)
        self.generator = torch.Generator().manual_seed(self.sampling.seed)
        self._check_system()

    def _check_system(self) -> None:
        """A system message that leaves no room for a message and an answer is refused at the start, by
        name: otherwise every message, however short, was refused as too long."""
        if not self.system:
            return
        ctx = self.model.cfg.context_length
        used = len(self.prompt_ids([*self.messages, {"role": "user", "content": ""}]))
        if used + self.max_new_tokens >= ctx:
            raise ConfigError(
                problem(
                    "system",
                    f"a system message that leaves room for a message: the rendered system turn and max_new_tokens="
                    f"{self.max_new_tokens} below the model's context_length={ctx}",
                    f"{used} tokens before any message",
                    "shorten system (or leave it out), or lower max_new_tokens",
                )
            )

    def reset(self) -> None:
        """Forget the conversation and the cache."""
        self.messages = [{"role": "system", "content": self.system}] if self.system else []
        self.fed, self.cache = [], new_cache(self.model)

    def prompt_ids(self, messages: list[dict[str, str]] | None = None) -> list[int]:
        """The rendered conversation's ids (`messages`, or the session's own), ending with the assistant's cue."""
        chosen = self.messages if messages is None else messages
        text = render_messages(self.tok, self.template, chosen, add_generation_prompt=True)
        ids = self.tok.encode(text)
        if self.tok.add_bos and self.tok.bos_id is not None and ids[:1] != [self.tok.bos_id]:
            ids = [self.tok.bos_id, *ids]
        return ids

    def _fit(self, messages: list[dict[str, str]]) -> list[int]:
        """Drop the oldest exchanges (not the system turn) until the prompt and an answer fit the context.

        The session's conversation becomes `messages` only once they fit: a refused message leaves it
        as it was, so the REPL can go on with the next one.
        """
        ctx = self.model.cfg.context_length
        first = 1 if self.system else 0
        ids = self.prompt_ids(messages)
        while len(ids) + self.max_new_tokens > ctx and len(messages) > first + 1:
            messages = messages[:first] + messages[first + 2 :]
            ids = self.prompt_ids(messages)
        if len(ids) + self.max_new_tokens > ctx:
            raise ConfigError(
                problem(
                    "chat message",
                    f"a prompt of at most {ctx - self.max_new_tokens} tokens (context_length - max_new_tokens)",
                    f"{len(ids)} tokens",
                    "send a shorter message or lower max_new_tokens",
                )
            )
        self.messages = messages
        return ids

    def _feed(self, ids: list[int]) -> torch.Tensor:
        logits = last_logits(self.model, ids, self.cache)
        self.fed.extend(ids)
        return logits

    def _pick(self, logits: torch.Tensor, window: list[int]) -> int:
        """The next id by llama.cpp's sampler chain, the penalty over the last repetition_last_n ids."""
        s, last_n = self.sampling, self.sampling.repetition_last_n
        seen = [] if last_n == 0 else window if last_n < 0 else window[-last_n:]
        return pick_next(logits, s.temperature, s.top_k, self.generator, s.top_p, s.repetition_penalty, seen)

    @torch.inference_mode()
    def turn(self, text: str, on_text: Callable[[str], None] = lambda s: None) -> tuple[str, TurnStats]:
        """Answer `text`, calling `on_text` with each new piece of the answer as it is decoded."""
        start = time.perf_counter()
        self.model.eval()
        ids = self._fit([*self.messages, {"role": "user", "content": text}])
        keep = min(common_prefix(self.fed, ids), len(ids) - 1)  # at least one token is fed for the logits
        if keep < len(self.fed):
            truncate_cache(self.cache, keep)
            self.fed = self.fed[:keep]
        logits = self._feed(ids[keep:])
        answer, shown, reason = [], "", "length"
        while len(answer) < self.max_new_tokens:
            nxt = self._pick(logits, ids + answer)
            if nxt in self.stop_ids:
                reason = "stop_id"
                break
            answer.append(nxt)
            decoded = self.tok.decode(answer)
            if not decoded.endswith("\ufffd"):  # wait for the rest of a multi-byte character
                on_text(decoded[len(shown) :])
                shown = decoded
            if len(answer) < self.max_new_tokens:
                logits = self._feed([nxt])
        reply = self.tok.decode(answer)
        on_text(reply[len(shown) :])
        self.messages.append({"role": "assistant", "content": reply})
        stats = TurnStats(len(ids), len(ids) - keep, keep, len(answer), time.perf_counter() - start, reason)
        return reply, stats
