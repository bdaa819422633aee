"""The teach stage: the donor's next-token distribution over the train split, cached once for
distillation (`pipeline.data.teacher_cache` is the format), and the donor's fp32 val loss and greedy
choices: the yardsticks evaluate reports every student against (as a model and as a draft).

The donor reads the train stream in overlapping windows of `train.distill.context` tokens that
advance by `context - train.seq_len`, and only the positions after the overlap are kept, so every
cached position (past the first window) sees at least `train.seq_len` tokens before it: as much
as a training window ever gives the student. It runs with bf16 weights (1.5-2.6x faster than
autocast over fp32 weights on this CPU; measured, see docs/distillation.md), the softmax in fp32.
With `train.distill.source=donor` it caches its own greedy continuations of train prompts instead
(`pipeline.distill.continuations`).

With distillation off (`train.distill.weight=0`) the stage only measures the donor on val (a few
seconds; none for instruction rows) and records `mode: off`; in online mode it records the
fingerprints and the donor's val figures but caches nothing. Instruction rows have no token stream
to cache: distillation on them is refused.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pipeline.config import TrainConfig
from pipeline.data.packed import PackMeta, begin_with_bos, data_files, load_meta, load_split, spread_spans, window_bos
from pipeline.data.teacher_cache import TOKENS_FILE, VAL_CHOICE_FILE, TeachMeta, create_arrays, write_meta
from pipeline.distill.continuations import build_continuations, sequences_for
from pipeline.donor.load import load_donor
from pipeline.errors import ConfigError, DataError, problem
from pipeline.io.files import atomic_dir, sha256_file
from pipeline.models.llama import Llama
from pipeline.models.ops.head_rows import corpus_vocabulary, wants_corpus_vocab
from pipeline.models.ops.losses import head_targets
from pipeline.models.registry import gguf_context_length
from pipeline.models.transformer import DecoderLM
from pipeline.progress import Progress
from pipeline.training.batches import check_split_fits
from pipeline.training.validation import scored_windows

log = logging.getLogger(__name__)
WINDOW_TOKENS = 2048  # donor tokens per forward: enough rows for the bf16 matmuls to run at speed
VAL_BATCH = 8  # windows per validation forward (the windows themselves are evaluate's)


def teacher_windows(n: int, context: int, seq_len: int) -> list[tuple[int, int, int]]:
    """(start, keep_from, end) of the donor's windows over `n` tokens: each window is tokens
    start..end-1 and keeps positions keep_from..end-1; the kept ranges tile 0..n-1 in order, and
    every kept position p past the first window has p - start >= seq_len tokens before it."""
    if n <= context:
        return [(0, 0, n)]
    windows, kept = [(0, 0, context)], context
    while kept < n:
        end = min(kept + context - seq_len, n)
        windows.append((end - context, kept, end))
        kept = end
    return windows


def cache_spans(n: int, budget: int, span: int) -> list[list[int]]:
    """The train positions the donor caches under `train.distill.cache_tokens`: spans of
    `train.distill.span` tokens spread over the split ([] = all of it)."""
    return spread_spans(n, budget, span)


def _groups(windows: list[tuple[int, int, int]], per_batch: int) -> Iterator[list[tuple[int, int, int]]]:
    for i in range(0, len(windows), per_batch):
        yield windows[i : i + per_batch]


def check_teach(tcfg: TrainConfig, meta: PackMeta, context_length: int) -> None:
    """What the donor and the packed data must allow for the configured distillation."""
    d = tcfg.distill
    limits = [("train.distill.top_k", d.top_k, meta.vocab_size, "the vocab size"), seq_len_limit(tcfg, context_length)]
    if d.mode == "cached":
        limits.append(("train.distill.context", d.context, context_length, "the donor's context_length"))
    check_limits(limits)
    tcfg.check_distill_context()


def seq_len_limit(tcfg: TrainConfig, context_length: int) -> tuple[str, int, int, str]:
    """The donor's val loss is measured over windows of train.seq_len: the donor must see that many."""
    return ("train.seq_len", tcfg.seq_len, context_length, "the donor's context_length")


def check_limits(limits: list[tuple[str, int, int, str]]) -> None:
    """Each (key, value, limit, what the limit is) with value > limit is a one-line ConfigError."""
    for key, value, limit, what in limits:
        if value > limit:
            fix = f"set {key}<={limit}"
            raise ConfigError(problem(f"config key {key}", f"at most {what}={limit}", str(value), fix))


@torch.no_grad()
def build_cache(
    model: DecoderLM,
    tokens: np.ndarray,
    arrays: tuple[np.ndarray, ...],
    tcfg: TrainConfig,
    device: torch.device,
    progress: bool = True,
    bos: int | None = None,
    rows: torch.Tensor | None = None,
) -> None:
    """Fill (ids, log-probs, tail) for every position of `tokens` with the donor's top-k; each of the
    donor's windows begins with `bos` when its tokenizer adds one (`pipeline.data.packed.TokenSplit`). With
    `rows` (ascending ids: train.vocab=corpus) the donor's distribution is over those ids alone,
    renormalised: its head costs their share of the vocabulary (Gemma 3: 6k of 262k rows on pydoc)."""
    d = tcfg.distill
    windows = teacher_windows(len(tokens), d.context, tcfg.seq_len)
    per_batch = max(1, WINDOW_TOKENS // d.context)
    ids_out, logp_out, tail_out = arrays
    weight = model.head_weight() if rows is None else model.head_weight().index_select(0, rows.to(device))
    with Progress("teach", total=len(tokens), unit="tok", enabled=progress) as bar:
        for group in _groups(windows, per_batch):
            batch = np.stack([np.asarray(tokens[s:e], dtype=np.int64) for s, _, e in group])
            x = torch.from_numpy(begin_with_bos(batch, bos)).to(device)
            h = model.hidden(x)
            states = torch.cat([h[i, keep - s :] for i, (s, keep, _) in enumerate(group)])
            ids, logp, tail = (t.cpu() for t in head_targets(states, weight, d.top_k))
            ids = (ids if rows is None else rows[ids]).numpy()
            logp, tail = logp.numpy(), tail.numpy()
            lo, hi = group[0][1], group[-1][2]
            ids_out[lo:hi], logp_out[lo:hi], tail_out[lo:hi] = ids, logp, tail
            bar.update(hi - lo)


def run_teach(
    donor: Path,
    donor_record: dict[str, Any],
    packed_dir: Path,
    out_dir: Path,
    tcfg: TrainConfig,
    device: torch.device,
    progress: bool = True,
    precision: str = "bf16",
) -> tuple[TeachMeta, dict[str, float]]:
    """Write `out_dir` (atomically): the meta, and the cache when distillation is on in cached mode."""
    start = time.perf_counter()
    pmeta = load_meta(packed_dir)
    meta = _new_meta(tcfg, pmeta, packed_dir, donor_record, precision)
    if meta.mode == "off":
        return meta, _record_off(donor, packed_dir, out_dir, tcfg, device, meta, pmeta, start)
    if pmeta.format != "tokens":
        raise DataError(
            problem(
                str(packed_dir),
                "a token corpus (train.bin) for distillation",
                f"instruction rows (data.source={pmeta.source})",
                "set train.distill.weight=0, or distil on text data",
            )
        )
    check_teach(tcfg, pmeta, gguf_context_length(donor))  # before the donor's weights load
    model = load_donor(donor, pmeta.vocab_size).to(device)
    choice = _measure_donor(model, packed_dir, tcfg.seq_len, device, meta)
    cache_start, top_k_mass = time.perf_counter(), None
    with atomic_dir(out_dir) as tmp:
        np.save(tmp / VAL_CHOICE_FILE, choice)
        if meta.cached:
            arrays = _cache(model, packed_dir, tmp, tcfg, meta, device, progress)
            for a in arrays:
                a.flush()
            top_k_mass = float(1.0 - np.exp(arrays[2].astype(np.float64)).mean())
            del arrays
        meta.seconds = time.perf_counter() - start
        write_meta(tmp, meta)
    return meta, _metrics(meta, time.perf_counter() - cache_start, top_k_mass)


def _cache(
    model: DecoderLM, packed_dir: Path, tmp: Path, tcfg: TrainConfig, meta: TeachMeta, device, progress: bool
) -> tuple[np.ndarray, ...]:
    """The cache's arrays (and tokens.npy when it covers spans or continuations), filled in `tmp`."""
    tokens, d = load_split(packed_dir, "train"), tcfg.distill
    bos = window_bos(tokens)
    if d.source == "donor":
        refuse_non_llama(model)
        meta.sequence = tcfg.seq_len + 1  # one training window each: the sampler draws them whole
        n = sequences_for(d.cache_tokens, len(tokens), meta.sequence)
        arrays = create_arrays(tmp, n * meta.sequence, meta.top_k, meta.vocab_size)
        text, meta.spans = build_continuations(
            model, tokens, n, d.prompt_tokens, meta.sequence, arrays, device, progress, meta.precision
        )
        np.save(tmp / TOKENS_FILE, text.astype(tokens.dtype))
        meta.positions = len(text)
        return arrays
    meta.spans = cache_spans(len(tokens), d.cache_tokens, d.span)
    if meta.spans:
        tokens = np.concatenate([tokens[s:e] for s, e in meta.spans])
        np.save(tmp / TOKENS_FILE, tokens)
    meta.positions = len(tokens)
    arrays = create_arrays(tmp, len(tokens), meta.top_k, meta.vocab_size)
    bf16 = model.to(torch.bfloat16) if meta.precision == "bf16" else model
    rows = corpus_rows(tcfg, packed_dir, meta)
    build_cache(bf16, tokens, arrays, tcfg, device, progress, bos, rows)
    return arrays


def corpus_rows(tcfg: TrainConfig, packed_dir: Path, meta: TeachMeta) -> torch.Tensor | None:
    """The ids the train and val splits use when training's softmax runs over them (train.vocab), so the
    donor's distribution is over the ids the student's is (recorded in `meta.vocab_rows`); else None."""
    if not wants_corpus_vocab(tcfg.vocab, meta.vocab_size):
        return None
    used = corpus_vocabulary([load_split(packed_dir, split) for split in ("train", "val")], None, meta.vocab_size)
    rows = torch.from_numpy(np.flatnonzero(used)).long()
    meta.vocab_rows = len(rows)
    log.info(f"teach: the donor's top-k over the {len(rows):,} of {meta.vocab_size:,} ids the splits use")
    return rows


def refuse_non_llama(model: DecoderLM) -> None:
    """The donor's continuations are decoded by the llama decoder (a KV cache, batched)."""
    if not isinstance(model, Llama):
        found = f"a {type(model).__name__} donor"
        raise ConfigError(problem("train.distill.source=donor", "a llama donor", found, "use source=corpus"))


def _record_off(
    donor: Path,
    packed_dir: Path,
    out_dir: Path,
    tcfg: TrainConfig,
    device: torch.device,
    meta: TeachMeta,
    pmeta: PackMeta,
    start: float,
) -> dict[str, float]:
    """Distillation off: the meta with the donor's val loss (token corpora only), no cache."""
    metrics, choice = {"cached_positions": 0.0}, None
    if pmeta.format == "tokens":
        check_limits([seq_len_limit(tcfg, gguf_context_length(donor))])  # before the donor's weights load
        model = load_donor(donor, pmeta.vocab_size).to(device)
        choice = _measure_donor(model, packed_dir, tcfg.seq_len, device, meta)
        metrics["donor_val_loss"] = float(meta.donor_val_loss)
    meta.seconds = time.perf_counter() - start
    with atomic_dir(out_dir) as tmp:
        if choice is not None:
            np.save(tmp / VAL_CHOICE_FILE, choice)
        write_meta(tmp, meta)
    return {**metrics, "seconds": meta.seconds}


def _new_meta(
    tcfg: TrainConfig, pmeta: PackMeta, packed_dir: Path, donor_record: dict[str, Any], precision: str
) -> TeachMeta:
    """The record's fingerprints and settings, before anything is measured or cached."""
    d = tcfg.distill
    return TeachMeta(
        mode="off" if not d.enabled else d.mode,
        top_k=d.top_k,
        context=d.context,
        seq_len=tcfg.seq_len,
        vocab_size=pmeta.vocab_size,
        positions=0,
        train_sha256=sha256_file(data_files(packed_dir)[1]),
        corpus_sha256=pmeta.corpus_sha256,
        tokenizer_fingerprint=pmeta.tokenizer_fingerprint,
        donor_sha256=donor_record["file"]["sha256"],
        donor_name=donor_record["file"]["name"],
        precision=precision,
        source=d.source if d.enabled and d.mode == "cached" else "corpus",
    )


def _measure_donor(
    model: DecoderLM, packed_dir: Path, seq_len: int, device: torch.device, meta: TeachMeta
) -> np.ndarray:
    """The donor's fp32 val loss over evaluate's windows (the weights are still fp32 here), into
    `meta`; returns its greedy choices there (a draft model's targets)."""
    val = load_split(packed_dir, "val")
    check_split_fits(len(val), "val", 1, seq_len)
    meta.donor_val_loss, choice = scored_windows(model, val, seq_len, VAL_BATCH, device)
    meta.donor_val_tokens = (len(val) - 1) // seq_len * seq_len
    meta.val_sha256 = sha256_file(data_files(packed_dir)[2])
    log.info(f"teach: donor val loss {meta.donor_val_loss:.4f} (fp32, windows of {seq_len})")
    return choice


def _metrics(meta: TeachMeta, cache_seconds: float, top_k_mass: float | None) -> dict[str, float]:
    metrics = {k: float(v) for k, v in asdict(meta).items() if k in ("positions", "donor_val_loss", "seconds")}
    metrics["donor_val_ppl"] = float(np.exp(meta.donor_val_loss))
    if top_k_mass is not None:
        metrics.update(
            cached_positions=float(meta.positions),
            cache_seconds=cache_seconds,
            cache_tokens_per_second=meta.positions / max(cache_seconds, 1e-9),
            top_k_mass=top_k_mass,  # the donor's mean probability on its own top-k
        )
    return metrics
