"""The generate tool (`python -m stages.generate`): a model and its tokenizer from a path, a prompt
(optionally through the chat template), llama.cpp-style sampling, stop ids and strings."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch
from torch import nn

from pipeline.config import GenerateConfig
from pipeline.donor.locate import resolve_gguf_path
from pipeline.errors import ChatTemplateError, ConfigError, GGUFError, problem
from pipeline.finetune.adapters import Adapter, apply_adapter, read_adapter_gguf, read_peft_adapter
from pipeline.gguf.reader import GGUFFile
from pipeline.inference.decode import PackedLlama, for_decoding
from pipeline.inference.sampling import Sampling, complete, model_device
from pipeline.inference.speculative import complete_speculative
from pipeline.modeldir import CONFIG_FILE, MODEL_FILE, is_finetune_dir, load_model_dir, read_spec
from pipeline.models.devices import pick_device
from pipeline.models.registry import load_gguf
from pipeline.tokenizer.chat_template import default_stop_ids, render_messages
from pipeline.tokenizer.gguf_tokenizer import GGUFTokenizer, tokenizer_from_gguf
from pipeline.tokenizer.spans import Span, encode_spans, render_spans


def load_for_generation(
    model_path: str, tokenizer_gguf: str = "smollm2", lora: str = ""
) -> tuple[nn.Module, GGUFTokenizer, dict]:
    """(model, tokenizer, tokenizer GGUF metadata) from a GGUF, or from a model directory whose
    tokenizer is `tokenizer_gguf`, or a fine-tune's directory (base + adapters, with the base's
    tokenizer). `smollm2` names the donor GGUF. `lora`: a LoRA adapter (llama.cpp GGUF or PEFT
    directory) applied on top, as `llama-cli --lora` does."""
    path = resolve_gguf_path(model_path)
    if not path.exists():
        raise ConfigError(
            problem(
                f"model_path={model_path}",
                "a GGUF file or a model directory (config.json + model.safetensors)",
                "no such file or directory",
                "check the path, or use model_path=smollm2",
            )
        )
    try:
        refuse_non_model(path, model_path)
        if path.is_dir():  # a fine-tune (base + adapters) brings its base's tokenizer
            model = load_model_dir(path)
            g = GGUFFile(read_spec(path).base if is_finetune_dir(path) else resolve_gguf_path(tokenizer_gguf))
        else:
            model, g = load_gguf(path)
    except OSError as e:
        raise GGUFError(
            problem(str(path), "a readable model file", f"{type(e).__name__}: {e}", "check the path")
        ) from None
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
    if lora:
        apply_adapter(model, read_adapter(Path(lora).expanduser(), model))
    return model, tok, g.metadata


def refuse_non_model(path: Path, model_path: str) -> None:
    """A LoRA adapter given as the model (`model_path=models/export/adapter.gguf` or `.../peft`) is named as
    one, with the `lora=` it belongs in: loading it as a model said a metadata key or config.json was missing.
    Any other folder is named as not a model (the fix was "run the stage that writes it")."""
    if path.is_dir():
        adapter = (path / "adapter_config.json").is_file() and not (path / "config.json").is_file()
    else:
        adapter = GGUFFile(path).metadata.get("general.type") == "adapter"
    if adapter:
        raise ConfigError(
            problem(
                f"model_path={model_path}",
                "a model (a GGUF or a model directory)",
                "a LoRA adapter, which holds no base weights",
                f"give the base as model_path and this as lora, e.g. model_path=smollm2 lora={model_path}",
            )
        )
    if path.is_dir() and not ((path / CONFIG_FILE).is_file() or is_finetune_dir(path)):  # not ours at all
        raise ConfigError(
            problem(
                f"model_path={model_path}",
                f"a GGUF file or a model directory ({CONFIG_FILE} + {MODEL_FILE}, as realize and train write)",
                f"a directory without {CONFIG_FILE}",
                "point model_path at a .gguf (e.g. models/export/model.gguf) or at models/train",
            )
        )


def read_adapter(path: Path, model: nn.Module) -> Adapter:
    """A LoRA adapter from a llama.cpp adapter GGUF or a PEFT directory."""
    if not path.exists():
        raise ConfigError(
            problem(
                f"lora={path}", "a LoRA adapter GGUF or a PEFT directory", "no such file or directory", "check lora"
            )
        )
    return read_peft_adapter(path, model.cfg) if path.is_dir() else read_adapter_gguf(path)


def chat_prompt(metadata: dict[str, Any], tok: GGUFTokenizer, prompt: str, system: str = "") -> str:
    """`prompt` (and an optional system prompt) rendered with the GGUF's chat template."""
    return render_messages(tok, _template(metadata), _messages(prompt, system), add_generation_prompt=True)


def prompt_spans(metadata: dict[str, Any], tok: GGUFTokenizer, cfg: GenerateConfig) -> list[Span]:
    """The prompt as spans (`pipeline.tokenizer.spans`): the prompt and system text are untrusted (typed
    special tokens stay text) unless `parse_special`; a chat template's own text is trusted."""
    if not cfg.chat:
        return [(cfg.prompt, cfg.parse_special)]
    if cfg.parse_special:
        return [(chat_prompt(metadata, tok, cfg.prompt, cfg.system), True)]
    return render_spans(tok, _template(metadata), _messages(cfg.prompt, cfg.system), add_generation_prompt=True)


def _messages(prompt: str, system: str) -> list[dict[str, str]]:
    return ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]


def _template(metadata: dict[str, Any]) -> str:
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
    return str(template)


def encode_prompt(tok: GGUFTokenizer, prompt: str | list[Span], context_length: int) -> list[int]:
    """Prompt ids with BOS when the tokenizer asks for it (not twice if the text already has it);
    a `str` prompt is trusted (its special tokens matched), spans say which text is."""
    ids = encode_spans(tok, [(prompt, True)] if isinstance(prompt, str) else prompt)
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


def check_stop_ids(stop_ids: tuple[int, ...], vocab_size: int) -> None:
    """An id the model cannot produce never stops anything: a typo'd stop_ids would silently run to max_new_tokens."""
    bad = [i for i in stop_ids if not 0 <= i < vocab_size]
    if bad:
        raise ConfigError(
            problem(
                "stop_ids",
                f"token ids in [0, {vocab_size}) (the model's vocabulary)",
                ", ".join(map(str, bad)),
                "use ids the tokenizer gives (e.g. the EOS id), or stop=['text'] for a stop string",
            )
        )


def run_generate(cfg: GenerateConfig) -> dict[str, Any]:
    """The generate stage: load, build the prompt, generate; returns what `generate.json` holds."""
    if cfg.threads > 0:
        torch.set_num_threads(cfg.threads)
    model, tok, metadata = load_for_generation(cfg.model_path, cfg.tokenizer_gguf, cfg.lora)
    model = for_decoding(model, cfg.precision, pick_device(cfg.device))
    spans = prompt_spans(metadata, tok, cfg)
    text = "".join(t for t, _ in spans)
    prompt_ids = encode_prompt(tok, spans, model.cfg.context_length)
    stop_ids = tuple(cfg.stop_ids) if cfg.stop_ids is not None else default_stop_ids(tok, cfg.chat)
    check_stop_ids(stop_ids, model.cfg.vocab_size)
    sampling = Sampling(cfg.temperature, cfg.top_k, cfg.top_p, cfg.repetition_penalty, cfg.repetition_last_n, cfg.seed)
    stops = [unescape(s) for s in cfg.stop]
    spec: dict[str, Any] = {}
    if cfg.draft:
        draft = load_draft(cfg, tok, model)
        done, s = complete_speculative(
            model, draft, tok.decode, prompt_ids, cfg.max_new_tokens, cfg.draft_k, stop_ids, stops, cfg.draft_p_min
        )
        spec = {
            "draft": cfg.draft,
            "draft_k": cfg.draft_k,
            "draft_p_min": cfg.draft_p_min,
            "drafted": s.drafted,
            "accepted": s.accepted,
            "acceptance": round(s.acceptance, 4),
            "target_calls": s.target_calls,
        }
    else:
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
        **spec,
    }


def load_draft(cfg: GenerateConfig, tok: GGUFTokenizer, target: nn.Module) -> nn.Module:
    """The draft model, packed for `draft_precision`; it must tokenize exactly as the target does."""
    draft, draft_tok, _ = load_for_generation(cfg.draft, cfg.tokenizer_gguf)
    draft = for_decoding(draft, cfg.draft_precision, model_device(target))
    if not (isinstance(target, PackedLlama) and isinstance(draft, PackedLlama)):
        found = f"{type(target.cfg).__name__ if hasattr(target, 'cfg') else type(target).__name__} models"
        raise ConfigError(problem(f"draft={cfg.draft}", "llama models (model_path and draft)", found, "drop draft"))
    if draft_tok.fingerprint() != tok.fingerprint() or draft.cfg.vocab_size != target.cfg.vocab_size:
        raise ConfigError(
            problem(
                f"draft={cfg.draft}",
                f"a model with model_path's tokenizer ({target.cfg.vocab_size} tokens)",
                f"another tokenizer ({draft.cfg.vocab_size} tokens)",
                "use a student of this donor (its export shares the donor's vocabulary)",
            )
        )
    return draft
