"""Robust readers: every malformed GGUF, chat template or intermediate file ends in one named line
(file, key or tensor, expected vs found, fix) within a time bound, and valid files read as before.

The fuzz cases come from tests/gguf_fuzz.py (`python -m tests.gguf_fuzz 200 0` runs them isolated
and prints the figures).
"""

from __future__ import annotations

import json
import math
import signal
import struct
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGUFReader
from jinja2.sandbox import ImmutableSandboxedEnvironment
from safetensors.numpy import save_file

from pipeline.config import DataConfig
from pipeline.data.pack import run_pack
from pipeline.data.packed import load_meta, load_rows
from pipeline.donor.pca import PCAResult
from pipeline.errors import ChatTemplateError, ConfigError, DataError, GGUFError, PipelineError
from pipeline.gguf.reader import GGUFFile
from pipeline.modeldir import TrainState, load_model_dir, model_config, save_model_dir
from pipeline.models.gpt2 import GPT2
from pipeline.models.gpt2_gguf import export_gpt2, load_gpt2
from pipeline.models.llama import Llama
from pipeline.models.registry import build_model, load_gguf
from pipeline.models.transformer import TransformerConfig
from pipeline.tokenizer import chat_template as chat
from pipeline.tokenizer.chat_template import render_chat
from pipeline.tokenizer.gguf_tokenizer import GGUFTokenizer
from tests.conftest import TINY_TEMPLATE
from tests.gguf_fuzz import (
    F32,
    I64,
    STRING,
    U32,
    U64,
    Layout,
    array,
    base_file,
    cases,
    classify,
    nested,
    parse,
    scalar,
    string,
    value,
)

pytestmark = pytest.mark.usefixtures("one_thread")
CASE_SECONDS = 2.0


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    return base_file(tmp_path_factory.mktemp("base"))


def forged(tmp_path: Path, base: bytes, edit) -> Path:
    """The base file with one structural edit (a function of its Layout), written to tmp_path."""
    lay = parse(base)
    edit(lay)
    path = tmp_path / "bad.gguf"
    path.write_bytes(lay.encode())
    return path


def named(call, path: Path | None, *fragments: str, error: type[PipelineError] = GGUFError) -> str:
    """`call()` raises `error` in one printable line that names `path` and every fragment, fast."""
    start = time.perf_counter()
    with pytest.raises(error) as e:
        call()
    msg = str(e.value)
    assert time.perf_counter() - start < CASE_SECONDS, msg
    assert msg.isprintable() and (path is None or str(path) in msg), msg
    for f in fragments:
        assert f in msg, (f, msg)
    return msg


# ---------------------------------------------------------------- fuzz


def _too_slow(signum: int, frame: object) -> None:
    raise TimeoutError("fuzz case ran past its time bound")


def test_fuzzed_ggufs_end_in_one_named_line_or_load_and_run(tmp_path: Path, base: bytes) -> None:
    """200 seeded mutations (bit flips, truncation, huge lengths, bad UTF-8, wrong types, deep nesting,
    shapes, tokenizer and chat template bombs, bulk sizes): reader, loader + forward, QLoRA loader,
    tokenizer + chat template and donor reader each end named or succeed, every case within 2 s."""
    found, before = Counter(), signal.signal(signal.SIGALRM, _too_slow)
    try:
        for name, data in cases(base, 200, seed=0):
            path = tmp_path / "case.gguf"
            path.write_bytes(data)
            signal.alarm(10)  # a hang fails this case by name instead of stalling the suite
            start = time.perf_counter()
            category, detail = classify(path)
            signal.alarm(0)
            found[category] += 1
            assert category in ("named", "loaded"), (name, category, detail)
            assert time.perf_counter() - start < CASE_SECONDS, (name, time.perf_counter() - start)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, before)
    assert found["named"] >= 150 and found["loaded"] >= 10, found


# ---------------------------------------------------------------- the GGUF reader


def test_the_tiny_model_reads_as_gguf_py_reads_it(tmp_path: Path, base: bytes) -> None:
    path = tmp_path / "m.gguf"
    path.write_bytes(base)
    g, ref = GGUFFile(path), GGUFReader(path)
    for key, field in ref.fields.items():
        if not key.startswith("GGUF."):
            want = field.contents()
            assert g.metadata[key] == (want.item() if isinstance(want, np.generic) else want), key
    for t in ref.tensors:
        np.testing.assert_array_equal(g.tensor(t.name), np.asarray(t.data).reshape(g.tensor_info(t.name).shape))
    model, _ = load_gguf(path)
    assert model(torch.arange(8)[None]).shape == (1, 8, 64)


@pytest.mark.parametrize("where", ["key", "string value", "token", "tensor name"])
def test_invalid_utf8_is_named_with_its_key(tmp_path: Path, base: bytes, where: str) -> None:
    def edit(lay: Layout) -> None:
        if where == "key":
            lay.kvs[0] = (b"gen\xfferal.x", lay.kvs[0][1])
        elif where == "string value":
            lay.set(b"general.name", value(STRING, b"caf\xc3"))
        elif where == "token":
            lay.set(b"tokenizer.ggml.tokens", array(STRING, [string(b"a"), string(b"\xed\xa0\x80")]))
        else:
            lay.tensors[0] = (lay.tensors[0][0] + b"\x80", *lay.tensors[0][1:])

    path = forged(tmp_path, base, edit)
    fragment = {"key": "key #0", "string value": "general.name", "token": "tokenizer.ggml.tokens[1]"}
    named(lambda: GGUFFile(path), path, "a UTF-8 string", "invalid UTF-8", fragment.get(where, "tensor #0 name"))


@pytest.mark.parametrize("depth", [5, 100_000])
def test_nested_arrays_are_refused_without_recursion(tmp_path: Path, base: bytes, depth: int) -> None:
    path = forged(tmp_path, base, lambda lay: lay.set(b"general.tags", nested(depth)))
    named(lambda: GGUFFile(path), path, "general.tags", "arrays nested at most 4 deep")


@pytest.mark.parametrize(
    "field,fragment",
    [(8, "tensor count"), (16, "metadata key count"), ("array", "tokenizer.ggml.tokens array length")]
    + [("string", "general.architecture"), ("dims", "token_embd.weight")],
)
def test_huge_declared_lengths_fail_fast(tmp_path: Path, base: bytes, field: object, fragment: str) -> None:
    raw = bytearray(base)
    if field == "array":
        at = base.index(b"tokenizer.ggml.tokens") + len(b"tokenizer.ggml.tokens") + 8
    elif field == "string":
        at = base.index(b"general.architecture") + len(b"general.architecture") + 4
    elif field == "dims":
        at = base.index(b"token_embd.weight") + len(b"token_embd.weight") + 4
    else:
        at = int(field)
    for huge in (2**64 - 1, 2**62, 2**40):
        struct.pack_into("<Q", raw, at, huge)
        path = tmp_path / "bad.gguf"
        path.write_bytes(bytes(raw))
        named(lambda p=path: load_gguf(p), path, fragment)


def test_bulk_arrays_read_in_one_pass_and_oversized_ones_are_refused(tmp_path: Path, base: bytes) -> None:
    path = forged(tmp_path, base, lambda lay: lay.set(b"general.tags", array(0, [b"\1"] * 10**6)))
    start = time.perf_counter()
    assert GGUFFile(path).metadata["general.tags"] == [1] * 10**6
    assert time.perf_counter() - start < 1.0
    path = forged(tmp_path, base, lambda lay: lay.set(b"general.tags", array(0, [b"\0"] * (5 * 2**20))))
    named(lambda: GGUFFile(path), path, "general.tags", "at most 4194304 entries")


@pytest.mark.parametrize(
    "key,payload,fragment",
    [
        (b"general.flag", value(7, True)[:-1] + b"\x02", "a bool (byte 0 or 1)"),
        (b"general.x\nname", value(U32, 1), "a name without control characters"),
        (b"general.alignment", value(U64, 32), "a uint32 power of two"),
        (b"general.alignment", value(U32, 24), "a uint32 power of two"),
        (b"general.x", struct.pack("<I", 13) + b"\0" * 8, "a GGUF value type (0-12)"),
    ],
)
def test_malformed_values_are_named(tmp_path: Path, base: bytes, key: bytes, payload: bytes, fragment: str) -> None:
    path = forged(tmp_path, base, lambda lay: lay.kvs.append((key, payload)))
    named(lambda: GGUFFile(path), path, fragment)


def test_duplicate_keys_and_tensors_are_named(tmp_path: Path, base: bytes) -> None:
    path = forged(tmp_path, base, lambda lay: lay.kvs.append(lay.kvs[1]))
    named(lambda: GGUFFile(path), path, "each key once")
    path = forged(tmp_path, base, lambda lay: lay.tensors.append(lay.tensors[0]))
    named(lambda: GGUFFile(path), path, "each tensor name once")


# ---------------------------------------------------------------- model loaders


@pytest.mark.parametrize(
    "key,payload,fragment",
    [
        (b"llama.block_count", array(U32, [scalar(U32, 1)]), "one integer in [0, "),
        (b"llama.embedding_length", value(STRING, b"16"), "one integer in [1, "),
        (b"llama.context_length", value(F32, 32.0), "one integer in [1, "),
        (b"llama.attention.head_count", value(7, True), "one integer in [1, 16]"),
        (b"llama.attention.layer_norm_rms_epsilon", value(F32, math.nan), "one finite number"),
        (b"llama.attention.layer_norm_rms_epsilon", array(F32, [scalar(F32, 1e-5)]), "one finite number"),
        (b"llama.rope.freq_base", value(F32, -1.0), "a positive number"),
        (b"llama.rope.scaling.type", value(U32, 1), "a string"),
        (b"llama.vocab_size", value(STRING, b"64"), "one integer in [1, "),
        (b"general.architecture", array(STRING, [string(b"llama")]), "a string"),
        (b"tokenizer.ggml.tokens", value(STRING, b"abc"), "a list of token strings"),
    ],
)
def test_wrongly_typed_keys_are_named(tmp_path: Path, base: bytes, key: bytes, payload: bytes, fragment: str) -> None:
    path = forged(tmp_path, base, lambda lay: lay.set(key, payload))
    named(lambda: load_gguf(path), path, key.decode(), fragment)


@pytest.mark.parametrize(
    "key,payload,fragment",
    [
        (b"llama.block_count", value(U32, 2**32 - 1), "llama.block_count"),
        (b"llama.block_count", value(U64, 2**40), "llama.block_count"),
        (b"llama.feed_forward_length", value(U64, 2**62), "llama.feed_forward_length"),
        (b"llama.feed_forward_length", value(U32, 2**31 - 1), "blk.0.ffn_gate.weight"),
        (b"llama.context_length", value(I64, 2**62), "llama.context_length"),
        (b"llama.attention.head_count_kv", value(U32, 0), "llama.attention.head_count_kv"),
        (b"llama.embedding_length", value(U32, 2**31 - 1), "llama.attention.head_count"),
        (b"llama.embedding_length", value(U32, 8), "llama.rope.dimension_count = the head width 4, found 8"),
        (b"llama.attention.key_length", value(U32, 16), "llama.rope.dimension_count = the head width 16, found 8"),
        (b"llama.vocab_size", value(U32, 63), "64 (the rows of token_embd.weight)"),
        (b"llama.attention.head_count_kv", value(U32, 1), "blk.0.attn_k.weight"),
        (b"llama.feed_forward_length", value(U32, 64), "blk.0.ffn_gate.weight"),
    ],
)
def test_extreme_or_inconsistent_sizes_never_reach_torch(
    tmp_path: Path, base: bytes, key: bytes, payload: bytes, fragment: str
) -> None:
    path = forged(tmp_path, base, lambda lay: lay.set(key, payload))
    named(lambda: load_gguf(path), path, fragment)


def test_gpt2_keys_are_typed_and_shapes_checked(tmp_path: Path) -> None:
    cfg = TransformerConfig(64, 16, 1, 2, 2, 32, 8, arch="gpt2")
    good = export_gpt2(GPT2(cfg), tmp_path / "g.gguf", {}, {}).read_bytes()
    assert load_gpt2(GGUFFile(tmp_path / "g.gguf")).cfg == cfg
    for key, payload, fragment in [
        (b"gpt2.context_length", value(U32, 9), "position_embd.weight"),
        (b"gpt2.block_count", array(U32, [scalar(U32, 1)]), "gpt2.block_count"),
        (b"gpt2.feed_forward_length", value(U64, 2**62), "gpt2.feed_forward_length"),
        (b"gpt2.attention.layer_norm_epsilon", value(STRING, b"x"), "gpt2.attention.layer_norm_epsilon"),
    ]:
        path = forged(tmp_path, good, lambda lay, k=key, p=payload: lay.set(k, p))
        named(lambda p=path: load_gguf(p), path, fragment)


# ---------------------------------------------------------------- tokenizer and the pack stage


def test_donor_with_invalid_utf8_tokens_fails_the_pack_stage_by_name(tmp_path: Path, base: bytes) -> None:
    tokens = array(STRING, [string(b"\xff" if i == 5 else b"t%d" % i) for i in range(64)])
    donor = forged(tmp_path, base, lambda lay: lay.set(b"tokenizer.ggml.tokens", tokens))
    (tmp_path / "corpus.txt").write_text("one document\n---\nanother document\n")
    data = DataConfig(source="text", path=str(tmp_path / "corpus.txt"))
    named(lambda: run_pack(data, donor, tmp_path / "packed"), donor, "tokenizer.ggml.tokens[5]", "UTF-8")


@pytest.mark.parametrize(
    "key,bad,fragment",
    [
        ("tokenizer.ggml.tokens", list(range(64)), "tokenizer.ggml.tokens[0]: expected a list of strings"),
        ("tokenizer.ggml.token_type", ["1"] * 64, "tokenizer.ggml.token_type[0]"),
        ("tokenizer.ggml.merges", [1, 2], "tokenizer.ggml.merges[0]"),
        ("tokenizer.ggml.add_bos_token", [True], "tokenizer.ggml.add_bos_token: expected a bool"),
        ("tokenizer.ggml.pre", ["gpt2"], "tokenizer.ggml.pre"),
    ],
)
def test_token_metadata_of_the_wrong_types_is_named(base: bytes, tmp_path: Path, key: str, bad, fragment: str) -> None:
    path = tmp_path / "m.gguf"
    path.write_bytes(base)
    metadata = {**GGUFFile(path).metadata, key: bad}
    named(lambda: GGUFTokenizer(metadata, "donor.gguf"), None, "donor.gguf", fragment)


def test_sentencepiece_pieces_are_bounded() -> None:
    tokens = ["<unk>", "<s>", "</s>", "a", "a" * 5000]
    meta = {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.scores": [0.0] * 5}
    named(lambda: GGUFTokenizer(meta, "spm.gguf"), None, "tokens[4]", "at most 1024 characters")
    meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.scores"] = tokens[:4], [0.0, 0.0, 0.0, math.inf]
    named(lambda: GGUFTokenizer(meta, "spm.gguf"), None, "tokenizer.ggml.scores[3]", "finite numbers")


# ---------------------------------------------------------------- chat templates

MESSAGES = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]


@pytest.mark.parametrize(
    "template,fragment",
    [
        ("{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}", "calls nested at most 32 deep"),
        ("{% for m in messages recursive %}{{ loop(messages) }}{% endfor %}", "calls nested at most 32 deep"),
        ("{{ 'x' * 10**9 }}", "'*' result of 1000000000"),
        ("{{ ('x' * 60000) * 60000 }}", "'*' result"),
        ("{% set ns = namespace(s='x') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}", "joined"),
        ("{% set ns = namespace(s='x') %}{% for i in range(40) %}{% set ns.s = ns.s + ns.s %}{% endfor %}", "'+'"),
        ("{{ ('x' * 60000) | replace('x', 'yy') }}", "a replace() result"),
        ("{{ (['x' * 60000] * 60000) | join }}", "a join result"),
        ("{{ 'x' | center(10**9) }}", "integer arguments of at most"),
        ("{{ '%999999999d' % 1 }}{{ '{:>999999999}'.format(1) }}", "format widths of at most"),
        ("{{ 10 ** (10 ** 8) }}", "'**' result"),
        ("{% for i in range(10**9) %}x{% endfor %}", "integer arguments of at most"),
    ],
)
def test_chat_template_bounds_are_named(template: str, fragment: str) -> None:
    call = lambda: render_chat(template, MESSAGES, "<s>", "</s>", source="m.gguf tokenizer.chat_template")  # noqa: E731
    named(call, None, "m.gguf tokenizer.chat_template", fragment, error=ChatTemplateError)


def test_an_endless_loop_meets_the_time_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(chat, "RENDER_SECONDS", 0.3)
    template = "{% set r = range(5000) %}{% for i in r %}{% for j in r %}{% for k in r %}{% endfor %}{% endfor %}"
    template += "{% endfor %}"
    named(lambda: render_chat(template, MESSAGES, "", ""), None, "a render within 0.3 s", error=ChatTemplateError)


def test_real_templates_render_as_plain_jinja_renders_them(smollm2: GGUFFile) -> None:
    """The bounds change nothing for real templates: same text as an unbounded sandbox gives."""
    plain = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    long = [*MESSAGES, {"role": "user", "content": "x" * 100_000}]
    for template in (smollm2.metadata["tokenizer.chat_template"], TINY_TEMPLATE):
        for messages, prompt in ((MESSAGES, True), (long, False)):
            want = plain.from_string(template).render(
                messages=messages, bos_token="<s>", eos_token="</s>", add_generation_prompt=prompt
            )
            assert render_chat(template, messages, "<s>", "</s>", add_generation_prompt=prompt) == want


# ---------------------------------------------------------------- files between stages


@pytest.mark.parametrize(
    "content,fragment",
    [
        (b"\xff\xfe\x00garbage", "unreadable"),
        (b'{"vocab_size": 1', "unreadable"),
        (b"[1, 2]", "a JSON list"),
        (b'{"vocab_size": 10}', "unreadable (TypeError"),
    ],
)
def test_corrupt_pack_meta_names_the_pack_stage(tmp_path: Path, content: bytes, fragment: str) -> None:
    (tmp_path / "meta.json").write_bytes(content)
    named(lambda: load_meta(tmp_path), tmp_path / "meta.json", fragment, "`dvc repro -f pack`", error=DataError)


def test_wrongly_typed_pack_meta_names_the_value(tmp_path: Path) -> None:
    good = dict(vocab_size=64, dtype="uint16", tokenizer_fingerprint="f", corpus_sha256="c", source="text")
    good |= dict(bos_id=None, eos_id=2, documents={"train": 1, "val": 1}, tokens={"train": 9, "val": 3})
    good |= dict(distinct_tokens=5)
    (tmp_path / "meta.json").write_text(json.dumps(good))
    assert load_meta(tmp_path).vocab_size == 64
    for key, bad in [("vocab_size", "64"), ("dtype", "float7"), ("tokens", {"train": -1}), ("eos_id", 64)]:
        (tmp_path / "meta.json").write_text(json.dumps({**good, key: bad}))
        named(lambda: load_meta(tmp_path), tmp_path / "meta.json", key, "dvc repro -f pack", error=DataError)
    (tmp_path / "train.npz").write_bytes(b"PK\x03\x04 truncated zip")
    named(lambda: load_rows(tmp_path / "train.npz"), tmp_path / "train.npz", "dvc repro -f pack", error=DataError)


def test_corrupt_donor_pca_names_the_donor_stage(tmp_path: Path) -> None:
    path = tmp_path / "pca.safetensors"
    k, width, vocab = 4, 8, 16
    arrays = {"components": np.zeros((k, width)), "mean": np.zeros(width), "projected": np.zeros((vocab, k))}
    arrays = {n: a.astype(np.float32) for n, a in {**arrays, "explained_variance_ratio": np.zeros(k)}.items()}
    save_file(arrays, str(path))
    assert PCAResult.load(path).projected.shape == (vocab, k)
    good = path.read_bytes()
    for data in (good[: len(good) // 2], b"garbage" * 10):
        path.write_bytes(data)
        named(lambda: PCAResult.load(path), path, "unreadable", "`dvc repro -f donor`", error=DataError)
    wrong = np.zeros(width + 1, np.float32), np.full((vocab, k), np.nan, np.float32), None
    for name, bad, fragment in zip(("mean", "projected", "mean"), wrong, ("mean", "projected", "the tensors")):
        save_file({n: a for n, a in {**arrays, name: bad}.items() if a is not None}, str(path))
        named(lambda: PCAResult.load(path), path, fragment, "dvc repro -f donor", error=DataError)
    named(lambda: PCAResult.load(tmp_path / "none"), tmp_path / "none", "no such file", error=DataError)


@pytest.fixture()
def train_dir(tmp_path: Path) -> Path:
    cfg = TransformerConfig(vocab_size=32, d_model=16, n_layer=1, n_head=2, n_kv_head=1, d_ff=32, context_length=16)
    out = tmp_path / "models" / "train"
    out.mkdir(parents=True)
    state = TrainState(steps=1, tokens_seen=8, final_train_loss=3.0, final_val_loss=3.0, seq_len=8, batch_size=1)
    save_model_dir(out, Llama(cfg), train_state=state)
    return out


def test_model_directories_round_trip(train_dir: Path) -> None:
    model = load_model_dir(train_dir)
    assert isinstance(model, Llama) and model_config(train_dir) == model.cfg
    again = build_model(model.cfg)
    again.load_state_dict(model.state_dict())
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), again.state_dict().values()))


def test_truncated_or_mismatched_weights_name_the_train_stage(train_dir: Path) -> None:
    weights = train_dir / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    named(lambda: load_model_dir(train_dir), weights, "unreadable", "`dvc repro -f train`", error=ConfigError)
    config = json.loads((train_dir / "config.json").read_text())
    (train_dir / "config.json").write_text(json.dumps({**config, "d_ff": 48}))
    save_file({"x": np.zeros(1, np.float32)}, str(weights))
    named(lambda: load_model_dir(train_dir), weights, "missing", "dvc repro -f train", error=ConfigError)


@pytest.mark.parametrize(
    "edit,fragment",
    [
        (lambda c: b"\x00\xffgarbage", "unreadable"),
        (lambda c: b"[]", "a JSON object of model settings"),
        (lambda c: json.dumps({**c, "d_model": "16"}).encode(), "config.json d_model"),
        (lambda c: json.dumps({**c, "norm_eps": -1}).encode(), "config.json norm_eps"),
        (lambda c: json.dumps({**c, "n_kv_head": 3}).encode(), "n_kv_head dividing n_head"),
        (lambda c: json.dumps({k: v for k, v in c.items() if k != "n_layer"}).encode(), "missing keys ['n_layer']"),
        (lambda c: json.dumps({**c, "d_model": 2**31 - 1, "n_head": 1, "n_kv_head": 1}).encode(), "a buildable model"),
        (lambda c: json.dumps({**c, "d_model": 2**20}).encode(), "model.safetensors tensor tok_embd.weight"),
    ],
)
def test_garbage_model_config_names_the_train_stage(train_dir: Path, edit, fragment: str) -> None:
    path = train_dir / "config.json"
    path.write_bytes(edit(json.loads(path.read_text())))
    named(lambda: load_model_dir(train_dir), train_dir, fragment, "`dvc repro -f train`", error=ConfigError)
