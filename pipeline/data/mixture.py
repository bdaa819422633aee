"""Several running-text sources mixed by weight in one pack (`data.source=mix`, `data.sources`).

What a weight means: the source's share of the pack's train tokens (weights are normalized by their
sum). The mixture streams: each source is read lazily and tokenized a batch at a time, and the next
train document always comes from the source furthest below its share (fewest train tokens per unit of
weight, ties to the first listed), so the shares hold at every point of the stream, within one
document, and the result is deterministic. `data.mix_stop` says when it ends:
- `first_exhausted` (the default, as in Hugging Face's `interleave_datasets`): when the first source has
  been read once; the others are down-sampled (only their first part is used);
- `all_exhausted`: when every source has been read once; the sources that run out before are read
  again from the start (up-sampled: repeated), so the tokens of the largest source per weight all count.
The split is per source document by a seeded hash of (data.split_seed, source index, document position),
val when below `data.val_fraction`; a repeated document keeps its side, so nothing leaks from train into
val, and val documents are written once (repeats add train tokens only). Sources with weight 0 are not
read. Memory: one tokenized batch per source.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import replace
from itertools import count
from pathlib import Path

import numpy as np

from pipeline.config import DataConfig
from pipeline.data.corpus import CorpusHash, Document, iter_documents
from pipeline.data.packed import SPLITS, PackMeta, cap_val, ids_dtype, write_meta
from pipeline.data.text import batches, data_record, pack_metrics, resolve_add_bos, wrap_ids
from pipeline.errors import DataError, PipelineError, problem
from pipeline.io.files import atomic_dir
from pipeline.progress import Progress
from pipeline.tokenizer.gguf_tokenizer import GGUFTokenizer

GOLDEN = 0x9E3779B97F4A7C15


def val_flags(seed: int, source: int, start: int, n: int, fraction: float) -> np.ndarray:
    """Whether documents start..start+n-1 of `source` go to val: a splitmix64 hash of (seed, source, position)
    as a number in [0, 1) below `fraction`. Per document, so no count of the corpus is needed."""
    with np.errstate(over="ignore"):
        x = np.arange(start, start + n, dtype=np.uint64) + np.uint64(((seed * 1_000_003 + source) * GOLDEN) % 2**64)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        x = x ^ (x >> np.uint64(31))
    return (x >> np.uint64(11)).astype(np.float64) / 2.0**53 < fraction


class Source:
    """One source of the mixture: its documents tokenized a batch at a time, with their side; `next` gives
    None at the end of a pass, and the next call starts another."""

    def __init__(self, index: int, cfg: DataConfig, tok: GGUFTokenizer, bos: int | None, eos: int | None) -> None:
        s = cfg.sources[index]
        self.index, self.key = index, f"data.sources[{index}]"
        self.cfg = replace(cfg, source=s.source, path=s.path, glob=s.glob, text_field=s.text_field, sources=[])
        self.tok, self.bos, self.eos, self.dtype = tok, bos, eos, ids_dtype(tok.vocab_size).newbyteorder("<")
        self.passes, self.read = 0, 0  # passes started; documents read in the first pass
        self.stats = {f"{what}_{s}": 0 for what in ("documents", "tokens", "bytes") for s in SPLITS}
        self._items: Iterator[tuple[Document, np.ndarray, bool]] | None = None

    def next(self) -> tuple[Document, np.ndarray, bool] | None:
        if self._items is None:
            self.passes += 1
            self._items = self._stream()
        item = next(self._items, None)
        if item is None:
            self._items = None
            if self.passes == 1 and self.read == 0:
                raise DataError(
                    problem(
                        f"{self.key} ({self.cfg.source} {self.cfg.path})".strip(), "documents", "none", "check its path"
                    )
                )
        return item

    def _stream(self) -> Iterator[tuple[Document, np.ndarray, bool]]:
        pos = 0
        try:
            for batch in batches(iter_documents(self.cfg)):
                ids, lens = wrap_ids(self.tok.encode_batch([d.text for d in batch]), self.bos, self.eos, self.dtype)
                ends = np.cumsum(lens).tolist()
                val = val_flags(self.cfg.split_seed, self.index, pos, len(batch), self.cfg.val_fraction).tolist()
                for j, d in enumerate(batch):
                    yield d, ids[ends[j] - int(lens[j]) : ends[j]], val[j]
                pos += len(batch)
                if self.passes == 1:
                    self.read = pos
        except PipelineError as e:  # name the mixture entry the file belongs to
            msg = str(e)
            raise type(e)(
                msg.replace("data.path", f"{self.key}.path") if "data.path" in msg else f"{self.key}: {msg}"
            ) from None


def pack_mixture(
    cfg: DataConfig, tok: GGUFTokenizer, out_dir: Path, progress: bool = False
) -> tuple[PackMeta, dict[str, float]]:
    """Mix `cfg.sources` by weight into `out_dir` (train.bin/val.bin written as they stream, atomically)."""
    start = time.perf_counter()
    bos, eos = (tok.bos_id if resolve_add_bos(cfg.add_bos, tok) else None), (tok.eos_id if cfg.add_eos else None)
    weights = np.array([s.weight for s in cfg.sources], dtype=np.float64) / sum(s.weight for s in cfg.sources)
    sources = [Source(i, cfg, tok, bos, eos) for i in range(len(cfg.sources))]
    active = [i for i, w in enumerate(weights) if w > 0]
    train = np.zeros(len(sources))
    done: set[int] = set()
    digest, seen = CorpusHash(), np.zeros(tok.vocab_size, dtype=bool)
    bar = Progress("pack mix", unit="doc", enabled=progress)
    with atomic_dir(out_dir) as tmp, (tmp / "train.bin").open("wb") as tr, (tmp / "val.bin").open("wb") as va, bar:
        for step in count():
            i = min(active, key=lambda j: (train[j] / weights[j], j))
            src = sources[i]
            item = src.next()
            if item is None:
                if not src.stats["tokens_train"]:
                    raise DataError(
                        problem(src.key, "train documents", "none (all went to val)", "lower data.val_fraction")
                    )
                done.add(i)
                if cfg.mix_stop == "first_exhausted" or done >= set(active):
                    break
                continue
            doc, ids, is_val = item
            if is_val and src.passes > 1:
                continue  # val documents once; a repeat only adds train tokens
            side = "val" if is_val else "train"
            (va if is_val else tr).write(ids.tobytes())
            text = doc.text.encode("utf-8")
            digest.update(f"{i}/{doc.name}", text)
            seen[ids] = True
            src.stats[f"documents_{side}"] += 1
            src.stats[f"tokens_{side}"] += int(ids.size)
            src.stats[f"bytes_{side}"] += len(text)
            train[i] += 0 if is_val else ids.size
            bar.update(1)
            if step % 1000 == 0:
                bar.note(f"{train.sum() / max(bar.elapsed, 1e-9):,.0f} train tok/s")
        meta = mixture_meta(cfg, tok, sources, digest.hexdigest(), bos, eos, int(seen.sum()))
        va.flush()
        cap_val(tmp, meta, cfg.val_max_tokens)
        write_meta(tmp, meta)
    metrics = pack_metrics(meta, time.perf_counter() - start)
    for k, s in enumerate(meta.sources or []):
        metrics.update({f"source{k}_{name}": float(v) for name, v in s.items() if isinstance(v, (int, float))})
    return meta, metrics


def mixture_meta(
    cfg: DataConfig,
    tok: GGUFTokenizer,
    sources: list[Source],
    sha: str,
    bos: int | None,
    eos: int | None,
    distinct: int,
) -> PackMeta:
    """The packed meta of a mixture, with each source's documents, tokens, bytes, train share and passes."""
    total = {
        f"{w}_{s}": sum(src.stats[f"{w}_{s}"] for src in sources)
        for w in ("documents", "tokens", "bytes")
        for s in SPLITS
    }
    for s in SPLITS:
        if not total[f"documents_{s}"]:
            raise DataError(
                problem(
                    "data.sources",
                    f"documents in both splits (a seeded {cfg.val_fraction:.0%} of each source to val)",
                    f"no {s} documents",
                    "raise data.val_fraction or use larger sources" if s == "val" else "lower data.val_fraction",
                )
            )
    per_source = [
        {
            **src.stats,
            "share": src.stats["tokens_train"] / total["tokens_train"],
            "weight": cfg.sources[src.index].weight,
            "passes": src.passes,
        }
        for src in sources
    ]
    return PackMeta(
        vocab_size=tok.vocab_size,
        dtype=ids_dtype(tok.vocab_size).name,
        tokenizer_fingerprint=tok.fingerprint(),
        corpus_sha256=sha,
        source="mix",
        bos_id=bos,
        eos_id=eos,
        documents={s: total[f"documents_{s}"] for s in SPLITS},
        tokens={s: total[f"tokens_{s}"] for s in SPLITS},
        distinct_tokens=distinct,
        data=data_record(cfg),
        bytes={s: total[f"bytes_{s}"] for s in SPLITS},
        sources=per_source,
    )
