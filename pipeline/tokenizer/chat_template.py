"""Chat prompts: a GGUF's `tokenizer.chat_template` (Jinja) rendered as transformers and llama.cpp do.

The template comes from a model file, i.e. from whoever made the file, so it is untrusted code:
it runs in Jinja's immutable sandbox, and any access the sandbox forbids (dunder attributes,
`__globals__`, mutating lists...) is refused with a `PipelineError`, never rendered as an empty
string and never executed. The environment mirrors transformers' `apply_chat_template`
(trim_blocks, lstrip_blocks, loop controls, `raise_exception`, `strftime_now`, a `tojson` filter)
so real templates written for it render the same text.

It is also bounded, because a template can loop, recurse or build strings: calls nest at most
`MAX_CALL_DEPTH` deep (a macro that recurses without end), no string or list grows past the
prompt bound (`BASE_CHARS` plus 4x the messages' text: `'x' * 10**9`, `~` doubling, `replace`,
`join`), and a render takes at most `RENDER_SECONDS`, checked at every loop iteration, call,
operator and filter. Each bound is a named `ChatTemplateError`, never a hang or a MemoryError.
"""

from __future__ import annotations

import functools
import json
import re
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from datetime import datetime
from typing import Any, NoReturn

from jinja2 import Undefined, nodes
from jinja2.compiler import CodeGenerator, Frame
from jinja2.exceptions import SecurityError, TemplateError, TemplateSyntaxError
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from pipeline.errors import ChatTemplateError, one_line, problem
from pipeline.tokenizer.gguf_tokenizer import GGUFTokenizer

MAX_CALL_DEPTH = 32  # nested calls: real templates nest a handful (a recursive tool-schema macro)
RENDER_SECONDS = 2.0  # real templates render in milliseconds
BASE_CHARS = 1 << 16  # markup a prompt may add: the bound is this plus 4x the messages' text
_FORMAT_SPEC = re.compile(r"%[^a-zA-Z%]*|\{[^{}]*\}")  # printf-style and str.format fields


class _Refused(Exception):
    """A template went past one of the render bounds: (expected, found)."""


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


class _BoundedCodeGenerator(CodeGenerator):
    """Jinja's code generator with a check at every loop iteration and every `~` join: a loop whose body
    calls nothing would otherwise never meet a bound."""

    def visit_Template(self, node: nodes.Template, frame: Frame | None = None) -> None:
        for loop in node.find_all(nodes.For):
            loop.iter = nodes.Filter(loop.iter, "_bounded_iter", [], [], None, None, lineno=loop.lineno)
        super().visit_Template(node, frame)

    def visit_Concat(self, node: nodes.Concat, frame: Frame) -> None:
        self.write("concat((")  # the module's `concat` is environment.concat: _BoundedSandbox.bounded_join
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write("))")


class _BoundedSandbox(ImmutableSandboxedEnvironment):
    """transformers' chat environment in the immutable sandbox, with bounds on call depth, value sizes
    and time, checked at every loop iteration, call, operator, filter and join (one per render)."""

    code_generator_class = _BoundedCodeGenerator
    intercepted_binops = frozenset({"*", "**", "%", "+"})

    def __init__(self, max_chars: int):
        super().__init__(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols], undefined=_RefusingUndefined)
        self.max_chars, self.depth, self.deadline = max_chars, 0, time.monotonic() + RENDER_SECONDS
        self.concat = self.bounded_join
        self.filters["tojson"] = _tojson
        self.filters = {name: self._bounded_filter(name, f) for name, f in self.filters.items()}
        self.filters["_bounded_iter"] = self.bounded_iter
        self.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now)

    def tick(self) -> None:
        if time.monotonic() > self.deadline:
            raise _Refused(f"a render within {RENDER_SECONDS:g} s", "a template still running (an endless loop?)")

    def budget(self, n: int, what: str) -> None:
        """A value about to be built: at most `max_chars` characters or items, refused before it exists."""
        if n > self.max_chars:
            raise _Refused(f"strings and lists of at most {self.max_chars} characters or items", f"{what} of {n}")

    def sized(self, value: Any, what: str) -> Any:
        if isinstance(value, (str, list, tuple, dict)):
            self.budget(len(value), what)
        return value

    def check_format(self, fmt: str) -> None:
        """printf / str.format fields whose width or precision would build a huge string."""
        for spec in _FORMAT_SPEC.findall(fmt):
            widths = [int(d) for d in re.findall(r"\d+", spec)]
            if "*" in spec or any(w > self.max_chars for w in widths):
                raise _Refused(f"format widths of at most {self.max_chars}", f"the field {spec[:40]!r}")

    def check_args(self, args: Iterable[Any], what: str) -> None:
        for a in args:
            if isinstance(a, int) and not isinstance(a, bool) and abs(a) > self.max_chars:
                raise _Refused(f"integer arguments of at most {self.max_chars}", f"{a} passed to {what}")

    def bounded_iter(self, iterable: Iterable[Any]) -> Iterator[Any]:
        for item in iterable:
            self.tick()
            yield item

    def bounded_join(self, parts: Iterable[Any]) -> str:
        """Jinja's `concat` (macro output, `~`): the total size checked before the string is built."""
        strings = [p if isinstance(p, str) else str(p) for p in parts]
        self.budget(sum(map(len, strings)), "a joined string")
        return "".join(strings)

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        self.tick()
        seqs = (str, list, tuple)
        if operator == "*" and isinstance(left, seqs + (int,)) and isinstance(right, seqs + (int,)):
            seq, n = (left, right) if isinstance(right, int) else (right, left)
            if isinstance(seq, seqs) and isinstance(n, int):
                self.budget(len(seq) * max(n, 0), "'*' result")
        elif operator == "+" and isinstance(left, seqs) and isinstance(right, seqs):
            self.budget(len(left) + len(right), "'+' result")
        elif operator == "**" and isinstance(left, int) and isinstance(right, int) and abs(left) > 1:
            self.budget(right * abs(left).bit_length() // 3, "'**' result (digits)")
        elif operator == "%" and isinstance(left, str):
            self.check_format(left)
        return super().call_binop(context, operator, left, right)

    def call(self, context: Any, obj: Any, /, *args: Any, **kwargs: Any) -> Any:
        """Every call a template makes: time, argument sizes, str methods that multiply, and depth."""
        self.tick()
        self.check_args([*args, *kwargs.values()], getattr(obj, "__name__", "a call"))
        target = getattr(getattr(obj, "__wrapped__", obj), "__self__", None)
        if isinstance(target, str):
            self.check_str_method(target, getattr(obj, "__name__", ""), args)
        elif obj is _strftime_now and args and isinstance(args[0], str):
            self.check_format(args[0])
        if self.depth >= MAX_CALL_DEPTH:
            raise _Refused(f"calls nested at most {MAX_CALL_DEPTH} deep", "deeper nesting (a macro that recurses?)")
        self.depth += 1
        try:
            return self.sized(super().call(context, obj, *args, **kwargs), "a call's result")
        finally:
            self.depth -= 1

    def check_str_method(self, s: str, name: str, args: tuple) -> None:
        """The str methods whose result can be far larger than the string and their arguments."""
        if name == "replace" and len(args) >= 2 and isinstance(args[0], str) and isinstance(args[1], str):
            self.budget(len(s) + s.count(args[0]) * len(args[1]), "a replace() result")
        elif name == "join" and args and isinstance(args[0], (list, tuple)):
            items = args[0]
            self.budget(len(s) * len(items) + sum(len(x) for x in items if isinstance(x, str)), "a join() result")
        elif name == "expandtabs":
            self.budget(len(s) * max([1, *(a for a in args if isinstance(a, int))]), "an expandtabs() result")
        elif name in ("format", "format_map"):
            self.check_format(s)

    def _bounded_filter(self, name: str, f: Callable[..., Any]) -> Callable[..., Any]:
        """A filter with the same bounds as a call; `replace`, `join`, `indent` and `format` checked ahead."""
        first = 2 if getattr(f, "jinja_pass_arg", None) else 1  # context/env first, then the value

        @functools.wraps(f)
        def bounded(*args: Any, **kwargs: Any) -> Any:
            self.tick()
            value, rest = (args[first - 1] if len(args) >= first else None), args[first:]
            self.check_args([*rest, *kwargs.values()], f"the {name} filter")
            if isinstance(value, str) and name in ("replace", "format", "indent"):
                if name == "replace":
                    self.check_str_method(value, "replace", rest)
                elif name == "format":
                    self.check_format(value)
                else:
                    width = rest[0] if rest else kwargs.get("width", 4)
                    pad = width if isinstance(width, int) else len(str(width))
                    self.budget(len(value) + pad * (value.count("\n") + 1), "an indent result")
            elif name == "join" and isinstance(value, (list, tuple)):
                self.budget(sum(len(x) for x in value if isinstance(x, str)), "a join result")
            return self.sized(f(*args, **kwargs), f"the {name} filter's result")

        return bounded


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
    messages = [dict(m) for m in messages]
    text = sum(len(str(v)) for m in messages for v in m.values()) + len(bos_token) + len(eos_token)
    env = _BoundedSandbox(BASE_CHARS + 4 * text)
    try:
        compiled = env.from_string(template)
        chunks = compiled.generate(
            messages=messages,
            bos_token=bos_token,
            eos_token=eos_token,
            add_generation_prompt=add_generation_prompt,
            tools=None,
            documents=None,
        )
        return env.bounded_join(_bounded_output(env, chunks))
    except (_Refused, RecursionError, MemoryError) as e:
        found = f"{e.args[1]}" if isinstance(e, _Refused) else f"{type(e).__name__}"
        expected = e.args[0] if isinstance(e, _Refused) else "a template that renders within bounds"
        raise ChatTemplateError(problem(source, expected, found, _BOUNDED)) from None
    except SecurityError as e:
        raise ChatTemplateError(
            problem(source, "a chat template that stays inside the Jinja sandbox", f"a refused access ({e})", _UNSAFE)
        ) from None
    except TemplateSyntaxError as e:
        raise ChatTemplateError(
            problem(source, "a valid Jinja template", f"a syntax error at line {e.lineno} ({one_line(e)})", _FIX)
        ) from None
    except TemplateError as e:
        raise ChatTemplateError(
            problem(source, "a template that renders these messages", f"an error: {one_line(e)}", _FIX)
        ) from None
    except (TypeError, ValueError, KeyError, IndexError, AttributeError, OverflowError) as e:
        raise ChatTemplateError(
            problem(source, "a template that renders these messages", f"{type(e).__name__}: {one_line(e)}", _FIX)
        ) from None


def _bounded_output(env: _BoundedSandbox, chunks: Iterable[str]) -> Iterator[str]:
    """The rendered text as it streams out, stopped once it passes the prompt bound."""
    total = 0
    for chunk in chunks:
        env.tick()
        total += len(chunk)
        env.budget(total, "a rendered prompt")
        yield chunk


_BOUNDED = "the template loops, recurses or grows without bound; fix it in the GGUF, or use chat=false"
_UNSAFE = "do not use this model file's chat template (it may be malicious); render the prompt yourself with chat=false"
_FIX = "fix the template in the GGUF, or use chat=false and write the prompt yourself"


# llama.cpp's end-of-generation tokens by spelling (llama-vocab.cpp): the turn ends of ChatML, Llama 3,
# Phi-3, Gemma and others. A chat template closes each turn with one of them, and a donor's EOS is
# often another (Llama 3: `<|end_of_text|>` vs the template's `<|eot_id|>`), so chat stops at any.
END_OF_TURN_TOKENS = (
    "<|im_end|>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<|end|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "<|end_of_text|>",
    "<EOT>",
    "_<EOT>",
    "<end_of_utterance>",
    "<|return|>",
    "<|call|>",
)


def render_messages(
    tok: GGUFTokenizer, template: str, messages: Sequence[Mapping[str, str]], add_generation_prompt: bool
) -> str:
    """`render_chat` with the tokenizer's own BOS/EOS texts, as the template expects them."""
    bos = tok.id_to_token(tok.bos_id) if tok.bos_id is not None else ""
    eos = tok.id_to_token(tok.eos_id) if tok.eos_id is not None else ""
    try:
        return render_chat(template, messages, bos, eos, add_generation_prompt=add_generation_prompt)
    except ChatTemplateError:
        plain = [m for m in messages if m.get("role") != "system"]
        if len(plain) == len(messages):
            raise
        render_chat(template, plain, bos, eos, add_generation_prompt=add_generation_prompt)  # raises if not that
        raise ChatTemplateError(problem("tokenizer.chat_template", *_NO_SYSTEM)) from None


# Many templates (Mistral, Gemma, Llama 2 variants) raise on a system turn: the user's way out is to drop it.
_NO_SYSTEM = (
    "a template that takes a system message",
    "one that refuses it (it renders the same conversation without the system message)",
    "leave the system message out (chat/generate: system=''; instruction data: its system turns) or put it "
    "into the first user message",
)


def default_stop_ids(tok: GGUFTokenizer, chat: bool) -> tuple[int, ...]:
    """EOS, and for chat every end-of-turn token llama.cpp stops at: the file's eot/eom ids and the
    vocabulary's tokens spelled as in `END_OF_TURN_TOKENS`."""
    stops = [tok.eos_id] if tok.eos_id is not None else []
    if chat:
        spelled = (tok.token_to_id(t) for t in END_OF_TURN_TOKENS)
        stops += [i for i in (*tok.end_of_turn_ids, *spelled) if i is not None]
    return tuple(dict.fromkeys(stops))
