"""Lazy reading of corpus files: lines of plain, gzip or zstd text and parquet row batches, so that pack
holds one batch of documents at a time whatever the corpus size. Every failure names the file and where
in it (line, byte offset, row group) reading stopped."""

from __future__ import annotations

import gzip
import io
import json
import re
import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO

from pipeline.errors import DataError, one_line, problem

GZIP_MAGIC = b"\x1f\x8b"
ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")  # a JSON escape of half a UTF-16 pair
UTF8_BOM = b"\xef\xbb\xbf"  # Windows editors start UTF-8 files with it; it is no part of the text


def compression(p: Path) -> str:
    """`gzip`, `zstd` or `none`, by the file's first bytes (a misnamed file still reads)."""
    with p.open("rb") as f:
        head = f.read(4)
    if head.startswith(GZIP_MAGIC):
        return "gzip"
    return "zstd" if head == ZSTD_MAGIC else "none"


def _zstd_reader(raw: BinaryIO, p: Path) -> BinaryIO:
    try:
        import zstandard  # optional: only .zst corpora need it
    except ImportError:
        raise DataError(
            problem(
                str(p),
                "the zstandard package to read a zstd-compressed corpus",
                "it is not installed",
                "pip install zstandard, or decompress the file (zstd -d) or recompress it with gzip",
            )
        ) from None
    # zstandard's reader has no readline (iterating it raises); a buffered reader over it has
    reader = zstandard.ZstdDecompressor().stream_reader(raw, read_size=1 << 20)
    return io.BufferedReader(reader, buffer_size=1 << 20)  # type: ignore[arg-type]


def _stream_errors() -> tuple[type[BaseException], ...]:
    errors: list[type[BaseException]] = [OSError, EOFError, zlib.error]
    try:
        import zstandard

        errors.append(zstandard.ZstdError)
    except ImportError:
        pass
    return tuple(errors)


@contextmanager
def open_binary(p: Path) -> Iterator[tuple[BinaryIO, Callable[[], int]]]:
    """The file's decompressed bytes, and a function giving how far into the file (compressed) it has read."""
    kind = compression(p)
    with p.open("rb") as raw:
        if kind == "gzip":
            stream: BinaryIO = gzip.GzipFile(fileobj=raw, mode="rb")  # type: ignore[assignment]
        elif kind == "zstd":
            stream = _zstd_reader(raw, p)
        else:
            stream = raw
        try:
            yield stream, raw.tell
        finally:
            if stream is not raw:
                stream.close()


def iter_lines(p: Path) -> Iterator[tuple[int, str]]:
    """(line number, text) of each line, newline kept, `\\r\\n` and `\\r` read as `\\n` and a leading
    UTF-8 BOM dropped, as `read_text` does. Undecodable bytes and corrupt compressed streams end in one
    named line with the offset."""
    offset = 0
    with open_binary(p) as (stream, raw_offset):
        lines = iter(stream)
        lineno = 0
        while True:
            try:
                line = next(lines, None)
            except _stream_errors() as e:
                raise DataError(
                    problem(
                        f"{p} (compressed byte ~{raw_offset()}, text byte {offset})",
                        f"a readable {compression(p)} stream",
                        f"corrupt data ({type(e).__name__}: {' '.join(str(e).split())[:80]})",
                        "re-download or recompress the file",
                    )
                ) from None
            if line is None:
                return
            lineno += 1
            body, skip = without_bom(line) if lineno == 1 else (line, 0)
            yield lineno, decode(body, p, offset + skip)
            offset += len(line)


def without_bom(data: bytes) -> tuple[bytes, int]:
    """`data` without a leading UTF-8 BOM (a Windows editor's mark, not text), and how many bytes went."""
    skip = len(UTF8_BOM) if data.startswith(UTF8_BOM) else 0
    return data[skip:], skip


def decode(data: bytes, p: Path, offset: int = 0) -> str:
    """UTF-8 text with universal newlines; an undecodable byte is named by its offset in the file."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(
            problem(
                str(p), "UTF-8 text", f"undecodable bytes at offset {offset + e.start}", "convert the file to UTF-8"
            )
        ) from None
    return text.replace("\r\n", "\n").replace("\r", "\n") if "\r" in text else text


def load_json_line(line: str, where: str) -> object:
    """One JSONL line parsed, or a one-line DataError: invalid JSON, or a lone surrogate escape (half of
    an emoji cut in two, common in scraped text), which is valid JSON but no text a tokenizer takes."""
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise DataError(problem(where, "a JSON object", f"invalid JSON ({e.msg})", "fix or remove the line")) from None
    if SURROGATE_ESCAPE.search(line):
        try:
            json.dumps(obj, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError as e:
            found = f"a lone surrogate \\u{ord(e.object[e.start]):04x} (half of a UTF-16 pair, e.g. a cut emoji)"
            raise DataError(problem(where, "valid Unicode text", found, "repair or remove the line")) from None
    return obj


def read_text(p: Path) -> str:
    """A whole (possibly compressed) file as text: one document of a directory source."""
    with open_binary(p) as (stream, _):
        try:
            data = stream.read()
        except _stream_errors() as e:
            raise DataError(
                problem(str(p), "a readable file", f"{type(e).__name__}: {e}", "re-download or recompress the file")
            ) from None
    body, skip = without_bom(data)
    return decode(body, p, skip)


def iter_parquet(p: Path, column: str, batch_rows: int = 1024) -> Iterator[tuple[int, str | None]]:
    """(row number, text) of `column`, read one record batch at a time; a missing or non-text column
    names the file and row group."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(p)
    except (OSError, pa.ArrowException) as e:
        raise DataError(
            problem(str(p), "a parquet file", f"unreadable ({one_line(e, 100)})", "check data.path")
        ) from None
    schema = pf.schema_arrow
    where = f"{p} row group 0"
    if column not in schema.names:
        fix = "set data.text_field to the column holding the text"
        raise DataError(problem(where, f"a column {column!r}", f"columns {schema.names}", fix))
    kind = schema.field(column).type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
        raise DataError(problem(where, f"column {column!r} of strings", str(kind), "point data.text_field at text"))
    row = 0
    for group in range(pf.num_row_groups):
        try:
            for batch in pf.iter_batches(batch_size=batch_rows, row_groups=[group], columns=[column]):
                for text in batch.column(0).to_pylist():
                    yield row, text
                    row += 1
        except (OSError, pa.ArrowException) as e:
            raise DataError(
                problem(f"{p} row group {group}", "readable rows", one_line(e, 100), "re-export the file")
            ) from None
