"""Corpus formats pack reads as streams: gzip JSONL, parquet by record batch, text with every
separator it always took; each bad input is one named line and leaves nothing behind."""

from __future__ import annotations

import gzip
import importlib.util
import json
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.config import DataConfig
from pipeline.data.corpus import load_documents
from pipeline.data.packed import load_meta
from pipeline.data.text import pack
from pipeline.errors import DataError
from pipeline.tokenizer.gguf_tokenizer import GGUFTokenizer, tokenizer_from_gguf

HAS_ZSTD = importlib.util.find_spec("zstandard") is not None


@pytest.fixture(scope="module")
def tok(smollm2) -> GGUFTokenizer:
    return tokenizer_from_gguf(smollm2)


def jsonl_bytes(n: int, field: str = "text") -> bytes:
    return "".join(json.dumps({field: f"document {i} ünïcode " * 5}) + "\n" for i in range(n)).encode()


def test_gzip_jsonl_reads_like_the_plain_file(tmp_path: Path, tok: GGUFTokenizer) -> None:
    plain, packed = tmp_path / "c.jsonl", tmp_path / "c.jsonl.gz"
    plain.write_bytes(jsonl_bytes(20))
    packed.write_bytes(gzip.compress(jsonl_bytes(20)))
    a = load_documents(DataConfig(source="jsonl", path=str(plain)))
    b = load_documents(DataConfig(source="jsonl", path=str(packed)))
    assert [d.text for d in a] == [d.text for d in b] and len(a) == 20
    meta, _ = pack(iter(b), tok, DataConfig(source="jsonl", path=str(packed)), tmp_path / "p")
    assert sum(meta.documents.values()) == 20


def test_corrupt_gzip_names_the_file_and_offset(tmp_path: Path, tok: GGUFTokenizer) -> None:
    data = bytearray(gzip.compress(jsonl_bytes(3000)))
    data[len(data) // 2 : len(data) // 2 + 64] = b"\xff" * 64  # damage the deflate stream mid-way
    bad = tmp_path / "bad.jsonl.gz"
    bad.write_bytes(bytes(data))
    with pytest.raises(DataError) as err:
        load_documents(DataConfig(source="jsonl", path=str(bad)))
    msg = str(err.value)
    assert str(bad) in msg and "compressed byte" in msg and "gzip" in msg and "\n" not in msg
    truncated = tmp_path / "cut.jsonl.gz"
    truncated.write_bytes(gzip.compress(jsonl_bytes(50))[:-20])
    with pytest.raises(DataError, match="corrupt data"):
        pack(iter_docs(truncated), tok, DataConfig(source="jsonl", path=str(truncated)), tmp_path / "out")
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out*"))


def iter_docs(path: Path):
    from pipeline.data.corpus import iter_documents

    return iter_documents(DataConfig(source="jsonl", path=str(path)))


def test_zstd_without_the_package_is_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """On a machine without zstandard (here: its import made to fail, so CI, which has it, runs this too)."""
    monkeypatch.setitem(sys.modules, "zstandard", None)  # `import zstandard` now raises ImportError
    p = tmp_path / "c.jsonl.zst"
    p.write_bytes(b"\x28\xb5\x2f\xfd" + b"\0" * 32)
    with pytest.raises(DataError, match="zstandard package"):
        load_documents(DataConfig(source="jsonl", path=str(p)))


@pytest.mark.skipif(not HAS_ZSTD, reason="zstandard is not installed")
def test_zstd_jsonl_reads_like_the_plain_file(tmp_path: Path) -> None:
    import zstandard

    p = tmp_path / "c.jsonl.zst"
    p.write_bytes(zstandard.ZstdCompressor().compress(jsonl_bytes(5)))
    assert len(load_documents(DataConfig(source="jsonl", path=str(p)))) == 5


def write_parquet(path: Path, texts: list, column: str = "text", row_group_size: int = 4) -> Path:
    pq.write_table(pa.table({column: texts, "id": list(range(len(texts)))}), path, row_group_size=row_group_size)
    return path


def test_parquet_column_across_row_groups(tmp_path: Path, tok: GGUFTokenizer) -> None:
    p = write_parquet(tmp_path / "c.parquet", [f"row {i} text" for i in range(10)], column="content")
    cfg = DataConfig(source="parquet", path=str(p), text_field="content", val_fraction=0.2)
    docs = load_documents(cfg)
    assert [d.text for d in docs] == [f"row {i} text" for i in range(10)] and docs[3].name == "c.parquet:3"
    meta, _ = pack(iter(docs), tok, cfg, tmp_path / "p")
    assert meta.documents == {"train": 8, "val": 2} and load_meta(tmp_path / "p").source == "parquet"


@pytest.mark.parametrize(
    ("texts", "column", "needles"),
    [
        (["a", "b"], "body", ["row group 0", "'text'", "columns ['body', 'id']"]),
        ([1, 2], "text", ["row group 0", "of strings", "int64"]),
        (["a", "b", "c", "d", "e", None], "text", ["row 5", "null"]),
    ],
)
def test_parquet_without_the_text_column_is_named(tmp_path: Path, texts: list, column: str, needles: list) -> None:
    p = write_parquet(tmp_path / "bad.parquet", texts, column=column)
    with pytest.raises(DataError) as err:
        load_documents(DataConfig(source="parquet", path=str(p)))
    for needle in [str(p), *needles]:
        assert needle in str(err.value)


def test_not_parquet_is_named(tmp_path: Path) -> None:
    p = tmp_path / "x.parquet"
    p.write_text("not parquet")
    with pytest.raises(DataError, match="expected a parquet file"):
        load_documents(DataConfig(source="parquet", path=str(p)))


def test_text_separators_and_newlines_as_before(tmp_path: Path) -> None:
    p = tmp_path / "t.txt"
    p.write_bytes("one\r\nline two\r\n---\r\nsecond\fthird\n  ---  \n\n---\nlast\u2028x\n".encode())
    docs = load_documents(DataConfig(source="text", path=str(p)))
    assert [(d.name, d.text) for d in docs] == [
        ("t.txt#0", "one\nline two"),
        ("t.txt#1", "second"),
        ("t.txt#2", "third"),
        ("t.txt#4", "last\u2028x"),
    ]
    gz = tmp_path / "t.txt.gz"
    gz.write_bytes(gzip.compress(p.read_bytes()))
    assert [d.text for d in load_documents(DataConfig(source="text", path=str(gz)))] == [d.text for d in docs]


def test_a_utf8_bom_is_dropped_from_every_source(tmp_path: Path) -> None:
    """Windows editors start UTF-8 files with a BOM: it is not text (no stray tokens in the first
    document, JSONL's first line still parses), and an undecodable byte's offset still counts it."""
    bom = b"\xef\xbb\xbf"
    (tmp_path / "t.txt").write_bytes(bom + b"first doc\r\n---\r\nsecond\r\n")
    (tmp_path / "c.jsonl").write_bytes(bom + b'{"text": "a"}\r\n{"text": "b"}\r\n')
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "1.txt").write_bytes(bom + b"one")
    (tmp_path / "d" / "2.txt").write_bytes(b"two")
    text = load_documents(DataConfig(source="text", path=str(tmp_path / "t.txt")))
    jsonl = load_documents(DataConfig(source="jsonl", path=str(tmp_path / "c.jsonl")))
    folder = load_documents(DataConfig(source="dir", path=str(tmp_path / "d"), glob="*.txt"))
    assert [d.text for d in text] == ["first doc", "second"]
    assert [d.text for d in jsonl] == ["a", "b"] and [d.text for d in folder] == ["one", "two"]
    (tmp_path / "bad.txt").write_bytes(bom + b"ok \xff")
    with pytest.raises(DataError, match="undecodable bytes at offset 6"):
        load_documents(DataConfig(source="text", path=str(tmp_path / "bad.txt")))


def test_a_lone_surrogate_escape_in_jsonl_names_the_line(tmp_path: Path) -> None:
    """Valid JSON, but half an emoji is no text: it was a TypeError traceback from the tokenizer."""
    p = tmp_path / "c.jsonl"
    p.write_text('{"text": "\\ud83d\\ude00 a whole emoji"}\n{"text": "cut \\ud83d"}\n')
    with pytest.raises(DataError, match=rf"^{p} line 2: expected valid Unicode text, found a lone surrogate \\ud83d"):
        load_documents(DataConfig(source="jsonl", path=str(p)))
    p.write_text('{"text": "\\ud83d\\ude00 a whole emoji"}\n{"text": "b"}\n')
    assert [d.text for d in load_documents(DataConfig(source="jsonl", path=str(p)))] == [
        "\U0001f600 a whole emoji",
        "b",
    ]


def test_undecodable_text_names_the_byte_offset(tmp_path: Path) -> None:
    p = tmp_path / "t.txt"
    p.write_bytes(b"fine line\n---\nok \xff bad\n")
    with pytest.raises(DataError, match="undecodable bytes at offset 17"):
        load_documents(DataConfig(source="text", path=str(p)))


def test_gzip_jsonl_without_the_field_names_the_line(tmp_path: Path) -> None:
    p = tmp_path / "c.jsonl.gz"
    p.write_bytes(gzip.compress(jsonl_bytes(40) + jsonl_bytes(1, field="content")))
    with pytest.raises(DataError) as err:
        load_documents(DataConfig(source="jsonl", path=str(p)))
    assert f"{p} line 41" in str(err.value) and "'text'" in str(err.value) and "['content']" in str(err.value)


@pytest.mark.skipif(not HAS_ZSTD, reason="zstandard is not installed (without it a .zst is the named error above)")
def test_corrupt_zstd_names_the_file_and_offset(tmp_path: Path) -> None:
    """Written with a content checksum, as the zstd CLI does by default (without one, damage can decode silently)."""
    import zstandard

    data = bytearray(zstandard.ZstdCompressor(write_checksum=True).compress(jsonl_bytes(3000)))
    data[len(data) // 2 : len(data) // 2 + 64] = b"\xff" * 64
    bad = tmp_path / "bad.jsonl.zst"
    bad.write_bytes(bytes(data))
    with pytest.raises(DataError) as err:
        load_documents(DataConfig(source="jsonl", path=str(bad)))
    msg = str(err.value)
    assert str(bad) in msg and "compressed byte" in msg and "zstd" in msg and "\n" not in msg


def test_corrupt_parquet_row_group_is_named(tmp_path: Path) -> None:
    """Damage inside the third row group's data: the error names that row group, after the first two read."""
    p = tmp_path / "c.parquet"
    texts = [f"row {i} " + "text " * 50 for i in range(30)]
    pq.write_table(pa.table({"text": texts}), p, row_group_size=10, compression="snappy")
    column = pq.ParquetFile(p).metadata.row_group(2).column(0)
    start = column.data_page_offset
    data = bytearray(p.read_bytes())
    data[start + 20 : start + 120] = b"\xff" * 100
    p.write_bytes(bytes(data))
    with pytest.raises(DataError) as err:
        load_documents(DataConfig(source="parquet", path=str(p)))
    assert f"{p} row group 2" in str(err.value) and "\n" not in str(err.value)
