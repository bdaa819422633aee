"""Our models inside lm-evaluation-harness: `--model smollm-gguf --model_args path=<file.gguf>`.

lm-eval is an optional extra (`pip install .[eval]`), so this is the one module that imports it,
and only when the model class is first asked for (`GGUFLM`, a PEP 562 module attribute, or
`model_class()`): `pipeline` imports without lm-eval. How lm-eval finds the class:

- releases that read the `lm_eval.models` entry-point group (lm-eval's plugin guide, after 0.4.13)
  find `smollm-gguf = "pipeline.evaluate.lmeval:GGUFLM"` declared in pyproject.toml;
- 0.4.13, the newest on PyPI, has no plugin discovery: `python -m stages.lmeval` (console script
  `smollm-lm-eval`) registers the class, then runs lm-eval's own CLI on the same arguments.

Scoring is `pipeline.evaluate.lmscore` (batched, longest first); generation is `pipeline.inference.sampling`
(the product's sampler with its KV cache); `--apply_chat_template` renders with the GGUF's own
template through `pipeline.tokenizer.chat_template`.
"""

from __future__ import annotations

import importlib
import logging
from functools import cache
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from tqdm import tqdm

from pipeline.donor.locate import resolve_gguf_path
from pipeline.errors import ConfigError, PipelineError, problem
from pipeline.evaluate.lmscore import Pair, score_continuations
from pipeline.inference.generate import load_for_generation
from pipeline.inference.sampling import Sampling, complete
from pipeline.models.devices import pick_device
from pipeline.tokenizer.chat_template import default_stop_ids, render_messages

MODEL_NAME = "smollm-gguf"
log = logging.getLogger(__name__)
DEFAULT_BATCH = 16  # `--batch_size auto`; lm-eval's own default is 1
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
MODEL_ARGS = ("path", "dtype", "max_length", "lora")
INSTALL = "pip install '.[eval]' (lm-eval)"


def lm_eval_module(name: str = "lm_eval") -> ModuleType:
    """Import `name` from lm-eval, or a one-line error naming the extra to install."""
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as e:
        if e.name is None or e.name.split(".")[0] != "lm_eval":
            raise
        raise PipelineError(problem(f"--model {MODEL_NAME}", "lm-eval installed", "it is not", INSTALL)) from None


def _batch_size(value: int | str | None) -> int:
    if value is None or str(value).startswith("auto"):
        return DEFAULT_BATCH
    try:
        size = int(value)
    except ValueError:
        size = 0
    if size < 1:
        raise ConfigError(problem("--batch_size", "a positive integer or auto", repr(value), "e.g. --batch_size 16"))
    return size


def _device(name: str | None) -> torch.device:
    """The device asked for, or the best one here when it is unavailable: lm-eval's CLI always asks
    for cuda:0, so (as lm-eval's own HF model does) a CPU-only machine falls back, and logs it."""
    try:
        return pick_device(name or "auto")
    except ConfigError:
        device = pick_device("auto")
        log.info("%s: device %s is unavailable here, using %s", MODEL_NAME, name, device)
        return device


class GGUFMethods:
    """lm-eval's model interface (TemplateLM's abstract methods) on one of our models: a GGUF, a model
    directory or a fine-tune's directory as `stages.generate` loads them (`lora=` adds an adapter)."""

    def __init__(
        self,
        path: str = "",
        batch_size: int | str | None = None,
        device: str | None = None,
        dtype: str = "float32",
        max_length: int = 0,
        lora: str = "",
        max_batch_size: int | None = None,
        **unknown: Any,
    ) -> None:
        super().__init__()
        if unknown:
            raise ConfigError(
                problem("--model_args", f"keys among {', '.join(MODEL_ARGS)}", ", ".join(unknown), "drop or fix them")
            )
        if not path or not resolve_gguf_path(str(path)).exists():
            raise ConfigError(
                problem(f"--model_args path={path}", "a GGUF file or model directory", "no such file", _PATH_FIX)
            )
        if dtype not in DTYPES:
            raise ConfigError(problem("--model_args dtype", f"one of {', '.join(DTYPES)}", repr(dtype), "drop it"))
        self.path = str(path)
        self.model, self.tok, self.metadata = load_for_generation(str(path), lora=lora)
        self._device = _device(device)
        self.model.to(device=self._device, dtype=DTYPES[dtype])
        self.batch_size = _batch_size(batch_size)
        self._max_length = int(max_length) or self.model.cfg.context_length

    @property
    def eot_token_id(self) -> int:
        return self.tok.eos_id if self.tok.eos_id is not None else 0

    @property
    def prefix_token_id(self) -> int:
        """What an empty context starts from: BOS when the vocabulary has one (as lm-eval's HF model)."""
        return self.tok.bos_id if self.tok.bos_id is not None else self.eot_token_id

    @property
    def max_length(self) -> int:
        return min(self._max_length, self.model.cfg.context_length)

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs: Any) -> list[int]:
        """Ids as llama.cpp tokenizes (special tokens in the text matched: chat templates write them),
        with BOS when the GGUF asks for it, unless `add_special_tokens=False`."""
        ids = self.tok.encode(string)
        bos = self.tok.bos_id
        if add_special_tokens is not False and self.tok.add_bos and bos is not None and ids[:1] != [bos]:
            ids = [bos, *ids]
        return ids

    def tok_decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids)

    def _loglikelihood_tokens(self, requests: list[tuple[Any, list[int], list[int]]], disable_tqdm: bool = False):
        pairs: list[Pair] = [(ctx, cont) for _, ctx, cont in requests]
        results = self._score(pairs, "loglikelihood", disable_tqdm)
        for (key, _, _), result in zip(requests, results):
            self.cache_hook.add_partial("loglikelihood", key, result)
        return results

    def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False) -> list[float]:
        """A whole document's log-likelihood in disjoint windows of the context (lm-eval's own windowing)."""
        utils = lm_eval_module("lm_eval.utils")
        pairs: list[Pair] = []
        owner: list[int] = []
        for n, req in enumerate(requests):
            ids = self.tok_encode(req.args[0], add_special_tokens=False)
            windows = utils.get_rolling_token_windows(ids, self.prefix_token_id, self.max_length, 1)
            for window in map(utils.make_disjoint_window, windows):
                pairs.append(window)
                owner.append(n)
        totals = [0.0] * len(requests)
        for n, (logprob, _) in zip(owner, self._score(pairs, "loglikelihood_rolling", disable_tqdm)):
            totals[n] += logprob
        for req, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return totals

    def _score(self, pairs: list[Pair], what: str, disable_tqdm: bool) -> list[tuple[float, bool]]:
        with tqdm(total=len(pairs), desc=f"{MODEL_NAME} {what}", disable=disable_tqdm) as bar:
            return score_continuations(self.model, pairs, self.batch_size, self.max_length, bar.update)

    def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
        """The product's sampler (greedy unless `do_sample`), one request at a time with its KV cache,
        cut at the first `until` string or at EOS / end of turn."""
        out = []
        for req in tqdm(requests, desc=f"{MODEL_NAME} generate_until", disable=disable_tqdm):
            context, gen_kwargs = req.args
            text = self._generate(context, dict(gen_kwargs))
            self.cache_hook.add_partial("generate_until", req.args, text)
            out.append(text)
        return out

    def _generate(self, context: str, kwargs: dict[str, Any]) -> str:
        until = kwargs.pop("until", None) or [self.tok_decode([self.eot_token_id])]
        until = [until] if isinstance(until, str) else list(until)
        max_new = int(kwargs.pop("max_gen_toks", 256))
        sample = bool(kwargs.pop("do_sample", False))
        temperature = float(kwargs.pop("temperature", 0.0)) if sample else 0.0
        sampling = Sampling(temperature, int(kwargs.pop("top_k", 0) or 0), float(kwargs.pop("top_p", 1.0) or 1.0))
        keep = max(1, self.max_length - max_new)
        ids = self.tok_encode(context)[-keep:]
        stops = default_stop_ids(self.tok, chat=True)
        return complete(self.model, self.tok.decode, ids, max_new, sampling, stops, until).text

    @property
    def tokenizer_name(self) -> str:
        """Names the tokenizer and template in lm-eval's request cache."""
        return f"{Path(self.path).name}-{self.tok.fingerprint()[:16]}"

    def chat_template(self, chat_template: bool | str = False) -> str | None:
        return self._template() if chat_template else None

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """The messages rendered by the GGUF's own chat template (`--apply_chat_template`)."""
        return render_messages(self.tok, self._template(), chat_history, add_generation_prompt)

    def _template(self) -> str:
        template = self.metadata.get("tokenizer.chat_template")
        if not template:
            raise ConfigError(
                problem(
                    f"--apply_chat_template with {self.path}",
                    "a GGUF with a tokenizer.chat_template",
                    "none in its metadata",
                    "leave out --apply_chat_template for this model",
                )
            )
        return str(template)


_PATH_FIX = "point path= at a .gguf (e.g. models/export/model.gguf), a model directory, or smollm2 for the donor"


@cache
def model_class() -> type:
    """`GGUFMethods` on lm-eval's TemplateLM, registered as `smollm-gguf` (lm-eval imported here)."""
    api_model = lm_eval_module("lm_eval.api.model")
    registry = lm_eval_module("lm_eval.api.registry")
    # lm-eval's own models first: its get_model imports them only while the registry is empty
    lm_eval_module("lm_eval.models")
    cls = type("GGUFLM", (GGUFMethods, api_model.TemplateLM), {"__module__": __name__, "__doc__": GGUFMethods.__doc__})
    if MODEL_NAME not in registry.model_registry:  # else lm-eval found our entry point: it loads this class
        registry.register_model(MODEL_NAME)(cls)
    return cls


def __getattr__(name: str) -> Any:
    """`pipeline.evaluate.lmeval.GGUFLM`, the entry point's target, built on first access."""
    if name == "GGUFLM":
        return model_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
