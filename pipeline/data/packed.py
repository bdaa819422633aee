"""The packed-data format (`data/packed/`): the one module that writes and reads it.

`meta.json` (vocab size, dtype, tokenizer fingerprint, corpus sha256, counts) describes either
- running text: `train.bin` / `val.bin`, raw little-endian uint16 ids when the vocab fits, else
  uint32, read back as read-only memmaps (the corpus is never loaded into RAM); or
- instruction rows (`format: instruct`): `train.npz` / `val.npz` with `input_ids`, `labels`
  (-100 = no loss) and `segment_ids` (1.. per packed example, 0 = padding), plus stats; or
- labelled images (`format: images`, the ViT recipe): `{split}.pixels` (raw little-endian float32,
  (N, channels, size, size), normalized) and `{split}.labels` (int64), read back as memmaps;
  `n_classes` is the number of classes (`vocab_size` 0), `documents` and `tokens` count images, and `stats` holds
  the class names, image size, channels and the normalization (mean, std).
"""

from __future__ import annotations

import json
import math
import os
import zipfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from pipeline.errors import DataError, problem
from pipeline.io.files import atomic_file, fingerprint_of, sha256_file, write_json

if TYPE_CHECKING:  # the pack stage runs without torch
    import torch

SPLITS = ("train", "val")
META_FILE = "meta.json"


@dataclass
class PackMeta:
    vocab_size: int
    dtype: str
    tokenizer_fingerprint: str
    corpus_sha256: str
    source: str
    bos_id: int | None
    eos_id: int | None
    documents: dict[str, int]
    tokens: dict[str, int]
    distinct_tokens: int
    format: str = "tokens"  # tokens (train.bin/val.bin) | instruct (train.npz/val.npz rows) | images
    seq_len: int = 0  # instruct: row length
    stats: dict | None = None  # instruct: per-split counts (examples, truncated, rows, label tokens)
    data: dict | None = None  # the data config it was packed with: what later stages check theirs against
    bytes: dict[str, int] | None = None  # running text: UTF-8 bytes of each split's documents (bits per byte)
    sources: list[dict] | None = None  # a mixture: per source documents, tokens, share (pipeline.data.mixture)
    shards: int | None = None  # merged from this many shards (pipeline.data.shards)
    n_classes: int = 0  # images: the number of classes (vocab_size is then 0: there are no tokens)
    val_kept_of: int | None = None  # the val split's tokens before `cap_val` kept tokens["val"] of them

    def bits_per_token(self, split: str = "val") -> float | None:
        """Nats per token -> bits per UTF-8 byte of `split`'s text (its token/byte ratio over ln 2): the
        unit that compares models with different tokenizers. None where pack counted no bytes (instruct rows)."""
        counted = (self.bytes or {}).get(split)
        return self.tokens[split] / counted / math.log(2) if counted else None


@dataclass
class Images:
    """Labelled images: normalized pixels (N, C, H, W) float32 and class ids (N,) int64, memmapped."""

    pixels: np.ndarray
    labels: np.ndarray


@dataclass
class Packed:
    """Rows of `max_seq_len` positions: token ids, next-token labels (-100 = no loss), segment ids."""

    input_ids: np.ndarray  # (N, T) int64
    labels: np.ndarray  # (N, T) int64
    segment_ids: np.ndarray  # (N, T) int32, 1.. per example in the row, 0 = padding
    stats: dict[str, int] = field(default_factory=dict)


def ids_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size <= 2**16 else np.dtype(np.uint32)


OPTIONAL = (
    "sources",
    "shards",
    "val_kept_of",
)  # left out of meta.json when None: a plain pack's meta is as it always was


def write_meta(out_dir: Path, meta: PackMeta) -> None:
    record = asdict(meta)
    write_json(Path(out_dir) / META_FILE, {k: v for k, v in record.items() if k not in OPTIONAL or v is not None})


def write_tokens(out_dir: Path, split: str, ids: np.ndarray) -> None:
    """One split's ids as raw little-endian `train.bin` / `val.bin`."""
    ids.astype(ids.dtype.newbyteorder("<")).tofile(Path(out_dir) / f"{split}.bin")


def save_rows(packed: Packed, path: str | os.PathLike[str]) -> Path:
    """An .npz of the three arrays plus stats (JSON), written atomically."""
    with atomic_file(path, suffix=".npz") as tmp:
        np.savez(
            tmp,
            input_ids=packed.input_ids,
            labels=packed.labels,
            segment_ids=packed.segment_ids,
            stats=np.frombuffer(json.dumps(packed.stats).encode(), dtype=np.uint8),
        )
    return Path(path)


def spread_spans(n: int, budget: int, span: int) -> list[list[int]]:
    """[start, end) spans of `span` tokens (at most `budget` in all), evenly spread over `n` tokens and
    disjoint; [] when all `n` fit the budget (or the budget is 0: no limit)."""
    if budget <= 0 or n <= budget:
        return []
    span = min(span, budget)
    count = budget // span
    starts = np.linspace(0, n - span, count).round().astype(np.int64) if count > 1 else np.zeros(1, np.int64)
    return [[int(s), int(s) + span] for s in starts]


VAL_SPAN = 2048  # tokens per kept span of a capped val split: 16 windows of the default train.seq_len


def cap_val(out_dir: Path, meta: PackMeta, max_tokens: int) -> None:
    """Keep at most `max_tokens` of a running-text val split (`out_dir`/val.bin, rewritten in place
    before the pack is committed), as evenly spread spans: every stage measures val loss over it
    (the donor's in teach, every evaluation in train), so a 10 MB corpus's 1 MB val split would cost
    minutes per pass and add no decision. Its byte count is scaled alike, keeping bits per byte."""
    spans = spread_spans(meta.tokens["val"], max_tokens, VAL_SPAN)
    if not spans:
        return
    path = Path(out_dir) / "val.bin"
    ids = np.fromfile(path, dtype=np.dtype(meta.dtype).newbyteorder("<"))
    kept = np.concatenate([ids[s:e] for s, e in spans])
    kept.tofile(path)
    meta.val_kept_of, meta.tokens["val"] = meta.tokens["val"], len(kept)
    if meta.bytes and meta.bytes.get("val"):
        meta.bytes["val"] = round(meta.bytes["val"] * len(kept) / meta.val_kept_of)


REPACK = "the pack stage writes it: re-run `dvc repro -f pack`"


def load_rows(path: str | os.PathLike[str]) -> Packed:
    """Instruction rows as `save_rows` wrote them; a corrupt or truncated file is a named error."""
    p = Path(path)
    if not p.is_file():
        raise DataError(problem(str(p), "packed instruction data (.npz)", "no such file", "re-run the data stage"))
    try:
        with np.load(p) as z:
            stats = json.loads(bytes(z["stats"]).decode())
            rows = Packed(z["input_ids"], z["labels"], z["segment_ids"], stats)
    except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile) as e:
        raise DataError(problem(str(p), "packed instruction rows (.npz)", _unreadable(e), REPACK)) from None
    shapes = {a.shape for a in (rows.input_ids, rows.labels, rows.segment_ids)}
    if len(shapes) != 1 or rows.input_ids.ndim != 2 or not isinstance(stats, dict):
        raise DataError(problem(str(p), "three (rows, seq_len) arrays and stats", f"shapes {sorted(shapes)}", REPACK))
    return rows


def train_tokens(packed_dir: Path) -> int:
    """The packed train split's tokens (what sizes the donor's cut: `pipeline.config.student`)."""
    return load_meta(packed_dir).tokens["train"]


def load_meta(packed_dir: Path) -> PackMeta:
    """The packed data's meta, with a named error when the pack stage has not run or its file is corrupt."""
    path = Path(packed_dir) / META_FILE
    if not path.is_file():
        raise DataError(problem(str(path), "packed data from the pack stage", "no such file", "run: dvc repro pack"))
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError) as e:  # ValueError: bad JSON, or bytes that are not UTF-8
        raise DataError(problem(str(path), "the pack stage's meta.json", _unreadable(e), REPACK)) from None
    try:
        meta = PackMeta(**raw) if isinstance(raw, dict) else None
    except TypeError as e:  # missing or unknown keys
        raise DataError(problem(str(path), "the pack stage's meta.json", _unreadable(e), REPACK)) from None
    bad = _meta_problem(meta) if meta is not None else f"a JSON {type(raw).__name__}, not an object"
    if bad:
        raise DataError(problem(str(path), "the pack stage's meta.json", bad, REPACK))
    return meta


def _unreadable(e: Exception) -> str:
    return f"unreadable ({type(e).__name__}: {' '.join(str(e).split())[:100]})"


def _count(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _meta_problem(m: PackMeta) -> str | None:
    """What is wrong with a meta's values (types and ranges later stages rely on), or None."""
    images = m.format == "images"
    if (
        not _count(m.vocab_size)
        or (m.vocab_size == 0) != images
        or not _count(m.n_classes)
        or (m.n_classes > 0) != images
    ):
        return f"vocab_size {m.vocab_size!r}, n_classes {m.n_classes!r} (format {m.format!r})"
    if m.dtype not in ("uint16", "uint32", "int64", "float32") or m.format not in ("tokens", "instruct", "images"):
        return f"dtype {m.dtype!r}, format {m.format!r}"
    for name, counts in (("tokens", m.tokens), ("documents", m.documents)):
        if not isinstance(counts, dict) or not all(_count(counts.get(s)) for s in SPLITS):
            return f"{name} {counts!r}"[:80]
    for name in ("bos_id", "eos_id"):
        value = getattr(m, name)
        if value is not None and not (_count(value) and value < m.vocab_size):
            return f"{name} {value!r}"
    if not _count(m.seq_len) or not _count(m.distinct_tokens) or not isinstance(m.tokenizer_fingerprint, str):
        return f"seq_len {m.seq_len!r}, distinct_tokens {m.distinct_tokens!r}"
    return None


def data_files(packed_dir: Path) -> list[Path]:
    """The files that identify the packed data (for checkpoint compatibility): meta, train, val (, labels)."""
    fmt = load_meta(packed_dir).format
    if fmt == "images":
        names = (META_FILE, "train.pixels", "val.pixels", "train.labels", "val.labels")
        return [Path(packed_dir) / n for n in names]
    ext = "npz" if fmt == "instruct" else "bin"
    return [Path(packed_dir) / n for n in (META_FILE, f"train.{ext}", f"val.{ext}")]


def split_sha256(packed_dir: Path, split: str) -> dict[str, str]:
    """File name -> sha256 of one split's files, read once for both its fingerprint and the teach
    stage's check that the donor's val loss is of this split."""
    return {f.name: sha256_file(f) for f in data_files(packed_dir) if f.name.startswith(f"{split}.")}


def split_fingerprint(packed_dir: Path, split: str, hashes: dict[str, str] | None = None) -> str:
    """What identifies one split's contents (`fingerprint` of its files, from `hashes` when given):
    runs measured on equal val fingerprints saw the same windows, rows or images, so their losses compare."""
    return fingerprint_of((hashes if hashes is not None else split_sha256(packed_dir, split)).items())


def write_images(out_dir: Path, split: str, pixels: np.ndarray, labels: np.ndarray) -> None:
    """One split of labelled images as raw little-endian `{split}.pixels` (float32) and `{split}.labels` (int64)."""
    np.ascontiguousarray(pixels, dtype="<f4").tofile(Path(out_dir) / f"{split}.pixels")
    np.ascontiguousarray(labels, dtype="<i8").tofile(Path(out_dir) / f"{split}.labels")


def load_images(packed_dir: Path, split: str) -> Images:
    """One split of labelled images as read-only memmaps, sizes checked against meta.json."""
    meta = load_meta(packed_dir)
    stats = meta.stats or {}
    n, c, size = meta.documents[split], stats.get("channels", 0), stats.get("image_size", 0)
    arrays = []
    for ext, dtype, shape in (("pixels", "<f4", (n, c, size, size)), ("labels", "<i8", (n,))):
        path = Path(packed_dir) / f"{split}.{ext}"
        expected = int(np.prod(shape)) * 4 * (1 if ext == "pixels" else 2)
        if not path.is_file() or path.stat().st_size != expected:
            found = path.stat().st_size if path.is_file() else "no file"
            raise DataError(problem(str(path), f"{expected} bytes per meta.json", f"{found}", REPACK))
        arrays.append(np.memmap(path, dtype=np.dtype(dtype), mode="r", shape=shape))
    return Images(*arrays)


def load_data(packed_dir: Path, split: str) -> np.memmap | Packed | Images:
    """One split as the training loop takes it: token ids, instruct rows, or labelled images."""
    fmt = load_meta(packed_dir).format
    if fmt == "instruct":
        return load_rows(Path(packed_dir) / f"{split}.npz")
    if fmt == "images":
        return load_images(packed_dir, split)
    return load_split(packed_dir, split)


class TokenSplit(np.memmap):
    """A split's token ids, memmapped read-only, and the id every window cut from it begins with: the BOS
    its tokenizer adds (`PackMeta.bos_id`), as llama.cpp begins every sequence (Gemma scores 5.07 nats per
    token on pydoc windows that start mid-text, 3.21 when they start with BOS), or None."""

    bos: int | None = None  # a slice of the split is a plain view: None


def window_bos(data: object) -> int | None:
    """The id the windows of `data` begin with (a `TokenSplit`'s BOS), or None."""
    return getattr(data, "bos", None)


def begin_with_bos(rows: np.ndarray | torch.Tensor, bos: int | None) -> np.ndarray | torch.Tensor:
    """Windows (n, length) of a token stream as the model is to read them: the first token replaced by `bos`
    when there is one (the targets, one position on, are untouched)."""
    if bos is not None:
        rows[:, 0] = bos
    return rows


def load_split(packed_dir: Path, split: str) -> TokenSplit:
    """One split's ids as a read-only memmap (the whole corpus is never loaded into RAM), with its BOS."""
    meta = load_meta(packed_dir)
    if meta.format != "tokens":
        raise DataError(
            problem(
                str(packed_dir),
                "running-text token ids (train.bin/val.bin)",
                f"{meta.format} data (data.source={meta.source})",
                "use text data here, or a stage that takes instruct rows",
            )
        )
    path = Path(packed_dir) / f"{split}.bin"
    expected = meta.tokens[split] * np.dtype(meta.dtype).itemsize
    if not path.is_file() or path.stat().st_size != expected:
        found = path.stat().st_size if path.is_file() else "no file"
        raise DataError(problem(str(path), f"{expected} bytes per meta.json", f"{found}", "re-run: dvc repro pack"))
    split_ids = TokenSplit(path, dtype=np.dtype(meta.dtype).newbyteorder("<"), mode="r")
    split_ids.bos = meta.bos_id
    return split_ids


def is_rows(data: object) -> bool:
    """Instruct data (packed rows with labels and segments) rather than a token stream."""
    return isinstance(data, Packed)


def is_images(data: object) -> bool:
    """Labelled images (the ViT recipe) rather than tokens."""
    return isinstance(data, Images)


def n_items(data: object) -> int:
    """Rows of instruct data or images of an image split: what an epoch visits once."""
    return len(data.labels) if isinstance(data, Images) else len(data.input_ids)
