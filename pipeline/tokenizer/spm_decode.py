"""SentencePiece (`llama`) decoding with byte fallback as llama.cpp does it: bytes first, text last.

llama.cpp turns each token into bytes (a `<0xXX>` token into its byte, a piece into its UTF-8
with `▁` as a space) and the caller decodes the whole byte string. The `tokenizers` ByteFallback
decoder instead replaces every byte of a run that is not valid UTF-8 as a whole by U+FFFD, so a
generation cut inside a character (`<0xE2> <0x82>`) after byte-spelled text (`<0x49>` "I") lost
the text too ("���" where llama.cpp gives "I��"). Decoding the bytes once keeps every valid
character and replaces only the broken ones, as Python's and llama.cpp's callers do.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from pipeline.tokenizer.token_types import SPACE_MARK, TOKEN_BYTE, TOKEN_CONTROL, TOKEN_UNKNOWN

_BYTE_SPELLING = re.compile("<0x([0-9A-Fa-f]{2})>")


def token_bytes(text: str, kind: int) -> bytes:
    """The bytes one token stands for: its byte for a BYTE token spelled `<0xXX>`, else its text
    with `▁` as a space."""
    spelled = _BYTE_SPELLING.fullmatch(text) if kind == TOKEN_BYTE else None
    if spelled:
        return bytes([int(spelled.group(1), 16)])
    return text.replace(SPACE_MARK, " ").encode("utf-8", "surrogatepass")  # metadata given as a dict may hold any str


def decode_sentencepiece(
    tokens: Sequence[str], kinds: Sequence[int], ids: Sequence[int], skip_special: bool, add_space_prefix: bool
) -> str:
    """Text of `ids`: CONTROL/UNKNOWN tokens dropped when `skip_special`, invalid UTF-8 replaced
    per broken sequence, and the space `add_space_prefix` put before the text removed."""
    dropped = (TOKEN_CONTROL, TOKEN_UNKNOWN) if skip_special else ()
    raw = b"".join(token_bytes(tokens[i], kinds[i]) for i in ids if kinds[i] not in dropped)
    text = raw.decode("utf-8", errors="replace")
    return text[1:] if add_space_prefix and text.startswith(" ") else text
