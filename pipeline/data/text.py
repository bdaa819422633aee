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
from dataclasses import asdict
from itertools import chain
from pathlib import Path
from typing import BinaryIO

import numpy as np
from tqdm.auto import tqdm

from pipeline.config import DataConfig
from pipeline.data.corpus import CorpusHash, Document, too_few_documents
from pipeline.data.packed import SPLITS, PackMeta, ids_dtype, write_meta
from pipeline.data.split import split_indices, val_mask
from pipeline.files import atomic_dir
from pipeline.gguf.tokenizer import GGUFTokenizer

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
    docs: Iterable[Document], tok: GGUFTokenizer, bos: int | None, eos: int | None, out: BinaryIO, bar: tqdm
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
                bar.update(len(done))
                bar.set_postfix_str(f"{counts.total / max(bar.format_dict['elapsed'], 1e-9):,.0f} tok/s", refresh=False)
            pending = ahead
    return counts


def copy_out(all_tokens: Path, tmp: Path, val: np.ndarray, tokens: np.ndarray, itemsize: int) -> None:
    """`train.bin` / `val.bin` from the corpus-order token file: each run of consecutive documents of one
    split is copied in pieces of at most `COPY_BYTES`, so the corpus is never in memory."""
    ends = np.cumsum(tokens) * itemsize
    change = np.flatnonzero(np.diff(val.astype(np.int8))) + 1  # first document of each new run
    starts = np.concatenate([[0], change])
    stops = np.concatenate([change, [len(val)]])
    with all_tokens.open("rb") as src, (tmp / "train.bin").open("wb") as tr, (tmp / "val.bin").open("wb") as va:
        for a, b in zip(starts.tolist(), stops.tolist(), strict=True):
            dst = va if val[a] else tr
            pos = int(ends[a - 1]) if a else 0
            src.seek(pos)
            left = int(ends[b - 1]) - pos
            while left:
                piece = src.read(min(left, COPY_BYTES))
                dst.write(piece)
                left -= len(piece)


def peak_rss_mb() -> float:
    """This process's peak resident memory so far (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def pack(
    docs: Iterable[Document], tok: GGUFTokenizer, cfg: DataConfig, out_dir: Path, progress: bool = False
) -> tuple[PackMeta, dict[str, float]]:
    """Tokenize, split and write `out_dir` atomically (streaming); returns the meta and the stage metrics."""
    start = time.perf_counter()
    add_bos = resolve_add_bos(cfg.add_bos, tok)
    bos, eos = (tok.bos_id if add_bos else None), (tok.eos_id if cfg.add_eos else None)
    dtype = ids_dtype(tok.vocab_size)
    with atomic_dir(out_dir) as tmp:
        all_tokens = tmp / "corpus-order.bin"
        bar = tqdm(desc="pack", unit="doc", disable=not progress, dynamic_ncols=True)
        with all_tokens.open("wb") as out, bar:
            counts = stream_tokens(docs, tok, bos, eos, out, bar)
        n = len(counts.tokens)
        if n < 2:
            raise too_few_documents(cfg, n)
        val = val_mask(n, cfg.val_fraction, cfg.split_seed)
        tokens, nbytes = (np.frombuffer(a, dtype=np.int64) for a in (counts.tokens, counts.bytes))
        copy_out(all_tokens, tmp, val, tokens, dtype.itemsize)
        all_tokens.unlink()
        side = {"train": ~val, "val": val}
        meta = PackMeta(
            vocab_size=tok.vocab_size,
            dtype=dtype.name,
            tokenizer_fingerprint=tok.fingerprint(),
            corpus_sha256=counts.hash.hexdigest(),
            source=cfg.source,
            bos_id=bos,
            eos_id=eos,
            documents={s: int(side[s].sum()) for s in SPLITS},
            tokens={s: int(tokens[side[s]].sum()) for s in SPLITS},
            distinct_tokens=int(counts.seen.sum()),
            data=asdict(cfg),
            bytes={s: int(nbytes[side[s]].sum()) for s in SPLITS},
        )
        write_meta(tmp, meta)
    elapsed = time.perf_counter() - start
    metrics = {
        "documents": float(n),
        **{f"documents_{s}": float(meta.documents[s]) for s in SPLITS},
        "tokens": float(counts.total),
        **{f"tokens_{s}": float(meta.tokens[s]) for s in SPLITS},
        "distinct_tokens": float(meta.distinct_tokens),
        "seconds": elapsed,
        "tokens_per_second": counts.total / max(elapsed, 1e-9),
        "documents_per_second": n / max(elapsed, 1e-9),
        "peak_rss_mb": peak_rss_mb(),
    }
    return meta, metrics
