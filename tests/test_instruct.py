"""Instruction data: parsing with line-numbered errors, chat/plain formatting, response-only labels,
truncation, packing with segment masks, and the default pydoc Q/A set."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from pipeline.config import DataConfig
from pipeline.data.instruct import (
    Example,
    Formatter,
    build_instruct,
    example_arrays,
    pack_examples,
    read_instruct_jsonl,
    truncate,
)
from pipeline.data.packed import load_rows, save_rows
from pipeline.data.pydoc_qa import pydoc_pairs, write_pydoc_instruct
from pipeline.errors import ConfigError, DataError
from pipeline.gguf.reader import GGUFFile
from pipeline.models.llama import Llama
from pipeline.models.ops.losses import IGNORE_INDEX
from pipeline.models.transformer import TransformerConfig, init_weights
from pipeline.tokenizer.gguf_tokenizer import tokenizer_from_gguf
from pipeline.training.batches import RowSampler
from tests.helpers import masked_cross_entropy

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tok(smollm2: GGUFFile):
    return tokenizer_from_gguf(smollm2)


@pytest.fixture(scope="module")
def plain_meta(smollm2: GGUFFile) -> dict:
    return {k: v for k, v in smollm2.metadata.items() if k != "tokenizer.chat_template"}


def write_lines(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n")
    return path


def ex(prompt: str, response: str) -> Example:
    return Example(({"role": "user", "content": prompt},), response, "test")


# ----- reading -----


def test_reads_both_formats_and_skips_blank_lines(tmp_path: Path) -> None:
    path = write_lines(
        tmp_path / "d.jsonl",
        [
            json.dumps({"prompt": "2+2?", "response": "4"}),
            "",
            json.dumps(
                {
                    "messages": [
                        {"role": "system", "content": "Be brief."},
                        {"role": "user", "content": "Capital of France?"},
                        {"role": "assistant", "content": "Paris."},
                    ]
                }
            ),
        ],
    )
    a, b = read_instruct_jsonl(path)
    assert a.messages == ({"role": "user", "content": "2+2?"},) and a.response == "4"
    assert [m["role"] for m in b.messages] == ["system", "user"] and b.response == "Paris."
    assert b.where.endswith("line 3")


@pytest.mark.parametrize(
    ("line", "pattern"),
    [
        ("{not json", r"line 2: expected a JSON object, found invalid JSON"),
        (
            '{"prompt": "q \\ud800", "response": "a"}',
            r"line 2: expected valid Unicode text, found a lone surrogate \\ud800",
        ),
        ('["a", "b"]', r"line 2: expected an object with string \"prompt\".*found list"),
        ('{"prompt": "q"}', r"line 2: expected an object.*found keys \['prompt'\]"),
        ('{"prompt": "q", "response": 3}', r"line 2: .*found \"response\" of type int \(3\); fix"),
        ('{"prompt": ["q"], "completion": "a"}', r'line 2: .*found "prompt" of type list \(\["q"\]\); fix'),
        ('{"instruction": "q", "input": 3, "output": "a"}', r'line 2: expected Alpaca string "instruction"'),
        ('{"messages": [{"role": "user", "content": "hi"}]}', r"line 2: expected messages: a list of >= 2"),
        (
            '{"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]}',
            r"line 2: expected the last message from role 'assistant', found 'user'",
        ),
        ('{"prompt": "q", "response": ""}', r'line 2 "response": expected a non-empty response, found an empty str'),
        ('{"prompt": "q", "response": " \\n\\t"}', r"line 2 \"response\": .*found only whitespace \(' \\n\\t'\)"),
        (
            '{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": ""}]}',
            r"line 2 the last message's content: expected a non-empty response.*fix: write the answer",
        ),
    ],
)
def test_malformed_line_is_named_with_its_number(tmp_path: Path, line: str, pattern: str) -> None:
    path = write_lines(tmp_path / "bad.jsonl", [json.dumps({"prompt": "ok", "response": "fine"}), line])
    with pytest.raises(DataError, match=pattern) as info:
        read_instruct_jsonl(path)
    assert "\n" not in str(info.value) and str(path) in str(info.value)


def test_gzip_and_unicode_line_separators_read_like_a_jsonl_corpus(tmp_path: Path) -> None:
    """A `.jsonl.gz` (as `data=jsonl` reads) was 'undecodable bytes at 1; re-encode as UTF-8', and a raw
    U+2028 inside a JSON string (json.dumps(ensure_ascii=False) writes it so) cut its line in two."""
    import gzip

    from pipeline.data.instruct_pack import write_instruct_splits

    lines = [json.dumps({"prompt": f"q{i}\u2028more", "response": "a\x85b"}, ensure_ascii=False) for i in range(4)]
    plain = write_lines(tmp_path / "my.jsonl", lines)
    packed = tmp_path / "my.jsonl.gz"
    packed.write_bytes(gzip.compress(plain.read_bytes()))
    for path in (plain, packed):
        got = read_instruct_jsonl(path)
        assert [e.messages[0]["content"] for e in got] == [f"q{i}\u2028more" for i in range(4)]
        assert got[3].where.endswith("line 4") and got[0].response == "a\x85b"
    out = tmp_path / "out"
    out.mkdir()
    write_instruct_splits(DataConfig(source="instruct", path=str(packed), val_fraction=0.25), out)
    rows = [r for name in ("train", "val") for r in (out / f"{name}.jsonl").read_text(encoding="utf-8").split("\n")]
    assert sorted(r for r in rows if r) == sorted(lines)


def test_a_directory_is_named_as_one(tmp_path: Path) -> None:
    """data.path at a folder said 'found no such file' about a folder that plainly exists."""
    with pytest.raises(DataError, match=r"expected an instruction JSONL file, found a directory; fix: point data.path"):
        read_instruct_jsonl(tmp_path)
    with pytest.raises(DataError, match=r"found no such file; fix: check data.path"):
        read_instruct_jsonl(tmp_path / "nope.jsonl")


def test_a_utf8_bom_before_the_first_line_is_dropped(tmp_path: Path) -> None:
    from pipeline.data.instruct_pack import write_instruct_splits

    lines = [json.dumps({"prompt": f"q{i}", "response": "a"}) for i in range(4)]
    path = tmp_path / "my.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + "\r\n".join(lines).encode())
    assert [ex.messages[0]["content"] for ex in read_instruct_jsonl(path)] == ["q0", "q1", "q2", "q3"]
    out = tmp_path / "out"
    out.mkdir()
    write_instruct_splits(DataConfig(source="instruct", path=str(path), val_fraction=0.25), out)
    rows = [r for name in ("train", "val") for r in (out / f"{name}.jsonl").read_text(encoding="utf-8").splitlines()]
    assert sorted(rows) == sorted(lines)


def test_an_empty_response_in_the_users_file_is_named_before_anything_is_written(tmp_path: Path) -> None:
    from pipeline.data.instruct_pack import write_instruct_splits

    good = json.dumps({"prompt": "ok", "response": "fine"})
    path = write_lines(tmp_path / "my.jsonl", [good, good, "", json.dumps({"prompt": "q", "response": "\n"})])
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(DataError, match=rf"{path} line 4 \"response\": expected a non-empty response"):
        write_instruct_splits(DataConfig(source="instruct", path=str(path)), out)
    assert not list(out.iterdir())


# ----- formatting -----


def test_chat_template_formats_prompt_and_response(tok, smollm2: GGUFFile) -> None:
    fmt = Formatter(tok, smollm2.metadata, DataConfig())
    prompt, response = fmt.texts(ex("What is 2+2?", "It is 4."))
    assert prompt.endswith("<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n")
    assert response == "It is 4.<|im_end|>\n"
    p_ids, r_ids = fmt.encode(ex("What is 2+2?", "It is 4."))
    assert tok.decode(p_ids + r_ids, skip_special=False) == prompt + response
    assert tok.eos_id in r_ids  # <|im_end|> ends the turn, and is learned
    assert not tok.add_bos and p_ids[0] == tok.token_to_id("<|im_start|>")


def test_plain_template_when_the_gguf_has_none(tok, plain_meta: dict) -> None:
    fmt = Formatter(tok, plain_meta, DataConfig())
    assert fmt.chat_template is None
    prompt, response = fmt.texts(ex("Why?", "Because."))
    assert (prompt, response) == ("Question: Why?\nAnswer: ", "Because.")
    _, r_ids = fmt.encode(ex("Why?", "Because."))
    assert r_ids[-1] == tok.eos_id
    with pytest.raises(ConfigError, match="data.template=chat: expected a base GGUF with tokenizer.chat_template"):
        Formatter(tok, plain_meta, DataConfig(template="chat"))


def test_labels_are_response_tokens_only() -> None:
    x, y = example_arrays([5, 6, 7], [8, 9])
    assert x.tolist() == [5, 6, 7, 8, 9]
    assert y.tolist() == [IGNORE_INDEX, IGNORE_INDEX, 8, 9, IGNORE_INDEX]


def test_loss_ignores_prompt_targets_and_sees_response_targets() -> None:
    cfg = TransformerConfig(vocab_size=50, d_model=32, n_layer=2, n_head=4, n_kv_head=2, d_ff=64, context_length=32)
    model = Llama(cfg)
    init_weights(model, 0.2, 0)
    prompt, response = [3, 14, 15, 9, 26], [5, 35, 8, 9]
    x, labels = example_arrays(prompt, response)
    x_t = torch.from_numpy(x)[None]
    logits = model(x_t)
    base = masked_cross_entropy(logits, torch.from_numpy(labels)[None])
    # what the prompt positions would target (their next tokens) does not enter the loss
    raw = np.append(x[1:], 0)
    changed = raw.copy()
    changed[: len(prompt) - 1] = [40, 41, 42, 43]
    masked = np.where(np.arange(len(x)) >= len(prompt) - 1, changed, IGNORE_INDEX)
    masked[-1] = IGNORE_INDEX
    assert torch.equal(masked_cross_entropy(logits, torch.from_numpy(masked)[None]), base)
    # a different response token changes it
    other = labels.copy()
    other[len(prompt)] = 44
    assert not torch.equal(masked_cross_entropy(logits, torch.from_numpy(other)[None]), base)
    # and gradients reach no prompt position's logits
    logits = logits.detach().requires_grad_(True)
    masked_cross_entropy(logits, torch.from_numpy(labels)[None]).backward()
    assert logits.grad[0, : len(prompt) - 1].abs().sum() == 0 and logits.grad[0, len(prompt) - 1].abs().sum() > 0
    # equal to plain cross-entropy over the response positions alone
    sel = labels != IGNORE_INDEX
    plain = F.cross_entropy(logits[0][torch.from_numpy(sel)], torch.from_numpy(labels[sel]))
    torch.testing.assert_close(base, plain)


# ----- truncation -----


def test_truncation_cuts_the_prompt_start_and_keeps_bos() -> None:
    cfg = DataConfig(max_seq_len=6)
    p, r, cut = truncate([1, 10, 11, 12, 13, 14], [20, 21, 22], cfg, bos_id=1, where="x")
    assert (p, r, cut) == ([1, 13, 14], [20, 21, 22], True)
    p, r, cut = truncate([10, 11], [20, 21], cfg, bos_id=1, where="x")
    assert (p, r, cut) == ([10, 11], [20, 21], False)
    # a response longer than the row keeps min_prompt_tokens of prompt and loses its end
    p, r, cut = truncate([10, 11, 12], list(range(20, 30)), DataConfig(max_seq_len=6, min_prompt_tokens=2), None, "x")
    assert (p, r, cut) == ([11, 12], [20, 21, 22, 23], True)


def test_response_empty_after_truncation_is_named() -> None:
    with pytest.raises(DataError, match=r"d.jsonl line 4: expected a response with at least one token.*max_seq_len=4"):
        truncate([10, 11], [], DataConfig(max_seq_len=4), None, "d.jsonl line 4")
    # no prompt left: the response's first token has nothing to be predicted from
    with pytest.raises(DataError, match=r"found 0 \(prompt 0 tokens kept, response 1\)"):
        truncate([], [20], DataConfig(max_seq_len=4, min_prompt_tokens=0), None, "x")
    with pytest.raises(ConfigError, match="data.min_prompt_tokens"):
        DataConfig(max_seq_len=4, min_prompt_tokens=4)


def test_empty_plain_response_without_eos_is_an_error(tok, plain_meta: dict) -> None:
    with pytest.raises(DataError, match="line 9"):
        examples = [Example(({"role": "user", "content": "q"},), "", "f line 9")]
        build_instruct(examples, tok, plain_meta, DataConfig(add_eos=False))


def test_build_counts_truncated_examples(tok, smollm2: GGUFFile) -> None:
    long = " ".join(["word"] * 200)
    examples = [ex("short?", "yes"), ex(long, "fine"), ex("again?", "no")]
    packed = build_instruct(examples, tok, smollm2.metadata, DataConfig(max_seq_len=64))
    assert packed.stats["truncated"] == 1 and packed.stats["examples"] == 3
    assert packed.input_ids.shape[1] == 64
    # the learned tokens are the three whole responses, the truncated one's included
    learned = tok.decode(packed.labels[packed.labels >= 0].tolist(), skip_special=False)
    assert learned == "yes<|im_end|>\nfine<|im_end|>\nno<|im_end|>\n"


# ----- packing and segment masks -----


def test_packing_keeps_examples_whole_and_separate() -> None:
    encoded = [example_arrays([1, 2], [3, 4]), example_arrays([5], [6, 7]), example_arrays([8, 9, 10], [11, 12])]
    x, y, seg = pack_examples(encoded, seq_len=8, pad_id=0)
    assert x.tolist() == [[1, 2, 3, 4, 5, 6, 7, 0], [8, 9, 10, 11, 12, 0, 0, 0]]
    assert seg.tolist() == [[1, 1, 1, 1, 2, 2, 2, 0], [1, 1, 1, 1, 1, 0, 0, 0]]
    # no label crosses an example boundary; padding has none
    assert y.tolist()[0] == [-100, 3, 4, -100, 6, 7, -100, -100]
    x1, _, seg1 = pack_examples(encoded, seq_len=8, pad_id=0, pack=False)
    assert x1.shape == (3, 8) and seg1.max() == 1


def test_packed_data_round_trips_and_samples(tmp_path: Path, tok, smollm2: GGUFFile) -> None:
    examples = [ex(f"q{i}?", f"a{i}") for i in range(6)]
    packed = build_instruct(examples, tok, smollm2.metadata, DataConfig(max_seq_len=256))
    assert packed.input_ids.shape[0] == 1 and packed.segment_ids.max() == 6  # all six share one row
    assert packed.stats["filled_positions"] == packed.stats["prompt_tokens"] + packed.stats["response_tokens"]
    back = load_rows(save_rows(packed, tmp_path / "train.npz"))
    assert np.array_equal(back.input_ids, packed.input_ids) and back.stats == packed.stats
    x, y, seg = RowSampler(back, 3, seed=0)()
    assert x.shape == y.shape == seg.shape == (3, 256) and x.dtype == torch.int64


def test_bad_instruct_config_is_named() -> None:
    with pytest.raises(ConfigError, match="data.max_seq_len"):
        DataConfig(max_seq_len=1)
    with pytest.raises(ConfigError, match="data.template"):
        DataConfig(template="alpaca")
    with pytest.raises(ConfigError, match=r"\{prompt\}"):
        DataConfig(plain_prompt="Q:")


# ----- the default data set -----


def test_pydoc_pairs_are_deterministic_and_split_by_topic(tmp_path: Path) -> None:
    pairs = pydoc_pairs(max_chars=400)
    assert len(pairs) > 100 and pairs == pydoc_pairs(max_chars=400)
    assert len({p["prompt"] for p in pairs}) == len(pairs)
    assert all(p["response"].strip() and len(p["response"]) <= 404 for p in pairs)
    assert any(p["prompt"] == 'What does the Python documentation say about the "for" statement?' for p in pairs)
    counts = write_pydoc_instruct(tmp_path, val_fraction=0.1, seed=0, max_chars=400)
    train, val = read_instruct_jsonl(tmp_path / "train.jsonl"), read_instruct_jsonl(tmp_path / "val.jsonl")
    assert (len(train), len(val)) == (counts["train"], counts["val"]) and counts["val"] > 0
    assert len(train) + len(val) == len(pairs)

    def topics(path: Path) -> set[str]:
        return {json.loads(line)["id"].split("/")[0] for line in path.read_text().splitlines()}

    assert not topics(tmp_path / "train.jsonl") & topics(tmp_path / "val.jsonl")
    again = tmp_path / "again"
    write_pydoc_instruct(again, val_fraction=0.1, seed=0, max_chars=400)
    assert (again / "val.jsonl").read_bytes() == (tmp_path / "val.jsonl").read_bytes()
