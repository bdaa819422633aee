"""Chat prompts: a GGUF's `tokenizer.chat_template` (Jinja) rendered as transformers and llama.cpp do.

The template comes from a model file, i.e. from whoever made the file, so it is untrusted code:
it runs in Jinja's immutable sandbox, and any access the sandbox forbids (dunder attributes,
`__globals__`, mutating lists...) is refused with a `PipelineError`, never rendered as an empty
string and never executed. The environment mirrors transformers' `apply_chat_template`
(trim_blocks, lstrip_blocks, loop controls, `raise_exception`, `strftime_now`, a `tojson` filter)
so real templates written for it render the same text.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any, NoReturn

from jinja2 import Undefined
from jinja2.exceptions import SecurityError, TemplateError, TemplateSyntaxError
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from pipeline.errors import PipelineError, problem
from pipeline.gguf.tokenizer import GGUFTokenizer


class ChatTemplateError(PipelineError):
    """A chat template is missing, malformed, refused by the sandbox, or raised an error itself."""


class _RefusingUndefined(Undefined):
    """Jinja's lenient Undefined, except that an undefined standing for a *refused* access raises
    when used in any way (printed, tested, iterated): the sandbox alone renders `{{ ''.__class__ }}`
    as an empty string, which would hide the attempt."""

    __slots__ = ()

    def _refused(self) -> bool:
        exc = self._undefined_exception
        return isinstance(exc, type) and issubclass(exc, SecurityError)

    def __str__(self) -> str:
        if self._refused():
            self._fail_with_undefined_error()
        return super().__str__()

    def __bool__(self) -> bool:
        if self._refused():
            self._fail_with_undefined_error()
        return super().__bool__()

    def __iter__(self):
        if self._refused():
            self._fail_with_undefined_error()
        return super().__iter__()

    def __len__(self) -> int:
        if self._refused():
            self._fail_with_undefined_error()
        return super().__len__()


def _raise_exception(message: str) -> NoReturn:
    raise TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None, sort_keys=False):
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _environment():
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols], undefined=_RefusingUndefined
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def render_chat(
    template: str,
    messages: Sequence[Mapping[str, str]],
    bos_token: str,
    eos_token: str,
    add_generation_prompt: bool = True,
    source: str = "tokenizer.chat_template",
) -> str:
    """The prompt text for `messages` ([{"role": ..., "content": ...}]) under `template`.

    `source` names where the template came from, for error messages. The result still contains
    the special tokens as text (`<|im_start|>` ...); tokenize it with special tokens recognised.
    """
    if not isinstance(template, str) or not template.strip():
        raise ChatTemplateError(
            problem(source, "a Jinja chat template", repr(template)[:60], "use a GGUF with tokenizer.chat_template")
        )
    try:
        compiled = _environment().from_string(template)
        return compiled.render(
            messages=[dict(m) for m in messages],
            bos_token=bos_token,
            eos_token=eos_token,
            add_generation_prompt=add_generation_prompt,
            tools=None,
            documents=None,
        )
    except SecurityError as e:
        raise ChatTemplateError(
            problem(source, "a chat template that stays inside the Jinja sandbox", f"a refused access ({e})", _UNSAFE)
        ) from None
    except TemplateSyntaxError as e:
        raise ChatTemplateError(
            problem(source, "a valid Jinja template", f"a syntax error at line {e.lineno} ({_one_line(e)})", _FIX)
        ) from None
    except TemplateError as e:
        raise ChatTemplateError(
            problem(source, "a template that renders these messages", f"an error: {_one_line(e)}", _FIX)
        ) from None
    except (TypeError, ValueError, KeyError, IndexError, AttributeError, OverflowError) as e:
        raise ChatTemplateError(
            problem(source, "a template that renders these messages", f"{type(e).__name__}: {_one_line(e)}", _FIX)
        ) from None


_UNSAFE = "do not use this model file's chat template (it may be malicious); render the prompt yourself with chat=false"
_FIX = "fix the template in the GGUF, or use chat=false and write the prompt yourself"


def _one_line(e: object) -> str:
    return " ".join(str(e).split())[:200]


CHAT_END_TOKEN = "<|im_end|>"  # ChatML's end of turn: a stop id for chat when the vocabulary has it


def render_messages(
    tok: GGUFTokenizer, template: str, messages: Sequence[Mapping[str, str]], add_generation_prompt: bool
) -> str:
    """`render_chat` with the tokenizer's own BOS/EOS texts, as the template expects them."""
    bos = tok.id_to_token(tok.bos_id) if tok.bos_id is not None else ""
    eos = tok.id_to_token(tok.eos_id) if tok.eos_id is not None else ""
    return render_chat(template, messages, bos, eos, add_generation_prompt=add_generation_prompt)


def default_stop_ids(tok: GGUFTokenizer, chat: bool) -> tuple[int, ...]:
    """EOS, and for chat the end-of-turn token when the vocabulary has one."""
    stops = [tok.eos_id] if tok.eos_id is not None else []
    end_turn = tok.token_to_id(CHAT_END_TOKEN) if chat else None
    if end_turn is not None and end_turn not in stops:
        stops.append(end_turn)
    return tuple(stops)
