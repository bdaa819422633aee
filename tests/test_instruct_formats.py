"""Instruction-data shapes (TRL prompt/completion, Alpaca, ShareGPT, messages) read as one conversation,
and `data.all_turns`: every assistant answer learned, the rest never; one answer is exactly as before."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from pipeline.config import DataConfig
from pipeline.data.instruct import Example, Formatter, build_instruct, example_arrays, parse_example, turn_texts
from pipeline.errors import DataError
from pipeline.gguf.reader import GGUFFile
from pipeline.models.ops.losses import IGNORE_INDEX
from pipeline.tokenizer.gguf_tokenizer import tokenizer_from_gguf
from tests.test_tokenizer import spm_gguf

CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Capital of France?"},
    {"role": "assistant", "content": "Paris."},
    {"role": "user", "content": "And of Italy?"},
    {"role": "assistant", "content": "Rome."},
]


@pytest.fixture(scope="module")
def tok(smollm2: GGUFFile):
    return tokenizer_from_gguf(smollm2)


@pytest.fixture(scope="module")
def plain_meta(smollm2: GGUFFile) -> dict:
    return {k: v for k, v in smollm2.metadata.items() if k != "tokenizer.chat_template"}


def user(text: str) -> dict[str, str]:
    return {"role": "user", "content": text}


@pytest.mark.parametrize(
    ("obj", "messages", "response"),
    [
        ({"prompt": "2+2?", "completion": "4"}, [user("2+2?")], "4"),
        ({"instruction": "Add.", "input": "2 and 2", "output": "4"}, [user("Add.\n\n2 and 2")], "4"),
        ({"instruction": "Say hi.", "input": "", "output": "hi"}, [user("Say hi.")], "hi"),
        ({"instruction": "Say hi.", "input": None, "output": "hi"}, [user("Say hi.")], "hi"),  # pandas' null
        (
            {
                "conversations": [
                    {"from": "system", "value": "S"},
                    {"from": "human", "value": "Q"},
                    {"from": "gpt", "value": "A"},
                ]
            },
            [{"role": "system", "content": "S"}, user("Q")],
            "A",
        ),
        ({"messages": CHAT}, CHAT[:-1], "Rome."),
    ],
)
def test_every_shape_is_one_conversation(obj: dict, messages: list, response: str) -> None:
    ex = parse_example(json.dumps(obj), "f line 1")
    assert list(ex.messages) == messages and ex.response == response


@pytest.mark.parametrize(
    ("obj", "needle"),
    [
        ({"conversations": [{"from": "human", "value": "Q"}, {"from": "bot", "value": "A"}]}, "ShareGPT 'from'"),
        ({"conversations": [{"from": "human", "value": "Q"}]}, "conversations: >= 2"),
        ({"instruction": "x", "input": 3, "output": "y"}, "Alpaca string"),
        ({"prompt": "q", "completion": 4}, 'found "completion" of type int (4)'),
        ({"prompt": "q", "answer": "a"}, "found keys ['answer', 'prompt']"),
        ({"conversations": [{"from": "gpt", "value": "A"}, {"from": "human", "value": "Q"}]}, "role 'assistant'"),
        ({"messages": [{"role": "human", "content": "Q"}, {"role": "assistant", "content": "A"}]}, "use 'user'"),
        ({"messages": [{"role": "user", "content": "Q"}, {"role": "bot", "content": "A"}]}, "found 'bot'"),
    ],
)
def test_malformed_shapes_are_named(obj: dict, needle: str) -> None:
    with pytest.raises(DataError) as err:
        parse_example(json.dumps(obj), "data.jsonl line 7")
    assert str(err.value).startswith("data.jsonl line 7: expected") and needle in str(err.value)


def answer_text(tok, prompt: list[int], response: list[int], mask) -> str:
    x, y = example_arrays(prompt, response, mask)
    return tok.decode([int(t) for t in y[y != IGNORE_INDEX]], skip_special=False)


@pytest.mark.parametrize("template", ["chat", "plain"])
def test_one_answer_all_turns_is_exactly_the_last_turn_rule(tok, smollm2: GGUFFile, plain_meta, template) -> None:
    meta = smollm2.metadata if template == "chat" else plain_meta
    fmt = Formatter(tok, meta, DataConfig(template=template))
    ex = Example(({"role": "user", "content": "Why?"},), "Because.", "t")
    prompt, rest, mask = fmt.encode_turns(ex)
    assert (prompt, rest) == fmt.encode(ex) and all(mask)
    assert [t for t, _ in turn_texts(fmt, ex)] == list(fmt.texts(ex))


@pytest.mark.parametrize("template", ["chat", "plain"])
def test_all_turns_learns_every_answer_and_nothing_else(tok, smollm2: GGUFFile, plain_meta, template) -> None:
    meta = smollm2.metadata if template == "chat" else plain_meta
    ex = parse_example(json.dumps({"messages": CHAT}), "t")
    fmt = Formatter(tok, meta, DataConfig(template=template))
    prompt, rest, mask = fmt.encode_turns(ex)
    learned = answer_text(tok, prompt, rest, mask)
    assert "Paris." in learned and "Rome." in learned
    assert "France" not in learned and "Italy" not in learned and "brief" not in learned
    last_only = answer_text(tok, *fmt.encode(ex), None)
    assert "Rome." in last_only and "Paris." not in last_only
    if template == "chat":  # the whole conversation is the one rendering, cut into pieces
        assert tok.decode(prompt + rest, skip_special=False) == "".join(t for t, _ in turn_texts(fmt, ex))


def test_build_with_all_turns_counts_more_label_tokens(tok, smollm2: GGUFFile) -> None:
    examples = [parse_example(json.dumps({"messages": CHAT}), f"t line {i}") for i in range(3)]
    last = build_instruct(examples, tok, smollm2.metadata, DataConfig(source="instruct"))
    every = build_instruct(examples, tok, smollm2.metadata, DataConfig(source="instruct", all_turns=True))
    assert np.array_equal(last.input_ids, every.input_ids)  # the same tokens, more of them learned
    assert every.stats["label_tokens"] > last.stats["label_tokens"] > 0


def test_instruct_pack_reads_alpaca_and_sharegpt_files(tmp_path: Path, smollm2_path: Path) -> None:
    from pipeline.data.pack import run_pack

    lines = [{"instruction": f"Task {i}", "input": "", "output": f"Done {i}"} for i in range(6)]
    lines += [
        {"conversations": [{"from": "human", "value": f"Q{i}"}, {"from": "gpt", "value": f"A{i}"}]} for i in range(4)
    ]
    path = tmp_path / "mixed.jsonl"
    path.write_text("".join(json.dumps(obj) + "\n" for obj in lines))
    meta, metrics = run_pack(
        DataConfig(source="instruct", path=str(path), val_fraction=0.2), smollm2_path, tmp_path / "p"
    )
    assert meta.documents == {"train": 8, "val": 2} and metrics["label_tokens_train"] > 0


LLAMA2_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] == 'user' %}{{ '[INST] ' + m['content'].strip() + ' [/INST]' }}"
    "{% elif m['role'] == 'assistant' %}{{ ' ' + m['content'].strip() + ' ' + eos_token }}{% endif %}{% endfor %}"
)


@pytest.mark.parametrize("template", ["chat", "plain"])
def test_a_sentencepiece_answer_has_the_ids_of_the_whole_conversation(tmp_path: Path, template: str) -> None:
    """A SentencePiece donor (Llama 2, Mistral, TinyLlama): llama.cpp adds the space prefix only at the
    start of the text and after a special token. Before, an answer tokenized apart from its prompt
    began with a stray '▁' (learned, then emitted after every `[/INST]`); now prompt + answer ids are
    the ids of the whole rendering, for one answer and for every turn."""
    tok = tokenizer_from_gguf(GGUFFile(spm_gguf(tmp_path / "spm.gguf")))
    meta = {"tokenizer.chat_template": LLAMA2_TEMPLATE} if template == "chat" else {}
    fmt = Formatter(tok, meta, DataConfig(template=template))
    ex = Example((user("hello world"), {"role": "assistant", "content": "world"}, user("hé")), "hello world", "t")
    prompt, response = fmt.encode(ex)
    first, rest, _ = fmt.encode_turns(ex)
    if template == "chat":  # the ids llama.cpp gives the rendered conversation
        assert prompt + response == tok.encode("".join(fmt.texts(ex)))
        assert first + rest == tok.encode("".join(text for text, _ in turn_texts(fmt, ex)))
        assert tok.id_to_token(response[0]) == "▁hello"
    else:  # cut after the prompt's trailing space: the answer's text follows it with no space added
        assert tok.decode(prompt + response) == "".join(fmt.texts(ex))
        assert rest[-len(response) :] == response  # the last turn, as one answer has it
