"""The GGUF tokenizer gives llama.cpp's ids: on the real SmolLM2 donor, and on tiny written GGUFs."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import pytest

from pipeline.donor.locate import resolve_gguf_path
from pipeline.errors import GGUFError
from pipeline.gguf.reader import GGUFFile
from pipeline.tokenizer.gguf_tokenizer import GGUFTokenizer, tokenizer_from_gguf
from pipeline.tokenizer.pretokenizers import PRE_TOKENIZERS
from tests.helpers import tokenizer_metadata

FIXTURE = Path(__file__).parent / "fixtures" / "smollm2_reference.json"
REFERENCE = json.loads(FIXTURE.read_text())["texts"]

# Recorded with llama-cpp-python 0.3.36, tokenize(special=True, add_bos=False), on the SmolLM2 GGUF.
LLAMACPP_EXTRA = {
    "12345": [33, 34, 35, 36, 37],
    "x<|im_start|><|im_end|>y": [104, 1, 2, 105],
    "３４５ ½ ٣": [8083, 237, 8083, 238, 8083, 239, 216, 16738, 216, 164, 113],
    # Control characters that have no byte token in SmolLM2 (0x04 0x06 0x13 0x14 0x16 0x1d) are
    # dropped, but their neighbours stay apart as llama.cpp keeps them (we used to merge " ." / "..").
    " \x16.": [216, 30],
    ">\x16>": [46, 46],
    " \x06⧾": [216, 173, 117, 139],
    "..\x1d..": [950, 950],
    " \x04\x13\x14!": [216, 17],
}

EXTRA_TEXTS = [
    "12345",
    "In 2024 we sold 1,234,567 units.",
    "  multiple   spaces\n\n\nnewlines \n  \t end  ",
    "<|im_start|>user\nhi<|im_end|>",
    "x<|im_start|><|im_end|>y",
    "emoji 🙂👍🏽 and 日本語 Ελληνικά café",
    "I'm you'll WE'RE it's",
    "a\r\nb",
    "   ",
    "",
]


# ----- the real donor -----


@pytest.fixture(scope="module")
def donor() -> GGUFFile:
    return GGUFFile(resolve_gguf_path("smollm2"))


@pytest.fixture(scope="module")
def tok(donor: GGUFFile) -> GGUFTokenizer:
    return tokenizer_from_gguf(donor)


@pytest.mark.parametrize("name", sorted(REFERENCE))
def test_llamacpp_parity_on_fixture(tok: GGUFTokenizer, name: str) -> None:
    entry = REFERENCE[name]
    assert tok.encode(entry["text"]) == entry["tokens"]
    assert tok.decode(entry["tokens"]) == entry["detok"]


def test_llamacpp_parity_on_extra_strings(tok: GGUFTokenizer) -> None:
    for text, ids in LLAMACPP_EXTRA.items():
        assert tok.encode(text) == ids, text


def test_encode_batch_matches_encode(tok: GGUFTokenizer) -> None:
    texts = [e["text"] for e in REFERENCE.values()] + EXTRA_TEXTS
    assert tok.encode_batch(texts) == [tok.encode(t) for t in texts]
    assert tok.encode_batch([]) == []


def test_donor_properties(tok: GGUFTokenizer, donor: GGUFFile) -> None:
    assert tok.vocab_size == 49152
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (1, 2, 2)
    assert tok.add_bos is False and tok.add_eos is False  # the file says so
    assert tok.token_to_id("<|im_start|>") == 1
    assert tok.token_to_id("no such token") is None
    # Special tokens are recognised in text and never added by encode.
    assert tok.encode("<|im_end|>") == [2]
    assert tok.decode([1, 4093, 2], skip_special=False) == "<|im_start|>user<|im_end|>"
    meta = tokenizer_metadata(donor)
    assert set(meta) == {k for k in donor.metadata if k.startswith("tokenizer.")}
    assert meta["tokenizer.ggml.pre"] == "smollm" and "tokenizer.chat_template" in meta
    assert tokenizer_from_gguf(donor).fingerprint() == tok.fingerprint()
    # Pinned: pack meta and caches key on it, so a change must be deliberate.
    assert tok.fingerprint() == "0614ac52556939d5a7d15e3c7727ad8cbdf45f33ed7d871358bfb882ec2e6ece"


def test_decode_round_trips(tok: GGUFTokenizer) -> None:
    for text in EXTRA_TEXTS:
        if "<|" not in text:
            assert tok.decode(tok.encode(text)) == text
    with pytest.raises(GGUFError, match="49152"):
        tok.decode([49152])


@pytest.fixture(scope="module")
def hf_tokenizer(donor: GGUFFile):
    transformers = pytest.importorskip("transformers")
    mp = pytest.MonkeyPatch()
    mp.setenv("HF_HUB_OFFLINE", "1")
    mp.setenv("TRANSFORMERS_OFFLINE", "1")
    try:
        yield transformers.AutoTokenizer.from_pretrained(str(donor.path.parent), gguf_file=donor.path.name)
    finally:
        mp.undo()


@pytest.mark.parametrize(
    "text",
    [
        *EXTRA_TEXTS,
        *(REFERENCE[name]["text"] for name in sorted(REFERENCE)),
        # transformers 5.23 has no `smollm` pre-tokenizer (it falls back to plain GPT-2 splitting,
        # without SmolLM2's digit split), so it keeps " ½" whole where llama.cpp splits the
        # numeral off (see LLAMACPP_EXTRA). ASCII digits agree only because the vocabulary has no
        # digit merges. We follow llama.cpp.
        # strict: the day transformers splits like llama.cpp this passes, and the mark must go
        pytest.param(
            "３４５ ½ ٣", marks=pytest.mark.xfail(strict=True, reason="transformers lacks the smollm digit split")
        ),
    ],
)
def test_agrees_with_transformers_gguf_tokenizer(tok: GGUFTokenizer, hf_tokenizer, text: str) -> None:
    ids = hf_tokenizer.encode(text, add_special_tokens=False)
    assert tok.encode(text) == ids
    assert tok.decode(ids) == hf_tokenizer.decode(ids, skip_special_tokens=True)


# ----- tiny GGUFs -----

BYTE_LEVEL_TOKENS = "<|endoftext|> <|user|> h i Ġ t e r hi Ġt he Ġthe re Ġthere 1 2 12".split()
BYTE_LEVEL_MERGES = ["h i", "Ġ t", "h e", "Ġt he", "r e", "Ġthe re", "1 2"]


def write_gguf(path: Path, **kv) -> Path:
    """A tensor-less GGUF with the given `tokenizer.ggml.*` keys (None = leave out), plus the llama
    hyper-parameters llama.cpp needs to load it vocab-only."""
    w = gguf.GGUFWriter(str(path), arch="llama")
    w.add_context_length(64)
    w.add_embedding_length(8)
    w.add_block_count(1)
    w.add_feed_forward_length(16)
    w.add_head_count(1)
    w.add_layer_norm_rms_eps(1e-5)
    for key, value in kv.items():
        if value is None:
            continue
        full = f"tokenizer.ggml.{key}"
        if isinstance(value, bool):
            w.add_bool(full, value)
        elif isinstance(value, int):
            w.add_uint32(full, value)
        elif isinstance(value, str):
            w.add_string(full, value)
        elif key == "scores":
            w.add_array(full, [float(v) for v in value])
        elif key == "token_type":
            w.add_array(full, [int(v) for v in value])
        else:
            w.add_array(full, list(value))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def byte_level_gguf(path: Path, **overrides) -> Path:
    kv = {
        "model": "gpt2",
        "pre": "smollm",
        "tokens": BYTE_LEVEL_TOKENS,
        "token_type": [3, 4] + [1] * (len(BYTE_LEVEL_TOKENS) - 2),
        "merges": BYTE_LEVEL_MERGES,
        "bos_token_id": 0,
        "eos_token_id": 0,
    }
    kv.update(overrides)
    return write_gguf(path, **kv)


# Listed best score first: "hello world" merges ll, he, hell, hello, ▁hello and or, ld, orld, ▁w, ▁world.
SPM_PIECES = "▁ h e l o w r d ll he hell hello ▁hello or ld orld ▁w ▁world".split()
SPM_TOKENS = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), *SPM_PIECES]
SPM_TYPES = [2, 3, 3] + [6] * 256 + [1] * len(SPM_PIECES)
SPM_SCORES = [0.0] * 259 + [-100.0] * 8 + [-float(i) for i in range(len(SPM_PIECES) - 8)]


def spm_gguf(path: Path, **overrides) -> Path:
    kv = {"model": "llama", "tokens": SPM_TOKENS, "token_type": SPM_TYPES, "scores": SPM_SCORES}
    kv.update(overrides)
    return write_gguf(path, **kv)


def load(path: Path) -> GGUFTokenizer:
    return tokenizer_from_gguf(GGUFFile(path))


def test_byte_level_bpe_tiny(tmp_path: Path) -> None:
    tok = load(byte_level_gguf(tmp_path / "bpe.gguf"))
    ids = {t: i for i, t in enumerate(BYTE_LEVEL_TOKENS)}
    assert tok.encode("hi there") == [ids["hi"], ids["Ġthere"]]
    # smollm splits digits one by one even though the merge "1 2" exists.
    assert tok.encode("12") == [ids["1"], ids["2"]]
    assert tok.encode("hi<|endoftext|>hi<|user|>") == [ids["hi"], 0, ids["hi"], 1]
    assert tok.decode(tok.encode("hi there")) == "hi there"
    # CONTROL tokens are dropped by decode, USER_DEFINED ones kept (llama.cpp detokenize).
    assert tok.decode([0, ids["hi"], 1]) == "hi<|user|>"
    assert tok.add_bos is False and tok.bos_id == 0 and tok.pad_id is None


def test_pre_tokenizer_choice_matters(tmp_path: Path) -> None:
    tok = load(byte_level_gguf(tmp_path / "bpe.gguf", pre="gpt-2"))
    assert tok.encode("12") == [BYTE_LEVEL_TOKENS.index("12")]  # GPT-2 keeps digit runs whole
    llama3 = load(byte_level_gguf(tmp_path / "l3.gguf", pre="llama-bpe"))
    assert llama3.add_bos is True  # llama.cpp's default for llama3-style vocabularies
    assert load(byte_level_gguf(tmp_path / "l3f.gguf", pre="llama-bpe", add_bos_token=False)).add_bos is False


def test_missing_pre_uses_llamacpp_default_with_warning(tmp_path: Path) -> None:
    with pytest.warns(UserWarning, match="tokenizer.ggml.pre"):
        tok = load(byte_level_gguf(tmp_path / "nopre.gguf", pre=None))
    assert tok.pre == "default"


def test_unknown_pre_is_named(tmp_path: Path) -> None:
    with pytest.raises(GGUFError, match="my-new-pre") as info:
        load(byte_level_gguf(tmp_path / "bad.gguf", pre="my-new-pre"))
    assert "smollm" in str(info.value) and "llama-bpe" in str(info.value)
    assert "\n" not in str(info.value)


def test_unknown_model_type_is_named(tmp_path: Path) -> None:
    with pytest.raises(GGUFError, match="'bert'") as info:
        load(byte_level_gguf(tmp_path / "bert.gguf", model="bert"))
    assert "gpt2" in str(info.value) and "llama" in str(info.value)


def test_missing_tokens_or_merges_is_named(tmp_path: Path) -> None:
    with pytest.raises(GGUFError, match="tokenizer.ggml.tokens"):
        load(byte_level_gguf(tmp_path / "notok.gguf", tokens=None, token_type=None))
    with pytest.raises(GGUFError, match="tokenizer.ggml.merges"):
        load(byte_level_gguf(tmp_path / "nomerge.gguf", merges=None))
    with pytest.raises(GGUFError, match="tokenizer.ggml.scores"):
        load(spm_gguf(tmp_path / "noscores.gguf", scores=None))
    with pytest.raises(GGUFError, match="bos_token_id"):
        load(byte_level_gguf(tmp_path / "badbos.gguf", bos_token_id=999))


def test_sentencepiece_tiny(tmp_path: Path) -> None:
    tok = load(spm_gguf(tmp_path / "spm.gguf"))
    ids = {t: i for i, t in enumerate(SPM_TOKENS)}
    # llama.cpp defaults for a SentencePiece vocabulary without the keys.
    assert (tok.bos_id, tok.eos_id, tok.add_bos, tok.add_eos, tok.add_space_prefix) == (1, 2, True, False, True)
    assert tok.encode("hello world") == [ids["▁hello"], ids["▁world"]]
    # "é" is not a piece: byte fallback to its UTF-8 bytes; "\n" too.
    assert tok.encode("hé\n") == [ids["▁"], ids["h"], ids["<0xC3>"], ids["<0xA9>"], ids["<0x0A>"]]
    # A space prefix after each special token, as llama.cpp adds it.
    assert tok.encode("<s>hello</s>") == [1, ids["▁hello"], 2]
    for text in ["hello world", "hé\n", "  hello", "world hello"]:
        assert tok.decode(tok.encode(text)) == text
    assert tok.encode("") == []


def test_sentencepiece_decode_keeps_text_around_broken_bytes(tmp_path: Path) -> None:
    """A byte run that is not valid UTF-8 (a generation cut inside a character) loses only the
    broken character, as llama.cpp's bytes decode; it used to turn the whole run into U+FFFD."""
    tok = load(spm_gguf(tmp_path / "spm.gguf"))
    ids = {t: i for i, t in enumerate(SPM_TOKENS)}
    cut = [ids["<0x49>"], ids["<0xE2>"], ids["<0x82>"]]  # "I" then the first 2 bytes of "€"
    assert tok.decode(cut) == "I\ufffd"
    euro_then_cut = [ids["<0xE2>"], ids["<0x82>"], ids["<0xAC>"], ids["<0xE2>"], ids["<0x2B>"]]
    assert tok.decode(euro_then_cut) == "€\ufffd+"
    assert tok.decode([ids["▁hello"], ids["<0xC3>"], 1, ids["<0xA9>"]]) == "helloé"  # <s> dropped, as llama.cpp
    assert tok.decode([ids["▁hello"], ids["<0xC3>"], ids["<0xA9>"], 2], skip_special=False) == "helloé</s>"


def test_sentencepiece_without_space_prefix(tmp_path: Path) -> None:
    tok = load(spm_gguf(tmp_path / "spm.gguf", add_space_prefix=False))
    ids = {t: i for i, t in enumerate(SPM_TOKENS)}
    assert tok.encode("hello world") == [ids["hello"], ids["▁world"]]
    assert tok.decode(tok.encode("hello world")) == "hello world"


def test_fingerprint_identifies_the_tokenizer(tmp_path: Path) -> None:
    base = load(byte_level_gguf(tmp_path / "a.gguf"))
    same = load(byte_level_gguf(tmp_path / "b.gguf"))
    assert base.fingerprint() == same.fingerprint()
    assert len(base.fingerprint()) == 64
    changed_token = [*BYTE_LEVEL_TOKENS[:-1], "3"]
    assert load(byte_level_gguf(tmp_path / "c.gguf", tokens=changed_token)).fingerprint() != base.fingerprint()
    changed_merges = BYTE_LEVEL_MERGES[:-1]
    assert load(byte_level_gguf(tmp_path / "d.gguf", merges=changed_merges)).fingerprint() != base.fingerprint()
    assert load(byte_level_gguf(tmp_path / "e.gguf", pre="gpt-2")).fingerprint() != base.fingerprint()
    assert load(byte_level_gguf(tmp_path / "f.gguf", eos_token_id=1)).fingerprint() != base.fingerprint()
    spm = load(spm_gguf(tmp_path / "s.gguf"))
    rescored = load(spm_gguf(tmp_path / "t.gguf", scores=[*SPM_SCORES[:-1], 5.0]))
    assert spm.fingerprint() != rescored.fingerprint()


def test_supported_pre_tokenizers_listed() -> None:
    assert {"default", "gpt2", "llama-bpe", "smollm", "qwen2"} <= set(PRE_TOKENIZERS)


# ----- optional: live llama.cpp, when llama-cpp-python is installed -----


@pytest.fixture(scope="module")
def llama_cpp():
    return pytest.importorskip("llama_cpp")


@pytest.mark.parametrize("pre", ["default", "gpt-2", "llama-bpe", "qwen2", "smollm"])
def test_live_llamacpp_parity_per_pre_tokenizer(tmp_path: Path, donor: GGUFFile, llama_cpp, pre: str) -> None:
    """The donor's vocabulary under each pre-tokenizer, against llama.cpp itself (vocab only)."""
    meta = tokenizer_metadata(donor)
    path = write_gguf(
        tmp_path / f"{pre}.gguf",
        model="gpt2",
        pre=pre,
        tokens=meta["tokenizer.ggml.tokens"],
        token_type=meta["tokenizer.ggml.token_type"],
        merges=meta["tokenizer.ggml.merges"],
    )
    ours = GGUFTokenizer({**meta, "tokenizer.ggml.pre": pre})  # same metadata, no slow re-read
    ref = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
    texts = [*EXTRA_TEXTS, *LLAMACPP_EXTRA, *(e["text"] for e in REFERENCE.values()), "$100 + <= >> ^~| ||| ...!!"]
    texts += [" \x06⧾", " \x06🌈", " \x16'", "a\x1d\x1d,"]  # bytes without a token (see LLAMACPP_EXTRA)
    try:
        for text in texts:
            assert ours.encode(text) == ref.tokenize(text.encode(), add_bos=False, special=True), (pre, text)
    finally:
        ref.close()


@pytest.mark.parametrize("add_space_prefix", [True, False])
def test_live_llamacpp_parity_sentencepiece(tmp_path: Path, llama_cpp, add_space_prefix: bool) -> None:
    path = spm_gguf(tmp_path / "spm.gguf", add_space_prefix=add_space_prefix)
    ours = load(path)
    ref = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
    texts = ["hello world", " hello  world", "hé\n", "<s>hello</s>", "hello<unk>world", "   ", "", "🙂 world"]
    try:
        for text in texts:
            assert ours.encode(text) == ref.tokenize(text.encode(), add_bos=False, special=True), text
    finally:
        ref.close()
