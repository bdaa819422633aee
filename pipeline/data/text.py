"""Running text -> token ids with the donor's own tokenizer, split by document, written as the
packed-data format (`pipeline.data.packed`). No document leaks from train into val.

Pack streams: documents come lazily from the source, are tokenized a batch at a time (the next batch
is tokenized on a worker thread, which `tokenizers` runs without the GIL, while this one writes the
last) and appended to one token file in corpus order, with each document's length kept (16 bytes a
document). Once the document count is known the seeded split (`pipeline.data.split`) is decided and
the token file is copied out into `train.bin` / `val.bin` in bounded pieces, so memory stays flat.
"""

from __future__ import annotations

import resource
import time
from array import array
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import asdict
from itertools import chain
from pathlib import Path
from typing import BinaryIO

import numpy as np

from pipeline.config import DataConfig
from pipeline.config.data_schema import HOW_KEYS
from pipeline.data.corpus import CorpusHash, Document, too_few_documents
from pipeline.data.packed import REPACK, SPLITS, PackMeta, cap_val, ids_dtype, write_meta
from pipeline.data.split import split_indices, val_mask
from pipeline.errors import DataError, problem
from pipeline.io.files import atomic_dir
from pipeline.progress import Progress
from pipeline.tokenizer.gguf_tokenizer import GGUFTokenizer

BATCH_DOCS = 1000  # documents per encode_batch call
BATCH_BYTES = 8 << 20  # ... or fewer, when their text passes this many bytes
COPY_BYTES = 16 << 20  # piece size when copying the token file out into the splits


def split_documents(docs: list[Document], val_fraction: float, seed: int) -> dict[str, list[Document]]:
    """The documents of each split (see `pipeline.data.split`)."""
    train, val = split_indices(len(docs), val_fraction, seed)
    return {"train": [docs[i] for i in train], "val": [docs[i] for i in val]}


def encode_documents(docs: list[Document], tok: GGUFTokenizer, add_bos: bool, add_eos: bool) -> np.ndarray:
    """All documents' ids concatenated, each wrapped in BOS/EOS as configured."""
    bos = tok.bos_id if add_bos else None
    eos = tok.eos_id if add_eos else None
    ids, _ = wrap_ids(tok.encode_batch([d.text for d in docs]), bos, eos, ids_dtype(tok.vocab_size))
    return ids


def wrap_ids(
    encoded: list[list[int]], bos: int | None, eos: int | None, dtype: np.dtype
) -> tuple[np.ndarray, np.ndarray]:
    """The documents' ids concatenated, each between BOS and EOS where given (vectorized, no per-token
    Python work), and each document's length in tokens."""
    lens = np.fromiter((len(x) for x in encoded), dtype=np.int64, count=len(encoded))
    flat = np.fromiter(chain.from_iterable(encoded), dtype=dtype, count=int(lens.sum()))
    extra = int(bos is not None) + int(eos is not None)
    if not extra:
        return flat, lens
    lens = lens + extra
    ends = np.cumsum(lens)
    out = np.empty(int(ends[-1]) if len(ends) else 0, dtype=dtype)
    body = np.ones(out.size, dtype=bool)
    if bos is not None:
        out[ends - lens] = bos
        body[ends - lens] = False
    if eos is not None:
        out[ends - 1] = eos
        body[ends - 1] = False
    out[body] = flat
    return out, lens


def resolve_add_bos(setting: str, tok: GGUFTokenizer) -> bool:
    """`auto` follows the GGUF's add_bos_token flag, as llama.cpp does."""
    return tok.add_bos if setting == "auto" else setting == "true"


def batches(docs: Iterable[Document]) -> Iterator[list[Document]]:
    """Documents in groups of `BATCH_DOCS`, fewer when their text passes `BATCH_BYTES`."""
    batch: list[Document] = []
    size = 0
    for d in docs:
        batch.append(d)
        size += len(d.text)
        if len(batch) >= BATCH_DOCS or size >= BATCH_BYTES:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


class Counts:
    """What pack learns while streaming: fingerprint, per-document token and byte lengths, distinct ids."""

    def __init__(self, vocab_size: int) -> None:
        self.hash = CorpusHash()
        self.tokens = array("q")
        self.bytes = array("q")
        self.seen = np.zeros(vocab_size, dtype=bool)
        self.total = 0

    def add(self, batch: list[Document], ids: np.ndarray, lens: np.ndarray) -> None:
        for d in batch:
            text = d.text.encode("utf-8")
            self.hash.update(d.name, text)
            self.bytes.append(len(text))
        self.tokens.extend(lens.tolist())
        self.seen[ids] = True
        self.total += int(ids.size)


def stream_tokens(
    docs: Iterable[Document], tok: GGUFTokenizer, bos: int | None, eos: int | None, out: BinaryIO, bar: Progress
) -> Counts:
    """Tokenize `docs` batch by batch into `out` (corpus order); batch k+1 tokenizes while k is written."""
    counts = Counts(tok.vocab_size)
    dtype = ids_dtype(tok.vocab_size).newbyteorder("<")
    with ThreadPoolExecutor(max_workers=1) as pool:
        pending: tuple[list[Document], Future] | None = None
        for batch in chain(batches(docs), [None]):
            ahead = (batch, pool.submit(tok.encode_batch, [d.text for d in batch])) if batch else None
            if pending is not None:
                done, future = pending
                ids, lens = wrap_ids(future.result(), bos, eos, dtype)
                out.write(ids.tobytes())
                counts.add(done, ids, lens)
                bar.note(f"{counts.total / max(bar.elapsed, 1e-9):,.0f} tok/s")
                bar.update(len(done))
            pending = ahead
    return counts


def copy_runs(
    files: list[Path], tmp: Path, val: np.ndarray, where: np.ndarray, start: np.ndarray, size: np.ndarray
) -> None:
    """`train.bin` / `val.bin` from token files in corpus order: document i's ids are `size[i]` bytes at
    `start[i]` of `files[where[i]]`. Each run of consecutive documents of one split that lie back to back
    in one file is copied in pieces of at most `COPY_BYTES`, so the corpus is never in memory."""
    brk = (np.diff(val.astype(np.int8)) != 0) | (np.diff(where) != 0) | (start[1:] != start[:-1] + size[:-1])
    change = np.flatnonzero(brk) + 1  # first document of each new run
    starts = np.concatenate([[0], change]).tolist()
    stops = np.concatenate([change, [len(val)]]).tolist()
    with ExitStack() as stack:
        srcs = [stack.enter_context(f.open("rb")) for f in files]
        dst = {s: stack.enter_context((tmp / f"{s}.bin").open("wb")) for s in SPLITS}
        for a, b in zip(starts, stops, strict=True):
            src, out = srcs[int(where[a])], dst["val" if val[a] else "train"]
            pos = int(start[a])
            src.seek(pos)
            left = int(start[b - 1] + size[b - 1]) - pos
            while left:
                piece = src.read(min(left, COPY_BYTES))
                if not piece:
                    raise DataError(problem(str(files[int(where[a])]), f"{left} more bytes", "end of file", REPACK))
                out.write(piece)
                left -= len(piece)


def peak_rss_mb() -> float:
    """This process's peak resident memory so far (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def tokenize_to(
    docs: Iterable[Document], tok: GGUFTokenizer, cfg: DataConfig, path: Path, progress: bool
) -> tuple[Counts, int | None, int | None]:
    """Every document's ids, wrapped as configured, appended to `path` in corpus order; (counts, bos, eos)."""
    bos = tok.bos_id if resolve_add_bos(cfg.add_bos, tok) else None
    eos = tok.eos_id if cfg.add_eos else None
    bar = Progress("pack", unit="doc", enabled=progress)
    with path.open("wb") as out, bar:
        return stream_tokens(docs, tok, bos, eos, out, bar), bos, eos


def split_meta(
    tok: GGUFTokenizer | dict, cfg: DataConfig, val: np.ndarray, tokens: np.ndarray, nbytes: np.ndarray, **facts
) -> PackMeta:
    """The meta of a running-text pack from its per-document counts and split; `tok` is the tokenizer or
    the facts a shard recorded of it (vocab_size, tokenizer_fingerprint); `facts`: corpus_sha256, bos_id,
    eos_id, distinct_tokens."""
    about = tok if isinstance(tok, dict) else {"vocab_size": tok.vocab_size, "tokenizer_fingerprint": tok.fingerprint()}
    side = {"train": ~val, "val": val}
    return PackMeta(
        vocab_size=about["vocab_size"],
        dtype=ids_dtype(about["vocab_size"]).name,
        tokenizer_fingerprint=about["tokenizer_fingerprint"],
        source=cfg.source,
        documents={s: int(side[s].sum()) for s in SPLITS},
        tokens={s: int(tokens[side[s]].sum()) for s in SPLITS},
        data=data_record(cfg),
        bytes={s: int(nbytes[side[s]].sum()) for s in SPLITS},
        **facts,
    )


def data_record(cfg: DataConfig) -> dict:
    """The data config as the packed meta records it: what was packed, without how (`HOW_KEYS`), and
    without the mixture keys when there is no mixture (so a 1-source meta is as it always was)."""
    record = {k: v for k, v in asdict(cfg).items() if k not in HOW_KEYS}
    if cfg.source != "mix":
        record.pop("sources", None)
        record.pop("mix_stop", None)
    return record


def pack_metrics(meta: PackMeta, elapsed: float) -> dict[str, float]:
    """The stage's metrics: counts, throughput and this process's peak memory."""
    n, total = sum(meta.documents.values()), sum(meta.tokens.values())
    return {
        "documents": float(n),
        **{f"documents_{s}": float(meta.documents[s]) for s in SPLITS},
        "tokens": float(total),
        **{f"tokens_{s}": float(meta.tokens[s]) for s in SPLITS},
        "distinct_tokens": float(meta.distinct_tokens),
        "seconds": elapsed,
        "tokens_per_second": total / max(elapsed, 1e-9),
        "documents_per_second": n / max(elapsed, 1e-9),
        "peak_rss_mb": peak_rss_mb(),
    }


def pack(
    docs: Iterable[Document], tok: GGUFTokenizer, cfg: DataConfig, out_dir: Path, progress: bool = False
) -> tuple[PackMeta, dict[str, float]]:
    """Tokenize, split and write `out_dir` atomically (streaming); returns the meta and the stage metrics."""
    start = time.perf_counter()
    dtype = ids_dtype(tok.vocab_size)
    with atomic_dir(out_dir) as tmp:
        all_tokens = tmp / "corpus-order.bin"
        counts, bos, eos = tokenize_to(docs, tok, cfg, all_tokens, progress)
        n = len(counts.tokens)
        if n < 2:
            raise too_few_documents(cfg, n)
        val = val_mask(n, cfg.val_fraction, cfg.split_seed)
        tokens, nbytes = (np.frombuffer(a, dtype=np.int64) for a in (counts.tokens, counts.bytes))
        size = tokens * dtype.itemsize
        copy_runs([all_tokens], tmp, val, np.zeros(n, dtype=np.int8), np.cumsum(size) - size, size)
        all_tokens.unlink()
        facts = {"corpus_sha256": counts.hash.hexdigest(), "bos_id": bos, "eos_id": eos}
        meta = split_meta(tok, cfg, val, tokens, nbytes, distinct_tokens=int(counts.seen.sum()), **facts)
        cap_val(tmp, meta, cfg.val_max_tokens)
        write_meta(tmp, meta)
    return meta, pack_metrics(meta, time.perf_counter() - start)
