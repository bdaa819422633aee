"""Instruction data: JSONL examples -> chat-formatted token rows with response-only labels, packed.

Each example is a prompt (a conversation) and a response. It is rendered with the base GGUF's
chat template (sandboxed, `pipeline.chat.render_chat`) or a plain template, tokenized as
prompt ids + response ids, and turned into next-token pairs: position t holds token t and its
label is token t+1 when that token belongs to the response, else -100 (ignored by
`F.cross_entropy(ignore_index=-100)` and by `Llama.loss`). Several examples share a row when `pack`
is on; `segment_ids` (1, 2, ... per example, 0 for padding) make `Llama.loss` restrict attention
to each example (`pipeline.model.segment_causal_mask`).
"""

from __future__ import annotations

import json
import os
import random
import re
import textwrap
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from pipeline.errors import ConfigError, DataError, problem
from pipeline.losses import IGNORE_INDEX
from pipeline.model import segment_causal_mask  # noqa: F401  (re-exported with the packed data it masks)

TEMPLATES = ("auto", "chat", "plain")


@dataclass(frozen=True)
class InstructConfig:
    """How examples become token rows (proposed `data=instruct` keys)."""

    max_seq_len: int = 512  # tokens per row (= train.seq_len); an example longer than this is truncated
    template: str = "auto"  # auto: the GGUF's chat template when it has one, else plain
    plain_prompt: str = "Question: {prompt}\nAnswer: "
    plain_response: str = "{response}"
    append_eos: bool = True  # plain template: end the response with EOS (a chat template ends turns itself)
    min_prompt_tokens: int = 1  # truncation cuts the prompt's start down to this, then the response's end
    pack: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.max_seq_len, bool) or not isinstance(self.max_seq_len, int) or self.max_seq_len < 2:
            raise ConfigError(
                problem("config key data.max_seq_len", "an integer >= 2", repr(self.max_seq_len), "set 512")
            )
        if self.template not in TEMPLATES:
            raise ConfigError(
                problem("config key data.template", f"one of {list(TEMPLATES)}", repr(self.template), "use auto")
            )
        if "{prompt}" not in self.plain_prompt or "{response}" not in self.plain_response:
            raise ConfigError(
                problem(
                    "config keys data.plain_prompt / data.plain_response",
                    "templates containing {prompt} and {response}",
                    f"{self.plain_prompt!r} / {self.plain_response!r}",
                    "write e.g. 'Question: {prompt}\\nAnswer: ' and '{response}'",
                )
            )
        if not 0 <= self.min_prompt_tokens < self.max_seq_len:
            raise ConfigError(
                problem(
                    "config key data.min_prompt_tokens",
                    f"in [0, max_seq_len={self.max_seq_len})",
                    repr(self.min_prompt_tokens),
                    "set 1",
                )
            )


@dataclass(frozen=True)
class Example:
    """One training example: the conversation before the response, and the response."""

    messages: tuple[dict[str, str], ...]
    response: str
    where: str  # `file line N`, for errors


@dataclass
class Packed:
    """Rows of `max_seq_len` positions: token ids, next-token labels (-100 = no loss), segment ids."""

    input_ids: np.ndarray  # (N, T) int64
    labels: np.ndarray  # (N, T) int64
    segment_ids: np.ndarray  # (N, T) int32, 1.. per example in the row, 0 = padding
    stats: dict[str, int] = field(default_factory=dict)


# ----- reading -----


def read_instruct_jsonl(path: str | os.PathLike[str]) -> list[Example]:
    """Examples from JSONL lines `{"prompt", "response"}` or `{"messages": [...]}` (last = assistant).

    Blank lines are allowed; any other malformed line is an error naming its line number.
    """
    p = Path(path)
    if not p.is_file():
        raise DataError(problem(str(p), "an instruction JSONL file", "no such file", "check data.path"))
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise DataError(
            problem(str(p), "UTF-8 text", f"undecodable bytes at {e.start}", "re-encode as UTF-8")
        ) from None
    examples = []
    for lineno, line in enumerate(text.splitlines(), start=1):
        if line.strip():
            examples.append(parse_example(line, f"{p} line {lineno}"))
    if not examples:
        raise DataError(problem(str(p), "at least one example", "none", "write one JSON object per line"))
    return examples


def parse_example(line: str, where: str) -> Example:
    """One JSONL line as an Example, or a DataError saying what is wrong with it."""
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise DataError(problem(where, "a JSON object", f"invalid JSON ({e.msg})", "fix or remove the line")) from None
    shape = 'an object with string "prompt" and "response", or "messages" ending with an assistant message'
    if not isinstance(obj, dict):
        raise DataError(problem(where, shape, type(obj).__name__, "fix or remove the line"))
    if "messages" in obj:
        msgs = obj["messages"]
        ok = isinstance(msgs, list) and len(msgs) >= 2
        ok = ok and all(isinstance(m, dict) and isinstance(m.get("role"), str) for m in msgs)
        ok = ok and all(isinstance(m.get("content"), str) for m in msgs)
        if not ok:
            raise DataError(
                problem(where, "messages: a list of >= 2 {role, content} strings", repr(msgs)[:80], "fix the line")
            )
        if msgs[-1]["role"] != "assistant":
            raise DataError(
                problem(where, "the last message from role 'assistant'", repr(msgs[-1]["role"]), "end with the answer")
            )
        prior = tuple({"role": m["role"], "content": m["content"]} for m in msgs[:-1])
        return Example(prior, msgs[-1]["content"], where)
    if not isinstance(obj.get("prompt"), str) or not isinstance(obj.get("response"), str):
        raise DataError(problem(where, shape, f"keys {sorted(obj)}", "fix or remove the line"))
    return Example(({"role": "user", "content": obj["prompt"]},), obj["response"], where)


# ----- formatting and tokenizing -----


class Formatter:
    """Example -> (prompt ids, response ids) with the chat template or the plain template."""

    def __init__(self, tokenizer: Any, metadata: dict[str, Any], cfg: InstructConfig):
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
        self.bos = tokenizer.id_to_token(tokenizer.bos_id) if tokenizer.bos_id is not None else ""
        self.eos = tokenizer.id_to_token(tokenizer.eos_id) if tokenizer.eos_id is not None else ""

    def texts(self, ex: Example) -> tuple[str, str]:
        """Prompt text (ending where the assistant starts) and response text (incl. end-of-turn)."""
        if self.chat_template is None:
            prompt = "\n\n".join(m["content"] for m in ex.messages)
            return (
                self.cfg.plain_prompt.replace("{prompt}", prompt),
                self.cfg.plain_response.replace("{response}", ex.response),
            )
        from pipeline.chat import render_chat

        msgs = list(ex.messages)
        prompt = render_chat(self.chat_template, msgs, self.bos, self.eos, add_generation_prompt=True)
        full = render_chat(
            self.chat_template,
            [*msgs, {"role": "assistant", "content": ex.response}],
            self.bos,
            self.eos,
            add_generation_prompt=False,
        )
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

    def encode(self, ex: Example) -> tuple[list[int], list[int]]:
        prompt_text, response_text = self.texts(ex)
        prompt = self.tok.encode(prompt_text)
        if self.tok.add_bos and self.tok.bos_id is not None and prompt[:1] != [self.tok.bos_id]:
            prompt = [self.tok.bos_id, *prompt]
        response = self.tok.encode(response_text) if response_text else []
        if self.chat_template is None and self.cfg.append_eos and self.tok.eos_id is not None:
            response.append(self.tok.eos_id)
        return prompt, response


def truncate(
    prompt: list[int], response: list[int], cfg: InstructConfig, bos_id: int | None, where: str
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


def example_arrays(prompt: list[int], response: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """input ids (n) and labels (n): label[t] = token[t+1] when it is a response token, else -100."""
    tokens = np.asarray(prompt + response, dtype=np.int64)
    labels = np.full(len(tokens), IGNORE_INDEX, dtype=np.int64)
    labels[max(len(prompt), 1) - 1 : len(tokens) - 1] = tokens[max(len(prompt), 1) :]
    return tokens, labels


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


def build_instruct(examples: list[Example], tokenizer: Any, metadata: dict[str, Any], cfg: InstructConfig) -> Packed:
    """Format, tokenize, truncate and pack `examples`; stats count truncated examples and tokens."""
    fmt = Formatter(tokenizer, metadata, cfg)
    encoded = []
    stats = {"examples": len(examples), "truncated": 0, "prompt_tokens": 0, "response_tokens": 0}
    for ex in examples:
        prompt, response = fmt.encode(ex)
        prompt, response, cut = truncate(prompt, response, cfg, tokenizer.bos_id, ex.where)
        stats["truncated"] += int(cut)
        stats["prompt_tokens"] += len(prompt)
        stats["response_tokens"] += len(response)
        encoded.append(example_arrays(prompt, response))
    pad = tokenizer.pad_id if tokenizer.pad_id is not None else (tokenizer.eos_id or 0)
    x, y, seg = pack_examples(encoded, cfg.max_seq_len, pad, cfg.pack)
    stats["rows"] = int(x.shape[0])
    stats["label_tokens"] = int((y != IGNORE_INDEX).sum())
    stats["filled_positions"] = int((seg > 0).sum())
    stats["chat_template"] = int(fmt.chat_template is not None)
    return Packed(x, y, seg, stats)


def save_packed(packed: Packed, path: str | os.PathLike[str]) -> Path:
    """An .npz of the three arrays plus stats (JSON), written atomically."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}.npz")
    try:
        np.savez(
            tmp,
            input_ids=packed.input_ids,
            labels=packed.labels,
            segment_ids=packed.segment_ids,
            stats=np.frombuffer(json.dumps(packed.stats).encode(), dtype=np.uint8),
        )
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def load_packed(path: str | os.PathLike[str]) -> Packed:
    p = Path(path)
    if not p.is_file():
        raise DataError(problem(str(p), "packed instruction data (.npz)", "no such file", "re-run the data stage"))
    with np.load(p) as z:
        stats = json.loads(bytes(z["stats"]).decode())
        return Packed(z["input_ids"], z["labels"], z["segment_ids"], stats)


# ----- training-side helpers -----


def masked_cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-token NLL over positions whose label is not -100 (fp32 softmax)."""
    return F.cross_entropy(logits.flatten(0, -2).float(), labels.flatten(), ignore_index=IGNORE_INDEX)


class RowSampler:
    """Batches of packed rows (x, labels, segment_ids), epoch by epoch: each epoch visits every row
    once in a fresh seeded order; a batch may straddle two epochs. Its future is its state."""

    def __init__(self, packed: Packed, batch_size: int, seed: int):
        self.packed, self.batch_size = packed, batch_size
        self.rng = np.random.default_rng(seed)
        self.order = self.rng.permutation(len(packed.input_ids))
        self.drawn = 0  # rows handed out so far, over all epochs

    @property
    def rows(self) -> int:
        return len(self.packed.input_ids)

    @property
    def epoch(self) -> float:
        """Epochs completed so far (fractional)."""
        return self.drawn / self.rows

    def __call__(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        picks = []
        for _ in range(self.batch_size):
            at = self.drawn % self.rows
            if at == 0 and self.drawn > 0:
                self.order = self.rng.permutation(self.rows)
            picks.append(int(self.order[at]))
            self.drawn += 1
        p = self.packed
        return (
            torch.from_numpy(p.input_ids[picks]),
            torch.from_numpy(p.labels[picks]),
            torch.from_numpy(p.segment_ids[picks].astype(np.int64)),
        )

    def state(self) -> dict[str, Any]:
        return {"rng": self.rng.bit_generator.state, "order": self.order.tolist(), "drawn": self.drawn}

    def set_state(self, state: dict[str, Any]) -> None:
        self.rng.bit_generator.state = state["rng"]
        self.order = np.asarray(state["order"], dtype=np.int64)
        self.drawn = int(state["drawn"])


@torch.no_grad()
def response_nll(model: torch.nn.Module, packed: Packed, batch_size: int, device: torch.device) -> float:
    """Token-weighted mean NLL of every labelled (response) position of `packed`, fp32, no sampling:
    the held-out number the train stage reports and the evaluate stage reproduces from a GGUF."""
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    for i in range(0, len(packed.input_ids), batch_size):
        x = torch.from_numpy(packed.input_ids[i : i + batch_size]).to(device)
        y = torch.from_numpy(packed.labels[i : i + batch_size]).to(device)
        seg = torch.from_numpy(packed.segment_ids[i : i + batch_size].astype(np.int64)).to(device)
        n = int((y != IGNORE_INDEX).sum())
        if n:
            total += float(model.loss(x, y, seg)) * n
            count += n
    model.train(was_training)
    return total / max(count, 1)


# ----- the default data set: question/answer pairs from the Python language reference -----

_UNDERLINE = re.compile(r"^([*=\-~^])\1{2,}$")
_NOTE = ("New in version", "Added in version", "Changed in version", "Deprecated since")


def _sections(text: str) -> list[tuple[str, list[str]]]:
    """(title, body lines) for each underlined heading of a pydoc topic."""
    lines = text.split("\n")
    heads = [
        i
        for i in range(len(lines) - 1)
        if lines[i].strip()
        and _UNDERLINE.match(lines[i + 1].strip())
        and len(lines[i + 1].strip()) == len(lines[i].strip())
    ]
    out = []
    for n, i in enumerate(heads):
        end = heads[n + 1] if n + 1 < len(heads) else len(lines)
        out.append((lines[i].strip(), lines[i + 2 : end]))
    return out


def _paragraphs(body: list[str]) -> list[str]:
    """Blank-line separated paragraphs; prose re-flowed onto one line, indented blocks kept."""
    paras, cur = [], []
    for line in [*body, ""]:
        if line.strip():
            cur.append(line)
        elif cur:
            if cur[0].startswith(" "):
                paras.append(textwrap.dedent("\n".join(cur)).rstrip())
            else:
                paras.append(" ".join(s.strip() for s in cur))
            cur = []
    return [p for p in paras if not p.startswith(_NOTE)]


def _cap(paras: list[str], max_chars: int) -> str:
    """Whole paragraphs up to `max_chars`; the first one cut at a word boundary if it alone is longer."""
    out = ""
    for p in paras:
        joined = f"{out}\n\n{p}" if out else p
        if len(joined) > max_chars:
            break
        out = joined
    if not out and paras:
        out = paras[0][:max_chars].rsplit(" ", 1)[0].rstrip(",;:") + " ..."
    return out


def pydoc_pairs(max_chars: int = 600) -> list[dict[str, str]]:
    """{"id", "prompt", "response"} for every titled section of `pydoc_data.topics`, deterministic."""
    from pydoc_data.topics import topics

    pairs, seen = [], set()
    for key in sorted(topics):
        for title, body in _sections(topics[key]):
            answer = _cap(_paragraphs(body), max_chars)
            subject = title[0].lower() + title[1:] if title.startswith(("The ", "A ", "An ")) else title
            prompt = f"What does the Python documentation say about {subject}?"
            if not answer or prompt in seen:
                continue
            seen.add(prompt)
            pairs.append({"id": f"{key}/{title}", "prompt": prompt, "response": answer})
    return pairs


def write_pydoc_instruct(
    out_dir: str | os.PathLike[str], val_fraction: float = 0.1, seed: int = 0, max_chars: int = 600
) -> dict[str, int]:
    """`train.jsonl` / `val.jsonl` of pydoc Q/A pairs; the split is by topic, seeded, never empty."""
    from pipeline.atomic import write_text

    if not 0 < val_fraction < 1:
        raise ConfigError(problem("config key data.val_fraction", "in (0, 1)", repr(val_fraction), "set 0.1"))
    pairs = pydoc_pairs(max_chars)
    topics = sorted({p["id"].split("/", 1)[0] for p in pairs})
    random.Random(seed).shuffle(topics)
    n_val = min(len(topics) - 1, max(1, round(val_fraction * len(topics))))
    val_topics = set(topics[:n_val])
    split = {"train": [], "val": []}
    for p in pairs:
        split["val" if p["id"].split("/", 1)[0] in val_topics else "train"].append(p)
    out = Path(out_dir)
    for name, rows in split.items():
        write_text(out / f"{name}.jsonl", "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    return {"train": len(split["train"]), "val": len(split["val"]), "topics": len(topics)}


# ----- the pack stage for data.source=instruct -----


def split_examples(lines: list[str], val_fraction: float, seed: int) -> dict[str, list[str]]:
    """A seeded split of example lines, at least one on each side, order kept within a split."""
    if len(lines) < 2:
        raise DataError(
            problem("instruct data", "at least 2 examples (one train, one val)", str(len(lines)), "add examples")
        )
    order = list(range(len(lines)))
    random.Random(seed).shuffle(order)
    n_val = min(len(lines) - 1, max(1, round(val_fraction * len(lines))))
    val = set(order[:n_val])
    return {
        "train": [x for i, x in enumerate(lines) if i not in val],
        "val": [x for i, x in enumerate(lines) if i in val],
    }


def write_instruct_splits(data: Any, out_dir: Path) -> dict[str, int]:
    """`train.jsonl` / `val.jsonl` in `out_dir`: the pydoc Q/A set (data.path empty, split by topic)
    or the lines of the JSONL at data.path, every line validated first (errors name the line)."""
    from pipeline.atomic import write_text

    if not data.path:
        return write_pydoc_instruct(out_dir, data.val_fraction, data.split_seed, data.max_chars)
    read_instruct_jsonl(data.path)  # a malformed line is an error naming it, before anything is written
    lines = [line for line in Path(data.path).read_text(encoding="utf-8").splitlines() if line.strip()]
    split = split_examples(lines, data.val_fraction, data.split_seed)
    for name, rows in split.items():
        write_text(Path(out_dir) / f"{name}.jsonl", "".join(r + "\n" for r in rows))
    return {"train": len(split["train"]), "val": len(split["val"])}


def pack_instruct(data: Any, tokenizer: Any, metadata: dict[str, Any], out_dir: Path) -> tuple[Any, dict[str, float]]:
    """The pack stage for instruct data (`data` is a DataConfig): split, format with the base's chat
    template (or the plain one), truncate, pack, and write `out_dir` atomically."""
    import hashlib
    import time
    from dataclasses import asdict

    from pipeline.atomic import atomic_dir, write_json
    from pipeline.pack import PackMeta

    start = time.perf_counter()
    cfg = data.instruct_config()
    with atomic_dir(out_dir) as tmp:
        write_instruct_splits(data, tmp)
        packed = {
            name: build_instruct(read_instruct_jsonl(tmp / f"{name}.jsonl"), tokenizer, metadata, cfg)
            for name in ("train", "val")
        }
        for name, p in packed.items():
            save_packed(p, tmp / f"{name}.npz")
        sha = hashlib.sha256(b"".join((tmp / f"{n}.jsonl").read_bytes() for n in ("train", "val"))).hexdigest()
        ids = np.concatenate([p.input_ids[p.segment_ids > 0] for p in packed.values()])
        meta = PackMeta(
            vocab_size=tokenizer.vocab_size,
            dtype="int64",
            tokenizer_fingerprint=tokenizer.fingerprint(),
            corpus_sha256=sha,
            source="instruct",
            bos_id=tokenizer.bos_id,
            eos_id=tokenizer.eos_id,
            documents={n: p.stats["examples"] for n, p in packed.items()},
            tokens={n: p.stats["filled_positions"] for n, p in packed.items()},
            distinct_tokens=int(np.unique(ids).size),
            format="instruct",
            seq_len=cfg.max_seq_len,
            stats={n: p.stats for n, p in packed.items()},
        )
        write_json(tmp / "meta.json", asdict(meta))
    elapsed = time.perf_counter() - start
    metrics: dict[str, float] = {"seconds": elapsed, "chat_template": float(packed["train"].stats["chat_template"])}
    for name, p in packed.items():
        for key in ("examples", "truncated", "rows", "label_tokens", "prompt_tokens", "response_tokens"):
            metrics[f"{key}_{name}"] = float(p.stats[key])
    metrics["tokens"] = float(sum(p.stats["filled_positions"] for p in packed.values()))
    return meta, metrics
