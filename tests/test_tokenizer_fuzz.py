"""Seeded differential fuzz: our GGUF tokenizer against llama.cpp itself (vocab only) on nasty text.

Mixed scripts, combining marks in NFC and NFD, emoji sequences, digit runs of every length,
contractions, odd whitespace, code, control characters and typed special-token spellings; ids
with and without `special`, with and without BOS, and decode round trips. Skipped without
llama-cpp-python, as the other live llama.cpp tests are.
"""

from __future__ import annotations

import ctypes
import random
import unicodedata
from pathlib import Path

import pytest

from pipeline.donor.locate import resolve_gguf_path
from pipeline.gguf.reader import GGUFFile
from pipeline.tokenizer.gguf_tokenizer import GGUFTokenizer
from tests.helpers import tokenizer_metadata
from tests.test_tokenizer import SPM_SCORES, SPM_TOKENS, SPM_TYPES, spm_gguf, write_gguf

SCRIPTS = ["日本語のテキスト", "中文字符", "مرحبا بالعالم", "नमस्ते दुनिया", "สวัสดีชาวโลก", "안녕하세요", "Привет мир"]
SCRIPTS += ["Γειά σου κόσμε", "עברית", "𝔘𝔫𝔦𝔠𝔬𝔡𝔢", "ｆｕｌｌｗｉｄｔｈ", "½ ¾ ² ① ٣ ३ ๓ ３"]
EMOJI = ["🙂", "👍🏽", "👨\u200d👩\u200d👧\u200d👦", "🏳️\u200d🌈", "🇫🇷", "🇺🇸🇯🇵", "❤️", "🧑🏿\u200d💻", "#️⃣"]
MARKS = ["e\u0301", "a\u0308\u0304", "\u0915\u094d\u0937", "Z\u0351\u036b\u0343", "\u0e01\u0e34\u0e4a"]
WORDS = ["the", "The", "THE", "hello", "café", "naïve", "Straße", "İstanbul", "ﬁ", "I", "a"]
CONTRACTIONS = ["'s", "'t", "'re", "'ve", "'m", "'ll", "'d", "'S", "'RE", "'Ll", "\u2019s", "\u2019ll", "''", "'x"]
SPACES = [" ", "  ", "   ", "\t", "\n", "\n\n", "\r\n", "\r", "\u00a0", "\u3000", "\u2028", " \n ", "\x0b", "\u200b"]
CODE = ["def f(x):\n    return x**2\n", '{"a": [1, 2.5e-3, null]}', "int main(void){return 0;}", "a->b::c<>d"]
CODE += ["# T\n\n* **b** _i_ `c`\n", "https://example.com/p?q=1&r=%20x#f", "$100 + <= >> ^~| ||| ...!!", "1,234.5"]
SPECIALS = ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<|im_start|", "<s>", "</s>", "<unk>"]
CONTROLS = [chr(c) for c in range(32)] + ["\x7f", "\ufffd", "\ufeff", "\u200d"]
PUNCT = '!"#$%&()*+,-./:;<=>?@[\\]^_`{|}~'
POOLS = [SCRIPTS, EMOJI, MARKS, WORDS, CONTRACTIONS, SPACES, CODE, SPECIALS, CONTROLS, PUNCT]


def _piece(r: random.Random) -> str:
    """One fragment: from a pool, a digit run (1 to 20 digits), a repeated word or a random BMP character."""
    k = r.randrange(len(POOLS) + 3)
    if k < len(POOLS):
        return r.choice(POOLS[k])
    if k == len(POOLS):
        return "".join(r.choice("0123456789") for _ in range(r.randint(1, 20)))
    if k == len(POOLS) + 1:
        return r.choice(WORDS) * r.randint(2, 40)
    return chr(r.randrange(0x20, 0x3000))


def nasty_texts(seed: int, n: int) -> list[str]:
    """`n` seeded strings of 1-7 fragments, some NFC/NFD-normalised, some with edge spaces."""
    r = random.Random(seed)
    out = []
    for _ in range(n):
        s = "".join(_piece(r) for _ in range(r.randint(1, 7)))
        form = r.choice(["NFC", "NFD", None, None])
        s = unicodedata.normalize(form, s) if form else s
        out.append(" " * r.randint(0, 2) + s + r.choice(["", "", " ", "\n", "  "]))
    return out


def llama_detokenize(ref, ids: list[int]) -> str:
    """llama.cpp's own `llama_detokenize` (the binding's `detokenize` drops a space after BOS itself)."""
    import llama_cpp

    arr = (llama_cpp.llama_token * max(len(ids), 1))(*ids)
    buf = ctypes.create_string_buffer(64 * len(ids) + 16)
    n = llama_cpp.llama_detokenize(ref._model.vocab, arr, len(ids), buf, len(buf), False, False)
    assert n >= 0
    return buf.raw[:n].decode("utf-8", "replace")


def mismatches(ours: GGUFTokenizer, ref, texts: list[str], exact_decode: bool) -> list[tuple[str, str]]:
    """(what, text) for each disagreement with llama.cpp. Decode must round-trip wherever llama.cpp's
    does; `exact_decode`: also equal llama.cpp's text everywhere (pre-tokenizers without its
    `clean_spaces`, which turns " ?" into "?")."""
    bad = []
    for text in texts:
        for special in (True, False):
            ids = ref.tokenize(text.encode(), add_bos=False, special=special)
            if ours.encode(text, special=special) != ids:
                bad.append((f"ids special={special}", text))
            with_bos = ([ours.bos_id] if ours.add_bos and ours.bos_id is not None else []) + ids
            if ref.tokenize(text.encode(), add_bos=True, special=special) != with_bos:
                bad.append((f"bos special={special}", text))
        theirs, decoded = llama_detokenize(ref, ids), ours.decode(ids)
        if (theirs == text or exact_decode) and decoded != theirs:
            bad.append(("decode", text))
    return bad


@pytest.fixture(scope="module")
def llama_cpp():
    return pytest.importorskip("llama_cpp")


@pytest.fixture(scope="module")
def donor_meta() -> dict:
    return tokenizer_metadata(GGUFFile(resolve_gguf_path("smollm2")))


@pytest.mark.parametrize("pre", ["smollm", "default", "gpt-2", "llama-bpe", "qwen2"])
def test_fuzz_byte_level_bpe_against_llamacpp(tmp_path: Path, llama_cpp, donor_meta: dict, pre: str) -> None:
    """The donor's vocabulary (its own `smollm` and other pre-tokenizers) on 600 seeded strings."""
    kv = {k: donor_meta[f"tokenizer.ggml.{k}"] for k in ("tokens", "token_type", "merges")}
    kv |= {"model": "gpt2", "pre": pre, "bos_token_id": 1, "eos_token_id": 2}
    ours = GGUFTokenizer({f"tokenizer.ggml.{k}": v for k, v in kv.items()})
    ref = llama_cpp.Llama(model_path=str(write_gguf(tmp_path / "t.gguf", **kv)), vocab_only=True, verbose=False)
    try:
        assert mismatches(ours, ref, nasty_texts(20261125, 600), pre in ("smollm", "qwen2")) == []
    finally:
        ref.close()


@pytest.mark.parametrize("add_space_prefix", [True, False])
def test_fuzz_sentencepiece_against_llamacpp(tmp_path: Path, llama_cpp, add_space_prefix: bool) -> None:
    """A tiny SentencePiece vocabulary (byte fallback for almost everything) on 600 seeded strings."""
    kv = {"model": "llama", "tokens": SPM_TOKENS, "token_type": SPM_TYPES, "scores": SPM_SCORES}
    kv["add_space_prefix"] = add_space_prefix
    ours = GGUFTokenizer({f"tokenizer.ggml.{k}": v for k, v in kv.items()})
    ref = llama_cpp.Llama(model_path=str(write_gguf(tmp_path / "s.gguf", **kv)), vocab_only=True, verbose=False)
    try:
        assert mismatches(ours, ref, nasty_texts(7, 600), exact_decode=False) == []
    finally:
        ref.close()


@pytest.mark.parametrize("vocab", ["smollm2", "sentencepiece"])
def test_fuzz_decode_of_random_ids_against_llamacpp(tmp_path: Path, llama_cpp, vocab: str) -> None:
    """Any id sequence (a generation cut inside a character, stray byte tokens) decodes to the text
    of llama.cpp's bytes. SentencePiece sequences start with a piece: after a leading control token
    llama.cpp keeps the prefix space that we strip (see GGUFTokenizer's known differences)."""
    if vocab == "smollm2":
        path = resolve_gguf_path("smollm2")
    else:
        path = spm_gguf(tmp_path / "s.gguf")
    ours = GGUFTokenizer(tokenizer_metadata(GGUFFile(path)))
    ref = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
    r, bad = random.Random(11), []
    try:
        for _ in range(1000):
            ids = [r.randrange(ours.vocab_size) for _ in range(r.randint(1, 6))]
            ids[0] = ids[0] if vocab == "smollm2" else r.randrange(3, ours.vocab_size)
            if ours.decode(ids) != llama_detokenize(ref, ids):
                bad.append(ids)
    finally:
        ref.close()
    assert bad == []
