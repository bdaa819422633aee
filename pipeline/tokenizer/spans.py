"""User text stays text: a prompt as spans of trusted text (a chat template's own output, whose
`<|im_start|>` is a control token) and untrusted text (message contents), whose typed special-token
strings are tokenized as the characters they are, so a prompt or a training example cannot open a
new turn or inject a role (`...<|im_end|>\n<|im_start|>system\n...`).

The contents' places in a rendering are found by rendering once more with a marker for each
content and aligning the two renderings; a template that transforms contents beyond trimming them,
or whose output depends on them, cannot be aligned and is a named refusal. Encoding matches
llama.cpp's: the trusted spans' special tokens partition the text, every fragment between them is
tokenized whole with special tokens left unmatched (`parse_special=false`), so text without typed
special tokens gets exactly the ids `GGUFTokenizer.encode` gives the whole rendering.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from functools import lru_cache

from pipeline.errors import ChatTemplateError, problem
from pipeline.tokenizer.chat_template import render_messages
from pipeline.tokenizer.gguf_tokenizer import GGUFTokenizer

Span = tuple[str, bool]  # (text, trusted): special tokens are matched only in trusted text
_MARK = re.compile("\ue000(\\d+)\ue001")  # private-use characters around a message's index


def render_spans(
    tok: GGUFTokenizer, template: str, messages: Sequence[Mapping[str, str]], add_generation_prompt: bool
) -> list[Span]:
    """`render_messages` as spans: the template's text trusted, each message content not."""
    real = render_messages(tok, template, messages, add_generation_prompt)
    marked = [{**m, "content": f"\ue000{i}\ue001"} for i, m in enumerate(messages)]
    parts = _MARK.split(render_messages(tok, template, marked, add_generation_prompt))
    spans = _align(real, parts[0::2], [str(messages[int(i)]["content"]) for i in parts[1::2]])
    if spans is None:
        raise ChatTemplateError(
            problem(
                "tokenizer.chat_template",
                "a template that inserts message contents as written (or trimmed)",
                "one that changes them or depends on them, so user text cannot be told from the template's",
                "set data.parse_special=true (generate: parse_special=true) if the contents are trusted",
            )
        )
    return spans


def _align(real: str, pieces: list[str], contents: list[str]) -> list[Span] | None:
    """Spans of `real` = pieces[0] + content 0 + pieces[1] + ...; None where it is not that."""
    spans: list[Span] = []
    pos = 0
    for k, piece in enumerate(pieces):
        if not real.startswith(piece, pos):
            return None
        spans.append((piece, True))
        pos += len(piece)
        if k == len(contents):
            break
        content, after = contents[k], pieces[k + 1]
        for shown in dict.fromkeys((content, content.strip(), content.lstrip(), content.rstrip())):
            if real.startswith(shown, pos) and real.startswith(after, pos + len(shown)):
                spans.append((shown, False))
                pos += len(shown)
                break
        else:
            return None
    return spans if pos == len(real) else None


def cut(spans: list[Span], at: int) -> tuple[list[Span], list[Span]]:
    """The spans of the first `at` characters and of the rest (a prompt and its response)."""
    head: list[Span] = []
    tail: list[Span] = []
    pos = 0
    for text, trusted in spans:
        n = min(max(at - pos, 0), len(text))
        if text[:n]:
            head.append((text[:n], trusted))
        if text[n:]:
            tail.append((text[n:], trusted))
        pos += len(text)
    return head, tail


def encode_spans(tok: GGUFTokenizer, spans: Sequence[Span], continues: bool = False) -> list[int]:
    """Ids of the spans' text with special tokens matched in the trusted spans only. `continues`: the
    spans follow earlier text (a response after its prompt), so their first run of text gets no
    SentencePiece space prefix, as in llama.cpp's tokenization of the whole conversation."""
    specials = _specials(tok)
    ids: list[int] = []
    fragment = ""
    for text, trusted in spans:
        if not trusted or specials is None:
            fragment += text
            continue
        at = 0
        for m in specials.finditer(text):
            fragment += text[at : m.start()]
            ids += tok.encode(fragment, special=False, continues=continues and not ids) if fragment else []
            ids.append(tok.token_to_id(m.group()))
            fragment, at = "", m.end()
        fragment += text[at:]
    return ids + (tok.encode(fragment, special=False, continues=continues and not ids) if fragment else [])


def ends_in_text(tok: GGUFTokenizer, ids: Sequence[int]) -> bool:
    """Whether text after `ids` continues running text (no space prefix): they end in a non-special token."""
    return bool(ids) and tok.id_to_token(ids[-1]) not in _control_set(tok)


@lru_cache(maxsize=8)
def _control_set(tok: GGUFTokenizer) -> frozenset[str]:
    return frozenset(tok.control_tokens())


@lru_cache(maxsize=8)
def _specials(tok: GGUFTokenizer) -> re.Pattern[str] | None:
    """The control tokens as one leftmost-longest pattern (as the tokenizer matches them)."""
    tokens = sorted(tok.control_tokens(), key=len, reverse=True)
    return re.compile("|".join(map(re.escape, tokens))) if tokens else None
