"""Instruction data: JSONL examples -> chat-formatted token rows with response-only labels, packed.

Each example is a prompt (a conversation) and a response. It is rendered with the base GGUF's
chat template (sandboxed, `pipeline.tokenizer.chat_template.render_chat`) or a plain template, tokenized as
prompt ids + response ids, and turned into next-token pairs: position t holds token t and its
label is token t+1 when that token belongs to the response, else -100 (ignored by
`F.cross_entropy(ignore_index=-100)` and by the models' `loss`). Several examples share a row when
`pack` is on; `segment_ids` (1, 2, ... per example, 0 for padding) make the models' `loss` keep
attention (and positions) inside each example (`pipeline.models.transformer.segment_causal_mask`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.config import DataConfig
from pipeline.data.instruct_formats import conversation
from pipeline.data.packed import Packed
from pipeline.data.readers import iter_lines, load_json_line
from pipeline.errors import ConfigError, DataError, problem
from pipeline.models.ops.losses import IGNORE_INDEX
from pipeline.tokenizer.chat_template import render_messages
from pipeline.tokenizer.gguf_tokenizer import GGUFTokenizer
from pipeline.tokenizer.spans import Span, cut, encode_spans, ends_in_text, render_spans


@dataclass(frozen=True)
class Example:
    """One training example: the conversation before the response, and the response."""

    messages: tuple[dict[str, str], ...]
    response: str
    where: str  # `file line N`, for errors


# ----- reading -----


def read_instruct_jsonl(path: str | os.PathLike[str]) -> list[Example]:
    """Examples from JSONL lines: `{"prompt", "response"|"completion"}`, Alpaca, ShareGPT or `{"messages"}`.

    Blank lines are allowed; any other malformed line is an error naming its line number.
    """
    p = Path(path)
    examples = [parse_example(line, f"{p} line {lineno}") for lineno, line in instruct_lines(p)]
    if not examples:
        raise DataError(problem(str(p), "at least one example", "none", "write one JSON object per line"))
    return examples


def instruct_lines(p: Path) -> list[tuple[int, str]]:
    """(line number, text) of the file's non-blank lines, read as pack reads a JSONL corpus (gzip or zstd by
    the first bytes, a BOM dropped, `\\r\\n` as `\\n`): a `.jsonl.gz` is data, not undecodable bytes."""
    if not p.exists():
        raise DataError(problem(str(p), "an instruction JSONL file", "no such file", "check data.path"))
    if not p.is_file():
        fix = "point data.path at one JSONL file (e.g. cat dir/*.jsonl > all.jsonl)"
        raise DataError(problem(str(p), "an instruction JSONL file", "a directory", fix))
    return [(n, line.rstrip("\n")) for n, line in iter_lines(p) if line.strip()]


def parse_example(line: str, where: str) -> Example:
    """One JSONL line (any shape of `pipeline.data.instruct_formats`) as an Example, or a DataError
    saying what is wrong with it."""
    obj = load_json_line(line, where)
    msgs = conversation(obj, where)
    return _answered(Example(tuple(msgs[:-1]), msgs[-1]["content"], where), _answer_field(obj))


def _answer_field(obj: dict[str, Any]) -> str:
    """How the error names the answer: its key in the line's format, or the last assistant message."""
    return next((f'"{k}"' for k in ("response", "completion", "output") if k in obj), "the last message's content")


def _answered(ex: Example, field: str) -> Example:
    """An empty answer would teach only the template's end-of-turn token (the chat template's own
    text counts as the response), so it is refused rather than trained on."""
    if not ex.response.strip():
        found = "an empty string" if not ex.response else f"only whitespace ({ex.response!r})"
        raise DataError(
            problem(f"{ex.where} {field}", "a non-empty response", found, "write the answer or remove the line")
        )
    return ex


# ----- formatting and tokenizing -----


class Formatter:
    """Example -> (prompt ids, response ids) with the chat template or the plain template."""

    def __init__(self, tokenizer: GGUFTokenizer, metadata: dict[str, Any], cfg: DataConfig):
        self.tok, self.cfg = tokenizer, cfg
        template = metadata.get("tokenizer.chat_template")
        if cfg.template == "chat" and not template:
            raise ConfigError(
                problem(
                    "config key data.template=chat",
                    "a base GGUF with tokenizer.chat_template",
                    "none in its metadata",
                    "use data.template=plain (or auto)",
                )
            )
        self.chat_template = str(template) if template and cfg.template != "plain" else None

    def texts(self, ex: Example) -> tuple[str, str]:
        """Prompt text (ending where the assistant starts) and response text (incl. end-of-turn)."""
        if self.chat_template is None:
            prompt = "\n\n".join(m["content"] for m in ex.messages)
            return (
                self.cfg.plain_prompt.replace("{prompt}", prompt),
                self.cfg.plain_response.replace("{response}", ex.response),
            )
        msgs = list(ex.messages)
        prompt = render_messages(self.tok, self.chat_template, msgs, add_generation_prompt=True)
        answered = [*msgs, {"role": "assistant", "content": ex.response}]
        full = render_messages(self.tok, self.chat_template, answered, add_generation_prompt=False)
        if not full.startswith(prompt):
            raise DataError(
                problem(
                    f"{ex.where} (chat template)",
                    "the conversation with the answer to start with the prompt's rendering",
                    "a different prefix, so the response cannot be cut out",
                    "use data.template=plain",
                )
            )
        return prompt, full[len(prompt) :]

    def spans(self, ex: Example) -> tuple[list[Span], list[Span]]:
        """`texts` as spans: the template's text trusted, the example's own text (prompt, response,
        message contents) untrusted unless data.parse_special (see `pipeline.tokenizer.spans`)."""
        prompt_text, response_text = self.texts(ex)
        if self.cfg.parse_special:
            return [(prompt_text, True)], [(response_text, True)]
        if self.chat_template is None:
            prompt = _fill(self.cfg.plain_prompt, "{prompt}", "\n\n".join(m["content"] for m in ex.messages))
            return prompt, _fill(self.cfg.plain_response, "{response}", ex.response)
        answered = [*ex.messages, {"role": "assistant", "content": ex.response}]
        return cut(render_spans(self.tok, self.chat_template, answered, add_generation_prompt=False), len(prompt_text))

    def encode(self, ex: Example) -> tuple[list[int], list[int]]:
        prompt_spans, response_spans = self.spans(ex)
        prompt = self._ids(prompt_spans, first=True)
        return prompt, self._ids(response_spans, answer=True, after=prompt)

    def _ids(self, spans: list[Span], first: bool = False, answer: bool = False, after: list[int] = ()) -> list[int]:
        """A piece's ids: the first starts with BOS when the GGUF asks for it; a plain answer ends with EOS.
        A piece that continues the text of `after` gets no SentencePiece space prefix (see `encode_spans`)."""
        ids = encode_spans(self.tok, spans, continues=ends_in_text(self.tok, after)) if spans else []
        if first and self.tok.add_bos and self.tok.bos_id is not None and ids[:1] != [self.tok.bos_id]:
            ids = [self.tok.bos_id, *ids]
        if answer and self.chat_template is None and self.cfg.add_eos and self.tok.eos_id is not None:
            ids.append(self.tok.eos_id)
        return ids

    def encode_turns(self, ex: Example) -> tuple[list[int], list[int], list[bool]]:
        """Every assistant turn learned (`data.all_turns`): the ids before the first answer, the ids after
        it, and which of those are answer tokens. One answer gives exactly `encode`'s ids."""
        pieces = turn_texts(self, ex)
        spans = self.piece_spans(ex, pieces)
        prompt = self._ids(spans[0], first=True)
        rest: list[int] = []
        mask: list[bool] = []
        for piece, (_, is_answer) in zip(spans[1:], pieces[1:]):
            ids = self._ids(piece, answer=is_answer, after=rest or prompt)
            rest += ids
            mask += [is_answer] * len(ids)
        return prompt, rest, mask

    def piece_spans(self, ex: Example, pieces: list[tuple[str, bool]]) -> list[list[Span]]:
        """`turn_texts`' pieces as spans (see `spans`): the whole rendering's spans cut at each piece's end."""
        if self.cfg.parse_special:
            return [[(text, True)] for text, _ in pieces]
        msgs = [*ex.messages, {"role": "assistant", "content": ex.response}]
        if self.chat_template is None:
            return _plain_spans(self.cfg, msgs)
        rest = render_spans(self.tok, self.chat_template, msgs, add_generation_prompt=False)
        out = []
        for text, _ in pieces:
            head, rest = cut(rest, len(text))
            out.append(head)
        return out


def _plain_spans(cfg: DataConfig, msgs: list[dict[str, str]]) -> list[list[Span]]:
    """The plain template's pieces as spans, in `turn_texts`' order: a prompt before each answer."""
    out: list[list[Span]] = []
    pending: list[str] = []
    for m in msgs:
        if m["role"] != "assistant":
            pending.append(m["content"])
            continue
        out += [
            _fill(cfg.plain_prompt, "{prompt}", "\n\n".join(pending)),
            _fill(cfg.plain_response, "{response}", m["content"]),
        ]
        pending = []
    return out


def _fill(template: str, field: str, text: str) -> list[Span]:
    """A plain template's text (trusted) with `text` (untrusted) at each `field`."""
    pieces = template.split(field)
    spans = [(pieces[0], True)]
    for piece in pieces[1:]:
        spans += [(text, False), (piece, True)]
    return [(t, trusted) for t, trusted in spans if t]


def truncate(
    prompt: list[int], response: list[int], cfg: DataConfig, bos_id: int | None, where: str
) -> tuple[list[int], list[int], bool]:
    """Fit prompt + response into `max_seq_len`: cut the prompt's start (keeping a leading BOS) down
    to `min_prompt_tokens`, then the response's end. An example left without a response target is an
    error, never skipped silently."""
    limit = cfg.max_seq_len
    truncated = len(prompt) + len(response) > limit
    if truncated:
        keep = max(min(len(prompt), cfg.min_prompt_tokens), limit - len(response))
        keep = min(keep, len(prompt))
        if keep < len(prompt):
            head = prompt[:1] if bos_id is not None and prompt[:1] == [bos_id] and keep > 0 else []
            prompt = head + (prompt[len(prompt) - keep + len(head) :] if keep > len(head) else [])
        response = response[: max(0, limit - len(prompt))]
    targets = len(response) if prompt else len(response) - 1  # the first token needs a predecessor
    if targets <= 0:
        raise DataError(
            problem(
                where,
                f"a response with at least one token to learn after truncation to max_seq_len={limit}",
                f"{max(targets, 0)} (prompt {len(prompt)} tokens kept, response {len(response)})",
                "give the example a non-empty response, raise data.max_seq_len or lower data.min_prompt_tokens",
            )
        )
    return prompt, response, truncated


def example_arrays(
    prompt: list[int], response: list[int], mask: list[bool] | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """input ids (n) and labels (n): label[t] = token[t+1] when it is a response token (one `mask` marks,
    when given: every assistant turn after the first answer's start), else -100."""
    tokens = np.asarray(prompt + response, dtype=np.int64)
    target = np.zeros(len(tokens), dtype=bool)
    target[len(prompt) :] = True if mask is None else mask
    target[:1] = False  # the first token has no predecessor to predict it
    labels = np.full(len(tokens), IGNORE_INDEX, dtype=np.int64)
    labels[:-1] = np.where(target[1:], tokens[1:], IGNORE_INDEX)
    return tokens, labels


def turn_texts(fmt: Formatter, ex: Example) -> list[tuple[str, bool]]:
    """The conversation as (text, is an assistant answer) pieces, every assistant turn an answer: what
    `data.all_turns` trains on. One answer gives exactly `Formatter.texts`' prompt and response."""
    msgs = [*ex.messages, {"role": "assistant", "content": ex.response}]
    pieces: list[tuple[str, bool]] = []
    if fmt.chat_template is None:
        pending: list[str] = []
        for m in msgs:
            if m["role"] != "assistant":
                pending.append(m["content"])
                continue
            pieces.append((fmt.cfg.plain_prompt.replace("{prompt}", "\n\n".join(pending)), False))
            pieces.append((fmt.cfg.plain_response.replace("{response}", m["content"]), True))
            pending = []
        return pieces
    done = ""
    for k, m in enumerate(msgs):
        if m["role"] != "assistant":
            continue
        before = render_messages(fmt.tok, fmt.chat_template, msgs[:k], add_generation_prompt=True)
        after = render_messages(fmt.tok, fmt.chat_template, msgs[: k + 1], add_generation_prompt=False)
        if not (before.startswith(done) and after.startswith(before)):
            raise DataError(
                problem(
                    f"{ex.where} (chat template, assistant turn {k})",
                    "each rendering to extend the previous one, so the answers can be cut out",
                    "a different prefix",
                    "use data.template=plain or data.all_turns=false",
                )
            )
        pieces += [(before[len(done) :], False), (after[len(before) :], True)]
        done = after
    return pieces


def pack_examples(
    encoded: list[tuple[np.ndarray, np.ndarray]], seq_len: int, pad_id: int, pack: bool = True
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Rows of `seq_len`: examples in order, several per row when `pack` (greedy, never split)."""
    rows: list[list[tuple[np.ndarray, np.ndarray]]] = []
    used = seq_len
    for ids, labels in encoded:
        if not pack or used + len(ids) > seq_len:
            rows.append([])
            used = 0
        rows[-1].append((ids, labels))
        used += len(ids)
    x = np.full((len(rows), seq_len), pad_id, dtype=np.int64)
    y = np.full((len(rows), seq_len), IGNORE_INDEX, dtype=np.int64)
    seg = np.zeros((len(rows), seq_len), dtype=np.int32)
    for r, row in enumerate(rows):
        at = 0
        for s, (ids, labels) in enumerate(row, start=1):
            x[r, at : at + len(ids)] = ids
            y[r, at : at + len(ids)] = labels
            seg[r, at : at + len(ids)] = s
            at += len(ids)
    return x, y, seg


def encode_example(
    fmt: Formatter, ex: Example, cfg: DataConfig, bos_id: int | None
) -> tuple[list[int], list[int], list[bool] | None, bool]:
    """Prompt ids, response ids (with `data.all_turns`: everything after the first answer's start, and a
    mask of the answer tokens), truncated to `max_seq_len`; an example left with nothing to learn is an error."""
    if not cfg.all_turns:
        prompt, response, cut = truncate(*fmt.encode(ex), cfg, bos_id, ex.where)
        return prompt, response, None, cut
    prompt, rest, mask = fmt.encode_turns(ex)
    prompt, rest, cut = truncate(prompt, rest, cfg, bos_id, ex.where)
    return prompt, rest, mask[: len(rest)], cut


def build_instruct(
    examples: list[Example], tokenizer: GGUFTokenizer, metadata: dict[str, Any], cfg: DataConfig
) -> Packed:
    """Format, tokenize, truncate and pack `examples`; stats count truncated examples and tokens."""
    fmt = Formatter(tokenizer, metadata, cfg)
    encoded = []
    stats = {"examples": len(examples), "truncated": 0, "prompt_tokens": 0, "response_tokens": 0}
    for ex in examples:
        prompt, response, mask, cut = encode_example(fmt, ex, cfg, tokenizer.bos_id)
        stats["truncated"] += int(cut)
        stats["prompt_tokens"] += len(prompt)
        stats["response_tokens"] += len(response)
        encoded.append(example_arrays(prompt, response, mask))
    pad = tokenizer.pad_id if tokenizer.pad_id is not None else (tokenizer.eos_id or 0)
    x, y, seg = pack_examples(encoded, cfg.max_seq_len, pad, cfg.pack)
    stats["rows"] = int(x.shape[0])
    stats["label_tokens"] = int((y != IGNORE_INDEX).sum())
    stats["filled_positions"] = int((seg > 0).sum())
    stats["chat_template"] = int(fmt.chat_template is not None)
    return Packed(x, y, seg, stats)
