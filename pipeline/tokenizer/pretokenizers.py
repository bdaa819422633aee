"""llama.cpp's BPE pre-tokenizers: the split regexes and flags per `tokenizer.ggml.pre` value.

Verbatim from llama.cpp's src/llama-vocab.cpp (llm_tokenizer_bpe). A vocabulary whose pre-tokenizer
is not listed here is refused by name: a tokenizer that is merely close gives wrong ids.
"""

from __future__ import annotations

import warnings
from collections.abc import Container
from dataclasses import dataclass, replace

from pipeline.errors import GGUFError, problem
from pipeline.gguf.reader import GGUFFile, TypedValue

# Pre-tokenizer regexes, verbatim from llama.cpp's src/llama-vocab.cpp (llm_tokenizer_bpe). Each
# list is applied in order, every regex splitting the pieces the previous one left ("isolated":
# matches and the text between them both become pieces), then the pieces are byte-level encoded.
_GPT2_RE = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3_RE = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_RE = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Unicode tables differ by version: U+1B4E, U+1B4F, U+1B7F (Balinese, new in Unicode 16) are \p{P} for
# `tokenizers` but not for llama-cpp-python 0.3.36's llama.cpp, so only we split " \u1b7f" under `default`.
_DEFAULT_RES = (r"[\p{P}\$\+<=>\^~\|]+", _GPT2_RE, r"\p{N}+", r"[0-9][0-9][0-9]")


@dataclass(frozen=True)
class PreTokenizer:
    """One llama.cpp pre-tokenizer type: its regexes and the flags llama.cpp sets with it."""

    regexes: tuple[str, ...]
    ignore_merges: bool = False  # whole pre-token looked up in the vocab before merging
    add_bos: bool = False  # llama.cpp's default for tokenizer.ggml.add_bos_token


_PRE_DEFAULT = PreTokenizer(_DEFAULT_RES)
_PRE_GPT2 = PreTokenizer((_GPT2_RE,))
_PRE_LLAMA3 = PreTokenizer((_LLAMA3_RE,), ignore_merges=True, add_bos=True)
_PRE_LLAMA3_MERGING = PreTokenizer((_LLAMA3_RE,))
_PRE_DIGITS_GPT2 = PreTokenizer((r"\p{N}", _GPT2_RE))
_PRE_QWEN2 = PreTokenizer((_QWEN2_RE,))

# Names we read that llama.cpp does not: an export writes llama.cpp's spelling so that llama.cpp loads it.
LLAMA_CPP_SPELLING = {"gpt2": "gpt-2"}

# `tokenizer.ggml.pre` values, spelled as llama.cpp spells them (plus the aliases above).
PRE_TOKENIZERS: dict[str, PreTokenizer] = {
    "default": _PRE_DEFAULT,
    "gpt-2": _PRE_GPT2,
    "gpt2": _PRE_GPT2,
    "phi-2": _PRE_GPT2,
    "roberta-bpe": _PRE_GPT2,
    "mpt": _PRE_GPT2,
    "olmo": _PRE_GPT2,
    "llama3": _PRE_LLAMA3,
    "llama-v3": _PRE_LLAMA3,
    "llama-bpe": _PRE_LLAMA3,
    "falcon3": _PRE_LLAMA3,
    "dbrx": _PRE_LLAMA3_MERGING,
    "smaug-bpe": _PRE_LLAMA3_MERGING,
    "smollm": _PRE_DIGITS_GPT2,
    "starcoder": _PRE_DIGITS_GPT2,
    "refact": _PRE_DIGITS_GPT2,
    "codeshell": _PRE_DIGITS_GPT2,
    "qwen2": _PRE_QWEN2,
    "deepseek-r1-qwen": _PRE_QWEN2,
    "stablelm2": _PRE_QWEN2,
    "megrez": _PRE_QWEN2,
}


def resolve_pre(name: object, source: str) -> tuple[str, PreTokenizer]:
    """The pre-tokenizer a GGUF names (llama.cpp's `default`, with its warning, when it names none)."""
    if name is None or name == "":
        warnings.warn(
            f"{source}: no tokenizer.ggml.pre; using llama.cpp's 'default' pre-tokenizer "
            "(llama.cpp warns that generation quality will be degraded)",
            stacklevel=3,
        )
        name = "default"
    if not isinstance(name, str) or name not in PRE_TOKENIZERS:
        raise GGUFError(
            problem(
                f"{source} tokenizer.ggml.pre",
                f"a supported pre-tokenizer ({', '.join(sorted(PRE_TOKENIZERS))})",
                repr(name),
                "add its llama.cpp regexes to pipeline/tokenizer/pretokenizers.py PRE_TOKENIZERS, or use another GGUF",
            )
        )
    return str(name), PRE_TOKENIZERS[str(name)]


def byte_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet: the character each byte is spelled with in a `gpt2` vocabulary."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1), *range(ord("\u00ae"), 256)]
    moved = [b for b in range(256) if b not in kept]
    return {**{b: chr(b) for b in kept}, **{b: chr(256 + n) for n, b in enumerate(moved)}}


def missing_byte_chars(vocab: Container[str]) -> list[str]:
    """The byte characters that are not tokens (SmolLM2 has none for 0x04, 0x06, 0x13, 0x14, 0x16,
    0x1d, ...). llama.cpp keeps such a character as a symbol that no merge joins and then drops it,
    so its neighbours stay apart (" \x16." -> "Ġ", "."); the `tokenizers` BPE drops an unknown
    character before merging, which would join them ("Ġ."), so the tokenizer gives each an id past
    the vocabulary (a symbol no merge joins) and removes those ids from the output.
    """
    return [c for c in byte_to_unicode().values() if c not in vocab]


def donor_tokenizer_metadata(donor: GGUFFile) -> dict[str, TypedValue]:
    """Every `tokenizer.*` key of a GGUF with its exact GGUF type, to copy into an export so the
    export tokenizes exactly like its donor."""
    meta = {k: donor.typed_field(k) for k in donor.metadata if k.startswith("tokenizer.")}
    pre = meta.get("tokenizer.ggml.pre")
    if pre is not None and pre.value in LLAMA_CPP_SPELLING:  # llama.cpp refuses the alias as unknown
        meta["tokenizer.ggml.pre"] = replace(pre, value=LLAMA_CPP_SPELLING[pre.value])
    return meta
