"""The tokenizer a GGUF describes, rebuilt with HF `tokenizers` from its `tokenizer.ggml.*` metadata.

A GGUF carries no `tokenizer.json`, only llama.cpp's description of the vocabulary. The model was
trained (and is run by llama.cpp) with exactly that tokenizer, so we rebuild it to give the ids
llama.cpp gives: same pre-tokenizer regexes as `llama-vocab.cpp`, same special-token matching,
same merge order. Nothing is downloaded. Anything this module cannot reproduce faithfully (an
unknown model type or pre-tokenizer) is a `GGUFError`, never a silent approximation, because a
tokenizer that is merely close gives wrong ids for some inputs and silently poisons training data.

Known differences from llama.cpp, all in inputs real vocabularies do not produce:
- SentencePiece (`llama`) vocabularies: llama.cpp merges the adjacent pair whose concatenation has
  the best score, leftmost on ties; BPE ranks are unique, so two *different* tokens with equal
  scores merge in list order here. Llama/Mistral scores are distinct, so this does not arise.
- Two special tokens that overlap in the text: llama.cpp takes the longest special token first
  anywhere in the text, `tokenizers` the leftmost-longest match.
- llama.cpp re-labels a few "control-looking" tokens (e.g. `<|im_end|>` typed NORMAL) as CONTROL
  by their text; we trust the file's token types.
- Decoding, where llama.cpp's `llama_detokenize` loses the text and we keep it: its clean_spaces (" ?" -> "?", most BPE
  pre-tokenizers, not smollm/qwen2), `▁` left in USER_DEFINED pieces, the space prefix after a leading control token.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

from pipeline.errors import GGUFError, problem
from pipeline.gguf.reader import GGUFFile
from pipeline.tokenizer.pretokenizers import PreTokenizer, missing_byte_chars, resolve_pre
from pipeline.tokenizer.spm_decode import decode_sentencepiece
from pipeline.tokenizer.token_types import SPACE_MARK, TOKEN_CONTROL, TOKEN_NORMAL, TOKEN_UNKNOWN, TOKEN_USER_DEFINED

SUPPORTED_MODELS = ("gpt2", "llama")
MAX_PIECE_CHARS = 1024  # longest SentencePiece piece we rebuild merges for (real ones are under 100)


class GGUFTokenizer:
    """Encode/decode exactly as llama.cpp does for the GGUF's vocabulary.

    `encode` recognises special tokens written in the text (llama.cpp `tokenize(special=True)`),
    because chat templates and packed corpora contain them as text; it never adds BOS/EOS, so the
    caller decides (see `add_bos`/`add_eos` for what the model expects). `decode` drops CONTROL and
    UNKNOWN tokens like llama.cpp's `detokenize(special=False)`, unless `skip_special=False`.
    """

    vocab_size: int
    bos_id: int | None
    eos_id: int | None
    unk_id: int | None
    pad_id: int | None
    end_of_turn_ids: tuple[int, ...]
    add_bos: bool
    add_eos: bool
    add_space_prefix: bool
    model_type: str
    pre: str | None

    def __init__(self, metadata: Mapping[str, Any], source: str = "GGUF metadata"):
        """Build from GGUF metadata (key -> plain value); `source` names the file in errors."""
        self._source = source
        self.model_type = self._model_type(metadata)
        self._tokens: list[str] = self._vocabulary(metadata)
        self.vocab_size = len(self._tokens)
        self._types: list[int] = self._token_types(metadata)
        self._token_to_id: dict[str, int] = {t: i for i, t in enumerate(self._tokens)}  # later wins, as llama.cpp
        if self.model_type == "gpt2":
            pre, defaults, default_add_bos = self._bpe_settings(metadata)
        else:
            pre, defaults, default_add_bos = self._sentencepiece_settings(metadata)
        self.bos_id = self._special_id(metadata, "tokenizer.ggml.bos_token_id", defaults[0])
        self.eos_id = self._special_id(metadata, "tokenizer.ggml.eos_token_id", defaults[1])
        self.unk_id = self._special_id(metadata, "tokenizer.ggml.unknown_token_id", defaults[2])
        self.pad_id = self._special_id(metadata, "tokenizer.ggml.padding_token_id", None)
        ends = (self._special_id(metadata, f"tokenizer.ggml.{k}_token_id", None) for k in ("eot", "eom"))
        self.end_of_turn_ids = tuple(i for i in ends if i is not None)  # llama.cpp stops at them too
        self.add_bos = self._typed(metadata, "tokenizer.ggml.add_bos_token", bool, default_add_bos)
        self.add_eos = self._typed(metadata, "tokenizer.ggml.add_eos_token", bool, False)
        self._pre_tokenizer = pre
        self._barriers: list[str] = []
        self._tok: Tokenizer = self._build(control=True)
        self._plain: Tokenizer | None = None  # without CONTROL/UNKNOWN matching: built on first use
        self._unprefixed: Tokenizer | None = None  # _plain without the space prefix (`continues`)
        self._fingerprint: str | None = None

    # ----- public API -----

    def encode(self, text: str, special: bool = True, continues: bool = False) -> list[int]:
        """Token ids of `text`; no BOS/EOS added. `special`: CONTROL/UNKNOWN tokens written in it
        become their ids; False (llama.cpp `parse_special=false`, for untrusted text) tokenizes them
        as the plain characters they are, so typed `<|im_end|>` cannot end a turn. `continues`
        (with special=False): the text follows earlier text, so it gets no SentencePiece space
        prefix, which llama.cpp adds only at the start and after a special token."""
        return self._ids(self._pick(special, continues).encode(text, add_special_tokens=False).ids)

    def _pick(self, special: bool, continues: bool) -> Tokenizer:
        """The tokenizer of one `encode` call: control matching, plain, or plain without the space prefix."""
        if special:
            return self._tok
        if self._plain is None:
            self._plain = self._build(control=False)
        if not (continues and self.add_space_prefix):
            return self._plain
        if self._unprefixed is None:  # a copy without the prefix (no second merge recovery)
            self._unprefixed = Tokenizer.from_str(self._plain.to_str())
            self._unprefixed.normalizer = normalizers.Replace(" ", SPACE_MARK)
        return self._unprefixed

    def _ids(self, ids: list[int]) -> list[int]:
        """Ids without the barrier ids of byte characters that are not tokens (dropped, as llama.cpp)."""
        return [i for i in ids if i < self.vocab_size] if self._barriers else ids

    def control_tokens(self) -> list[str]:
        """The spellings `encode` matches as special (CONTROL and UNKNOWN tokens), once each."""
        kinds, first = (TOKEN_CONTROL, TOKEN_UNKNOWN), self._token_to_id
        return [t for i, (t, k) in enumerate(zip(self._tokens, self._types)) if k in kinds and first[t] == i]

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """`encode` over many texts in parallel (Rust threads); same ids as `encode`."""
        batch = getattr(self._tok, "encode_batch_fast", self._tok.encode_batch)  # _fast: tokenizers>=0.21
        return [self._ids(e.ids) for e in batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: list[int], skip_special: bool = True) -> str:
        """Text of `ids`; CONTROL/UNKNOWN tokens are dropped unless `skip_special=False`."""
        for i in ids:
            if not 0 <= int(i) < self.vocab_size:
                raise GGUFError(
                    problem(
                        f"{self._source} decode",
                        f"token ids in [0, {self.vocab_size})",
                        f"id {i}",
                        "decode ids produced by this tokenizer / model",
                    )
                )
        ids = [int(i) for i in ids]
        if self.model_type == "llama":  # bytes first, as llama.cpp: see spm_decode
            return decode_sentencepiece(self._tokens, self._types, ids, skip_special, self.add_space_prefix)
        return self._tok.decode(ids, skip_special_tokens=skip_special)

    def token_to_id(self, tok: str) -> int | None:
        """Id of a token spelled as in the GGUF vocabulary (e.g. `<|im_end|>`, `Ġthe`), else None."""
        return self._token_to_id.get(tok)

    def id_to_token(self, token_id: int) -> str:
        """The GGUF vocabulary spelling of `token_id`."""
        return self._tokens[token_id]

    def fingerprint(self) -> str:
        """sha256 identifying the tokenizer: equal fingerprints mean identical ids for any text.

        Covers everything that changes ids or their meaning (model type, pre-tokenizer, tokens,
        token types, merges or scores, special ids and flags) and nothing else (not the chat
        template), so a model exported with copied tokenizer metadata matches its donor.
        """
        if self._fingerprint is None:
            payload = {
                "model": self.model_type,
                "pre": self.pre,
                "tokens": self._tokens,
                "token_type": self._types,
                "merges": self._merges,
                "scores": self._scores,
                "bos": self.bos_id,
                "eos": self.eos_id,
                "unk": self.unk_id,
                "pad": self.pad_id,
                "add_bos": self.add_bos,
                "add_eos": self.add_eos,
                "add_space_prefix": self.add_space_prefix,
            }
            blob = json.dumps(payload, ensure_ascii=False, separators=(",", ":"), allow_nan=True)
            self._fingerprint = hashlib.sha256(blob.encode("utf-8", "surrogatepass")).hexdigest()
        return self._fingerprint

    def __repr__(self) -> str:
        return (
            f"GGUFTokenizer(model={self.model_type!r}, pre={self.pre!r}, vocab_size={self.vocab_size}, "
            f"bos={self.bos_id}, eos={self.eos_id}, add_bos={self.add_bos})"
        )

    # ----- construction -----

    def _model_type(self, metadata: Mapping[str, Any]) -> str:
        model_type = metadata.get("tokenizer.ggml.model")
        if model_type not in SUPPORTED_MODELS:
            raise GGUFError(
                problem(
                    f"{self._source} tokenizer.ggml.model",
                    f"one of {', '.join(SUPPORTED_MODELS)}",
                    repr(model_type) if model_type is not None else "the key is missing",
                    "use a GGUF with a byte-level BPE (gpt2) or SentencePiece (llama) vocabulary",
                )
            )
        return str(model_type)

    def _vocabulary(self, metadata: Mapping[str, Any]) -> list[str]:
        """The token texts; llama.cpp renames empty tokens so every id keeps a distinct text."""
        tokens = metadata.get("tokenizer.ggml.tokens")
        if not isinstance(tokens, list) or not tokens:
            raise GGUFError(
                problem(
                    f"{self._source} tokenizer.ggml.tokens",
                    "the vocabulary as a non-empty list of strings",
                    "it is missing" if tokens is None else f"{tokens!r}"[:60],
                    "use a GGUF exported with its tokenizer (llama.cpp's convert_hf_to_gguf.py writes it)",
                )
            )
        _check_items(tokens, f"{self._source} tokenizer.ggml.tokens", str, "strings")
        return [t if t != "" else f"[EMPTY_{i}]" for i, t in enumerate(tokens)]

    def _bpe_settings(self, metadata: Mapping[str, Any]) -> tuple[PreTokenizer, tuple, bool]:
        """Byte-level BPE: the pre-tokenizer, merges; no default special ids; BOS as the pre says."""
        self.pre, pre = resolve_pre(metadata.get("tokenizer.ggml.pre"), self._source)
        self._merges: list[str] | None = self._string_list(metadata, "tokenizer.ggml.merges")
        self._scores: list[float] | None = None
        self.add_space_prefix = False  # llama.cpp's BPE tokenizer never prefixes a space
        return pre, (None, None, None), pre.add_bos

    def _sentencepiece_settings(self, metadata: Mapping[str, Any]) -> tuple[None, tuple, bool]:
        """SentencePiece: scores fix the merge order; llama.cpp's bos/eos/unk defaults 1/2/0, BOS on."""
        self.pre = self._typed(metadata, "tokenizer.ggml.pre", str, None)
        self._merges = None
        self._scores = self._float_list(metadata, "tokenizer.ggml.scores")
        self.add_space_prefix = self._typed(metadata, "tokenizer.ggml.add_space_prefix", bool, True)
        return None, (1, 2, 0), True

    def _token_types(self, metadata: Mapping[str, Any]) -> list[int]:
        types = metadata.get("tokenizer.ggml.token_type")
        if types is None:
            return [TOKEN_NORMAL] * self.vocab_size  # llama.cpp: every token NORMAL
        if not isinstance(types, list) or len(types) != self.vocab_size:
            raise GGUFError(
                problem(
                    f"{self._source} tokenizer.ggml.token_type",
                    f"one type per token ({self.vocab_size})",
                    f"{len(types) if isinstance(types, list) else type(types).__name__} entries",
                    "re-export the GGUF",
                )
            )
        _check_items(types, f"{self._source} tokenizer.ggml.token_type", int, "integer token types")
        return list(types)

    def _string_list(self, metadata: Mapping[str, Any], key: str) -> list[str]:
        value = metadata.get(key)
        if not isinstance(value, list):
            expected = f"a list of strings (required for tokenizer.ggml.model={self.model_type})"
            found = "it is missing" if value is None else type(value).__name__
            raise GGUFError(problem(f"{self._source} {key}", expected, found, _CORRUPT))
        _check_items(value, f"{self._source} {key}", str, "strings")
        return list(value)

    def _float_list(self, metadata: Mapping[str, Any], key: str) -> list[float]:
        value = metadata.get(key)
        if not isinstance(value, list) or len(value) != self.vocab_size:
            expected = f"one score per token ({self.vocab_size}); they fix the SentencePiece merge order"
            found = "it is missing" if value is None else f"{len(value) if isinstance(value, list) else value!r}"
            raise GGUFError(problem(f"{self._source} {key}", expected, found, _CORRUPT))
        _check_items(value, f"{self._source} {key}", (int, float), "finite numbers")
        return [float(v) for v in value]

    def _typed(self, metadata: Mapping[str, Any], key: str, kind: type, default: Any) -> Any:
        """A scalar key of type `kind` (or the default): `bool(...)` of a list or `str(...)` of a number
        would silently change the ids."""
        value = metadata.get(key, default)
        if value is not None and (not isinstance(value, kind) or (kind is not bool and isinstance(value, bool))):
            raise GGUFError(problem(f"{self._source} {key}", f"a {kind.__name__}", repr(value)[:60], _CORRUPT))
        return value

    def _special_id(self, metadata: Mapping[str, Any], key: str, default: int | None) -> int | None:
        value = metadata.get(key)
        if value is None:
            return default if default is not None and default < self.vocab_size else None
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < self.vocab_size:
            expected, fix = f"a token id in [0, {self.vocab_size})", "fix the special token ids in the GGUF metadata"
            raise GGUFError(problem(f"{self._source} {key}", expected, repr(value), fix))
        return value

    def _model_vocab(self) -> dict[str, int]:
        """token -> id with every id present: for duplicated texts the last id keeps the text (as
        llama.cpp's lookup does) and earlier ids get an unmatchable placeholder, so ids never shift."""
        vocab: dict[str, int] = {}
        for i, tok in enumerate(self._tokens):
            vocab[tok if self._token_to_id[tok] == i else f"\u0000dup{i}\u0000{tok}"] = i
        return vocab

    def _build_byte_level_bpe(self, pre: PreTokenizer) -> Tokenizer:
        """Byte-level BPE (`gpt2`): llama.cpp's split regexes, then GPT-2's byte-to-unicode map."""
        vocab = self._model_vocab()
        self._barriers = missing_byte_chars(vocab)  # ids past the vocabulary, removed by encode
        vocab |= {c: self.vocab_size + n for n, c in enumerate(self._barriers)}
        merges: list[tuple[str, str]] = []
        assert self._merges is not None
        for m in self._merges:
            pos = m.find(" ", 1)  # llama.cpp splits at the first space after the first character
            if pos < 0:
                continue
            a, b = m[:pos], m[pos + 1 :]
            # A merge whose parts or result are not tokens can never yield a valid id; the
            # `tokenizers` BPE rejects them, llama.cpp stores but never usefully applies them.
            if a in vocab and b in vocab and a + b in vocab:
                merges.append((a, b))
        model = models.BPE(vocab=vocab, merges=merges, ignore_merges=pre.ignore_merges, fuse_unk=False)
        tokenizer = Tokenizer(model)
        splits = [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in pre.regexes]
        byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence([*splits, byte_level])
        tokenizer.decoder = decoders.ByteLevel()
        return tokenizer

    def _build_sentencepiece_bpe(self) -> Tokenizer:
        """SentencePiece BPE (`llama`): merges recovered from the scores, byte fallback, `▁` spaces.

        llama.cpp merges the adjacent pair whose concatenation is the best-scoring token; a BPE
        whose merges producing token t are ranked by t's score (best first) does the same.
        """
        vocab = self._model_vocab()
        assert self._scores is not None
        self._check_piece_lengths()
        lengths = {len(t) for t in vocab}  # both halves of a merge are tokens: only their lengths can cut
        ranked: list[tuple[float, int, int, str, str]] = []
        for tok, i in vocab.items():
            for cut in sorted(c for c in lengths if 0 < c < len(tok) and len(tok) - c in lengths):
                left, right = tok[:cut], tok[cut:]
                if left in vocab and right in vocab:
                    ranked.append((-self._scores[i], i, cut, left, right))
        ranked.sort()
        merges = [(left, right) for _, _, _, left, right in ranked]
        unk = self._tokens[self.unk_id] if self.unk_id is not None else None
        model = models.BPE(vocab=vocab, merges=merges, unk_token=unk, fuse_unk=True, byte_fallback=True)
        tokenizer = Tokenizer(model)
        # llama.cpp: a space before every run of text that starts the input or follows a special
        # token (add_space_prefix), and every " " spelled "▁". Normalizers run per such run.
        steps = [normalizers.Replace(" ", SPACE_MARK)]
        if self.add_space_prefix:
            steps.insert(0, normalizers.Prepend(SPACE_MARK))
        tokenizer.normalizer = normalizers.Sequence(steps)  # no decoder: `decode` reads the bytes itself
        return tokenizer

    def _check_piece_lengths(self) -> None:
        """Recovering merges costs about len(token)^2 per token: a forged kilobyte-long piece would stall it."""
        longest = max(range(self.vocab_size), key=lambda i: len(self._tokens[i]))
        if len(self._tokens[longest]) > MAX_PIECE_CHARS:
            raise GGUFError(
                problem(
                    f"{self._source} tokenizer.ggml.tokens[{longest}]",
                    f"SentencePiece pieces of at most {MAX_PIECE_CHARS} characters",
                    f"{len(self._tokens[longest])} characters",
                    "the vocabulary is corrupt; re-export the GGUF",
                )
            )

    def _build(self, control: bool) -> Tokenizer:
        """The `tokenizers` pipeline; `control=False` leaves CONTROL/UNKNOWN tokens unmatched in text."""
        pre = self._pre_tokenizer
        tokenizer = self._build_byte_level_bpe(pre) if pre is not None else self._build_sentencepiece_bpe()
        self._add_special_tokens(tokenizer, control)
        return tokenizer

    def _add_special_tokens(self, tokenizer, control: bool = True) -> None:
        """Tokens llama.cpp matches whole in raw text before splitting: CONTROL, UNKNOWN (special,
        dropped by decode; not matched with `control=False`, as llama.cpp's `parse_special=false`)
        and USER_DEFINED (kept by decode, always matched). They keep their vocabulary ids."""
        special, user = [], []
        for i, (tok, typ) in enumerate(zip(self._tokens, self._types, strict=True)):
            if self._token_to_id[tok] != i:
                continue
            if typ in (TOKEN_CONTROL, TOKEN_UNKNOWN) and control:
                special.append(AddedToken(tok, special=True, normalized=False))
            elif typ == TOKEN_USER_DEFINED:
                user.append(AddedToken(tok, special=False, normalized=False))
        if special:
            tokenizer.add_special_tokens(special)
        if user:
            tokenizer.add_tokens(user)
        n = tokenizer.get_vocab_size(with_added_tokens=True) - len(self._barriers)  # barriers: past the vocab
        if n != self.vocab_size:
            fix = "report this GGUF: its special tokens could not be mapped to their ids"
            expected = f"{self.vocab_size} ids after adding special tokens"
            raise GGUFError(problem(f"{self._source} tokenizer.ggml.tokens", expected, str(n), fix))


_CORRUPT = "the tokenizer metadata is corrupt; re-export the GGUF with llama.cpp's convert_hf_to_gguf.py"


def _check_items(values: list, where: str, kind: type | tuple[type, ...], what: str) -> None:
    """Every element of a metadata list is of `kind` (bools are not numbers here, floats are finite)."""
    for i, v in enumerate(values):
        if isinstance(v, bool) or not isinstance(v, kind) or (isinstance(v, float) and not math.isfinite(v)):
            raise GGUFError(problem(f"{where}[{i}]", f"a list of {what}", f"{type(v).__name__} {v!r}"[:80], _CORRUPT))


def tokenizer_from_gguf(gguf: GGUFFile) -> GGUFTokenizer:
    """The tokenizer of an opened GGUF (its `tokenizer.ggml.*` metadata)."""
    return GGUFTokenizer(gguf.metadata, source=str(gguf.path))
