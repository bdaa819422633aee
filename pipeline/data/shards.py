"""Packing one running-text corpus as N independent jobs (`data.num_shards`, `data.shard_index`), then
merging the shards into the one packed layout train reads (`data/packed/{train,val}.bin`).

Which documents a shard takes: the corpus's non-empty documents in their stable order, in blocks of
`SHARD_BLOCK`; block b goes to shard b mod N. Every job reads the whole source (reading is cheap, the
tokenizer is the cost) and tokenizes only its blocks into `<data.shard_dir>/shard-KKKKK-of-NNNNN/`:
`tokens.bin` (its documents' ids in corpus order), `documents.npy` (tokens and UTF-8 bytes of each),
`seen.npy` (the distinct ids, a bit each) and `shard.json` (the config fingerprint, tokenizer, counts).

The merge checks that every index 0..N-1 is there once and that all shards come from this config and
tokenizer, then puts the documents back in corpus order, applies the same seeded split as a 1-shard
pack (`pipeline.data.split.val_mask` over the total count) and copies them out in bounded pieces. So
`train.bin`, `val.bin` and every count equal a 1-shard pack of the same corpus; only `corpus_sha256`
differs: it is the sha256 of the shards' own fingerprints (the merge never sees the text).
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.config import DataConfig
from pipeline.data.corpus import Document, too_few_documents
from pipeline.data.packed import PackMeta, cap_val, ids_dtype, write_meta
from pipeline.data.split import val_mask
from pipeline.data.text import copy_runs, data_record, pack_metrics, peak_rss_mb, split_meta, tokenize_to
from pipeline.errors import ConfigError, DataError, problem
from pipeline.io.files import atomic_dir, write_json
from pipeline.io.records import field_problems
from pipeline.tokenizer.gguf_tokenizer import GGUFTokenizer

SHARD_BLOCK = 1000  # consecutive documents that go to one shard
SHARD_META = "shard.json"
FILES = ("tokens.bin", "documents.npy", "seen.npy", SHARD_META)


def shard_name(index: int, num_shards: int) -> str:
    return f"shard-{index:05d}-of-{num_shards:05d}"


def take_shard(docs: Iterable[Document], index: int, num_shards: int) -> Iterator[Document]:
    """The documents of shard `index`: blocks b of `SHARD_BLOCK` documents with b mod num_shards == index."""
    for pos, d in enumerate(docs):
        if (pos // SHARD_BLOCK) % num_shards == index:
            yield d


def config_fingerprint(cfg: DataConfig, tokenizer_fingerprint: str) -> str:
    """What makes shards belong together: the data config without the shard keys, and the tokenizer."""
    record = {"data": data_record(cfg), "num_shards": cfg.num_shards, "tokenizer": tokenizer_fingerprint}
    return hashlib.sha256(json.dumps(record, sort_keys=True).encode()).hexdigest()


def pack_shard(
    docs: Iterable[Document], tok: GGUFTokenizer, cfg: DataConfig, progress: bool = False
) -> tuple[Path, dict[str, float]]:
    """Tokenize this job's shard into `<shard_dir>/shard-KKKKK-of-NNNNN/` atomically; (its dir, metrics)."""
    start = time.perf_counter()
    out = Path(cfg.shard_dir) / shard_name(cfg.shard_index, cfg.num_shards)
    with atomic_dir(out) as tmp:
        counts, bos, eos = tokenize_to(
            take_shard(docs, cfg.shard_index, cfg.num_shards), tok, cfg, tmp / FILES[0], progress
        )
        per_doc = np.stack([np.frombuffer(a, dtype=np.int64) for a in (counts.tokens, counts.bytes)], axis=1)
        np.save(tmp / "documents.npy", per_doc)
        np.save(tmp / "seen.npy", np.packbits(counts.seen))
        fingerprint = tok.fingerprint()
        record = {
            "shard_index": cfg.shard_index,
            "num_shards": cfg.num_shards,
            "block": SHARD_BLOCK,
            "config_fingerprint": config_fingerprint(cfg, fingerprint),
            "tokenizer_fingerprint": fingerprint,
            "vocab_size": tok.vocab_size,
            "bos_id": bos,
            "eos_id": eos,
            "documents": len(per_doc),
            "tokens": counts.total,
            "corpus_sha256": counts.hash.hexdigest(),
            "seconds": time.perf_counter() - start,
        }
        write_json(tmp / SHARD_META, record)
    seconds = time.perf_counter() - start
    return out, {
        "shard_index": float(cfg.shard_index),
        "documents": float(len(per_doc)),
        "tokens": float(counts.total),
        "seconds": seconds,
        "tokens_per_second": counts.total / max(seconds, 1e-9),
        "documents_per_second": len(per_doc) / max(seconds, 1e-9),
        "peak_rss_mb": peak_rss_mb(),
    }


@dataclass
class _ShardRecord:
    """The keys of `shard.json` the merge reads (what `pack_shard` writes)."""

    shard_index: int
    num_shards: int
    config_fingerprint: str
    vocab_size: int
    documents: int
    tokens: int
    corpus_sha256: str
    seconds: float
    bos_id: int | None = None
    eos_id: int | None = None


@dataclass
class Shard:
    """One checked shard: its directory, its record and its per-document (tokens, bytes) table."""

    path: Path
    record: dict[str, Any]
    per_doc: np.ndarray


def read_shards(cfg: DataConfig, tokenizer_fingerprint: str) -> list[Shard]:
    """Every shard of this config, checked: present once each, complete, same fingerprint and tokenizer,
    files as `pack_shard` wrote them (a shard copied in part from another machine is named, not a crash)."""
    want = config_fingerprint(cfg, tokenizer_fingerprint)
    shards = []
    for k in range(cfg.num_shards):
        d = Path(cfg.shard_dir) / shard_name(k, cfg.num_shards)
        fix = _REDO.format(n=cfg.num_shards, k=k)
        meta = d / SHARD_META
        missing = [f for f in FILES if not (d / f).is_file()]
        if missing:
            found = "no shard directory" if not d.is_dir() else f"no {', '.join(missing)}"
            raise DataError(problem(str(meta) if d.is_dir() else str(d), f"shard {k} of {cfg.num_shards}", found, fix))
        try:
            record = json.loads(meta.read_text())
        except (OSError, ValueError) as e:
            raise DataError(problem(str(meta), "a shard record", f"unreadable ({e})"[:100], fix)) from None
        wrong = field_problems(record, _ShardRecord) if isinstance(record, dict) else [type(record).__name__]
        if wrong:
            raise DataError(problem(str(meta), "a shard record as pack writes it", "; ".join(wrong)[:200], fix))
        found = (record["shard_index"], record["num_shards"], record["config_fingerprint"])
        if found != (k, cfg.num_shards, want):
            what = "from another config or tokenizer" if found[2] != want else f"index {found[0]} of {found[1]}"
            raise DataError(problem(str(meta), f"shard {k} of {cfg.num_shards} packed with this config", what, fix))
        shards.append(Shard(d, record, _documents(d, record, fix)))
    return shards


_REDO = "re-run pack with data.num_shards={n} data.shard_index={k} (same config and donor), then merge again"


def _load(path: Path, fix: str) -> np.ndarray:
    try:
        return np.load(path, allow_pickle=False)
    except (OSError, ValueError, EOFError) as e:
        found = f"an unreadable or truncated file ({type(e).__name__})"
        raise DataError(problem(str(path), "a numpy array as pack writes it", found, fix)) from None


def _documents(d: Path, record: dict[str, Any], fix: str) -> np.ndarray:
    """The shard's documents.npy, checked against its record and the size of its tokens.bin."""
    per_doc = _load(d / "documents.npy", fix)
    n = record["documents"]
    if per_doc.dtype != np.int64 or per_doc.shape != (n, 2):
        found = f"{per_doc.dtype} of shape {per_doc.shape}"
        raise DataError(problem(str(d / "documents.npy"), f"int64 of shape ({n}, 2) (shard.json)", found, fix))
    size = int(per_doc[:, 0].sum()) * ids_dtype(record["vocab_size"]).itemsize
    if (d / FILES[0]).stat().st_size != size:
        found = f"{(d / FILES[0]).stat().st_size} bytes"
        raise DataError(problem(str(d / FILES[0]), f"{size} bytes (documents.npy)", found, fix))
    return per_doc


def merge_shards(cfg: DataConfig, tokenizer_fingerprint: str, out_dir: Path) -> tuple[PackMeta, dict[str, float]]:
    """The shards of `cfg` as one packed dir (`out_dir`, atomically), identical to a 1-shard pack but for
    `corpus_sha256`; returns its meta and metrics."""
    start = time.perf_counter()
    if cfg.num_shards < 2:
        raise ConfigError(
            problem(
                "config key data.num_shards", "the number of shard jobs (> 1) to merge", "1", "pass data.num_shards=N"
            )
        )
    shards = read_shards(cfg, tokenizer_fingerprint)
    first = shards[0].record
    per_doc = [s.per_doc for s in shards]
    n = sum(len(p) for p in per_doc)
    if n < 2:
        raise too_few_documents(cfg, n)
    where, local = corpus_order([len(p) for p in per_doc], cfg.num_shards)
    itemsize = ids_dtype(first["vocab_size"]).itemsize
    starts = [np.cumsum(p[:, 0] * itemsize) - p[:, 0] * itemsize for p in per_doc]
    tokens = np.empty(n, dtype=np.int64)
    nbytes = np.empty(n, dtype=np.int64)
    start_of = np.empty(n, dtype=np.int64)
    for k, p in enumerate(per_doc):
        mine = where == k
        tokens[mine], nbytes[mine], start_of[mine] = p[local[mine], 0], p[local[mine], 1], starts[k][local[mine]]
    del per_doc, starts, local  # what stays: about 30 bytes a document, never the ids
    val = val_mask(n, cfg.val_fraction, cfg.split_seed)
    seen = np.zeros(first["vocab_size"], dtype=bool)
    for k, s in enumerate(shards):
        seen |= _seen(s.path / "seen.npy", first["vocab_size"], _REDO.format(n=cfg.num_shards, k=k))
    sha = hashlib.sha256("".join(s.record["corpus_sha256"] for s in shards).encode()).hexdigest()
    with atomic_dir(out_dir) as tmp:
        copy_runs([s.path / FILES[0] for s in shards], tmp, val, where, start_of, tokens * itemsize)
        facts = {"corpus_sha256": sha, "bos_id": first["bos_id"], "eos_id": first["eos_id"]}
        meta = split_meta(
            first, cfg, val, tokens, nbytes, distinct_tokens=int(seen.sum()), shards=cfg.num_shards, **facts
        )
        cap_val(tmp, meta, cfg.val_max_tokens)
        write_meta(tmp, meta)
    metrics = pack_metrics(meta, time.perf_counter() - start)
    slowest = max(s.record["seconds"] for s in shards)  # the shard jobs ran side by side: the slowest is their wall
    wall = slowest + metrics["seconds"]
    metrics.update(
        shards=float(cfg.num_shards),
        shard_seconds_max=slowest,
        tokens_per_second=metrics["tokens"] / max(wall, 1e-9),
        documents_per_second=metrics["documents"] / max(wall, 1e-9),
    )
    return meta, metrics


def _seen(path: Path, vocab_size: int, fix: str) -> np.ndarray:
    """A shard's seen.npy (a bit per vocab id) as booleans."""
    bits = _load(path, fix)
    size = (vocab_size + 7) // 8
    if bits.dtype != np.uint8 or bits.shape != (size,):
        found = f"{bits.dtype} of shape {bits.shape}"
        raise DataError(problem(str(path), f"uint8 of shape ({size},) (a bit per vocab id)", found, fix))
    return np.unpackbits(bits, count=vocab_size).astype(bool)


def corpus_order(sizes: list[int], num_shards: int) -> tuple[np.ndarray, np.ndarray]:
    """For each document in corpus order: (its shard, its index in that shard), from the block rule."""
    n = sum(sizes)
    pos = np.arange(n, dtype=np.int64)
    block = pos // SHARD_BLOCK
    where = (block % num_shards).astype(np.int32)
    local = (block // num_shards) * SHARD_BLOCK + pos % SHARD_BLOCK
    got = np.bincount(where, minlength=num_shards)
    if got.tolist() != sizes:  # the shards' counts must be what one corpus of n documents gives
        raise DataError(
            problem(
                "the shards' documents.npy",
                f"counts {got.tolist()} of one corpus of {n} documents",
                f"{sizes}",
                "the shards come from different versions of the corpus: re-run every shard job",
            )
        )
    return where, local
