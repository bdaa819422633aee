"""Text generation from our model with a KV cache, sampled the way llama.cpp samples.

The sampler follows llama.cpp's default chain (and llama-cpp-python's): repetition penalty over
the last N tokens (prompt included), then greedy when temperature is 0, else top-k -> top-p ->
temperature -> draw. Note that top-p is therefore taken on the *untempered* distribution, as in
llama.cpp (transformers applies the temperature first).
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from pipeline.errors import ConfigError, GGUFError, problem
from pipeline.model import KVCache

if TYPE_CHECKING:
    from pipeline.config import GenerateConfig
    from pipeline.tokenizer import GGUFTokenizer

CHAT_END_TOKEN = "<|im_end|>"  # ChatML's end of turn: a stop id for chat when the vocabulary has it


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


def _last_logits(model: nn.Module, ids: list[int], cache: KVCache | None, device: torch.device) -> torch.Tensor:
    return model(torch.tensor([ids], device=device), cache)[0, -1].float().cpu()


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
    device = next(model.parameters()).device
    generator = torch.Generator(device="cpu").manual_seed(sampling.seed)
    ctx = model.cfg.context_length
    window = list(prompt_ids)[-ctx:]
    cache = KVCache(model.cfg.n_layer) if use_cache else None
    logits = _last_logits(model, window, cache, device)
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
            cache = KVCache(model.cfg.n_layer) if use_cache else None
            logits = _last_logits(model, window, cache, device)
        elif use_cache:
            logits = _last_logits(model, [nxt], cache, device)
        else:
            logits = _last_logits(model, window, None, device)


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


# ----- the generate stage: model + tokenizer from a path, prompt, stops -----


def load_for_generation(model_path: str, tokenizer_gguf: str = "smollm2") -> tuple[nn.Module, GGUFTokenizer, dict]:
    """(model, tokenizer, tokenizer GGUF metadata) from a GGUF, or from a checkpoint directory
    (`realize.save_model`) whose tokenizer is `tokenizer_gguf`, or a fine-tune's directory (base +
    adapters, with the base's tokenizer). `smollm2` names the donor GGUF."""
    from pipeline.architectures import load_gguf
    from pipeline.finetune import is_finetune_dir, load_any, read_spec
    from pipeline.gguf_io import GGUFFile, resolve_gguf_path
    from pipeline.tokenizer import tokenizer_from_gguf

    path = resolve_gguf_path(model_path)
    if not path.exists():
        raise ConfigError(
            problem(
                f"model_path={model_path}",
                "a GGUF file or a checkpoint directory (config.json + model.safetensors)",
                "no such file or directory",
                "check the path, or use model_path=smollm2",
            )
        )
    try:
        if path.is_dir():  # a fine-tune (base + adapters) brings its base's tokenizer
            model = load_any(path)
            g = GGUFFile(read_spec(path).base if is_finetune_dir(path) else resolve_gguf_path(tokenizer_gguf))
        else:
            model, g = load_gguf(path)
    except OSError as e:
        found = f"{type(e).__name__}: {e}"
        fix = "check the path and its permissions"
        raise GGUFError(problem(str(path), "a readable model file", found, fix)) from None
    tok = tokenizer_from_gguf(g)
    if tok.vocab_size > model.cfg.vocab_size:
        raise ConfigError(
            problem(
                f"tokenizer_gguf={tokenizer_gguf}",
                f"a tokenizer of at most the model's {model.cfg.vocab_size} ids",
                f"{tok.vocab_size} ids",
                "use the GGUF the model's vocabulary came from",
            )
        )
    return model, tok, g.metadata


def chat_prompt(metadata: dict[str, Any], tok: GGUFTokenizer, prompt: str, system: str = "") -> str:
    """`prompt` (and an optional system prompt) rendered with the GGUF's chat template."""
    from pipeline.chat import ChatTemplateError, render_chat

    template = metadata.get("tokenizer.chat_template")
    if not template:
        raise ChatTemplateError(
            problem(
                "chat=true",
                "a GGUF with a tokenizer.chat_template",
                "none in this file's metadata",
                "use chat=false, or a GGUF with a chat template (tokenizer_gguf=...)",
            )
        )
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
    bos = tok.id_to_token(tok.bos_id) if tok.bos_id is not None else ""
    eos = tok.id_to_token(tok.eos_id) if tok.eos_id is not None else ""
    return render_chat(str(template), messages, bos, eos, add_generation_prompt=True)


def encode_prompt(tok: GGUFTokenizer, text: str, context_length: int) -> list[int]:
    """Prompt ids with BOS when the tokenizer asks for it (not twice if the text already has it)."""
    ids = tok.encode(text)
    if tok.add_bos and tok.bos_id is not None and ids[:1] != [tok.bos_id]:
        ids = [tok.bos_id, *ids]
    if not ids:
        raise ConfigError(problem("prompt", "at least one token", "an empty prompt", 'give a prompt="..."'))
    if len(ids) > context_length:
        raise ConfigError(
            problem(
                "prompt",
                f"at most the model's context_length={context_length} tokens",
                f"{len(ids)} tokens",
                "shorten the prompt",
            )
        )
    return ids


_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "\\": "\\"}


def unescape(text: str) -> str:
    """`\\n`, `\\t`, `\\r`, `\\\\` typed on a command line as the characters (as llama.cpp does)."""
    return re.sub(r"\\([ntr\\])", lambda m: _ESCAPES[m.group(1)], text)


def default_stop_ids(tok: GGUFTokenizer, chat: bool) -> tuple[int, ...]:
    """EOS, and for chat the end-of-turn token when the vocabulary has one."""
    stops = [tok.eos_id] if tok.eos_id is not None else []
    end_turn = tok.token_to_id(CHAT_END_TOKEN) if chat else None
    if end_turn is not None and end_turn not in stops:
        stops.append(end_turn)
    return tuple(stops)


def run_generate(cfg: GenerateConfig) -> dict[str, Any]:
    """The generate stage: load, build the prompt, generate; returns what `generate.json` holds."""
    from pipeline.train import pick_device

    if cfg.threads > 0:
        torch.set_num_threads(cfg.threads)
    model, tok, metadata = load_for_generation(cfg.model_path, cfg.tokenizer_gguf)
    model.to(device=pick_device(cfg.device), dtype=torch.bfloat16 if cfg.precision == "bf16" else torch.float32)
    text = chat_prompt(metadata, tok, cfg.prompt, cfg.system) if cfg.chat else cfg.prompt
    prompt_ids = encode_prompt(tok, text, model.cfg.context_length)
    stop_ids = tuple(cfg.stop_ids) if cfg.stop_ids is not None else default_stop_ids(tok, cfg.chat)
    sampling = Sampling(cfg.temperature, cfg.top_k, cfg.top_p, cfg.repetition_penalty, cfg.repetition_last_n, cfg.seed)
    stops = [unescape(s) for s in cfg.stop]
    done = complete(model, tok.decode, prompt_ids, cfg.max_new_tokens, sampling, stop_ids, stops, cfg.cache)
    return {
        "model_path": str(Path(cfg.model_path)) if cfg.model_path != "smollm2" else "smollm2",
        "prompt": cfg.prompt,
        "rendered_prompt": text,
        "prompt_ids": prompt_ids,
        "completion": done.text,
        "ids": done.ids,
        "n_tokens": len(done.ids),
        "stop_reason": done.stop_reason,
        "stop_ids": list(stop_ids),
        "stop": stops,
        "prefill_s": round(done.prefill_s, 4),
        "decode_s": round(done.decode_s, 4),
        "tokens_per_s": round(done.tokens_per_s, 2),
        "decode_tokens_per_s": round(done.decode_tokens_per_s, 2),
    }
