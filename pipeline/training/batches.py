"""Seeded batches for the loop, and the checks that the data can serve the batch shape asked for.

Token streams give random windows of `train.seq_len + 1` tokens; packed instruction rows give
epochs over the rows. Each sampler's whole future is its state (`state()` / `set_state()`), which
checkpoints carry. With a teacher cache (distillation), a window's batch also carries the cached
donor targets of its positions, gathered by the window's offset: the cache is fixed, so the
sampler's state still determines every batch.
"""

from __future__ import annotations

import logging
import math
from dataclasses import replace
from typing import Any

import numpy as np
import torch
from torch import nn

from pipeline.config import OptimConfig, TrainConfig
from pipeline.data.packed import Images, Packed, begin_with_bos, is_images, is_rows, n_items, window_bos
from pipeline.data.teacher_cache import TeacherCache
from pipeline.errors import ConfigError, DataError, problem
from pipeline.models.ops.losses import narrow_targets
from pipeline.training import distributed as dist

log = logging.getLogger(__name__)


class BatchSampler:
    """Random windows of `seq_len + 1` tokens from a memmapped split, from a seeded generator; with
    `whole=True` the data is windows laid end to end (the donor's continuations) drawn whole."""

    def __init__(self, data: np.ndarray, batch_size: int, seq_len: int, seed: int, whole: bool = False):
        self.data, self.batch_size, self.seq_len, self.whole = data, batch_size, seq_len, whole
        self.rng = np.random.default_rng(seed)
        self.starts = np.zeros(0, dtype=np.int64)  # the offsets of the last batch's windows

    def __call__(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.whole:
            n = len(self.data) // (self.seq_len + 1)
            starts = self.rng.integers(0, n, size=self.batch_size) * (self.seq_len + 1)
        else:
            starts = self.rng.integers(0, len(self.data) - self.seq_len - 1, size=self.batch_size, endpoint=True)
        self.starts = starts
        rows = np.stack([np.asarray(self.data[s : s + self.seq_len + 1], dtype=np.int64) for s in starts])
        t = torch.from_numpy(begin_with_bos(rows, window_bos(self.data)))
        return t[:, :-1], t[:, 1:]

    def state(self) -> dict[str, Any]:
        return self.rng.bit_generator.state

    def set_state(self, state: dict[str, Any]) -> None:
        self.rng.bit_generator.state = state


class DistillSampler:
    """A `BatchSampler`'s windows plus the cached donor targets of their positions: (x, y, ids,
    log-probs, tail), the targets narrowed to `top_k` (`pipeline.models.ops.losses.narrow_targets`)."""

    def __init__(self, windows: BatchSampler, cache: TeacherCache, top_k: int):
        self.windows, self.cache, self.top_k = windows, cache, top_k

    def __call__(self) -> tuple[torch.Tensor, ...]:
        x, y = self.windows()
        arrays = self.cache.gather(self.windows.starts, self.windows.seq_len)
        return x, y, *narrow_targets(*(torch.from_numpy(a) for a in arrays), self.top_k)

    def state(self) -> dict[str, Any]:
        return self.windows.state()

    def set_state(self, state: dict[str, Any]) -> None:
        self.windows.set_state(state)


class MixedSampler:
    """Distillation from a cache of spread spans (`train.distill.cache_tokens` under the train split's
    size): a `share` of the micro-batches are distillation windows drawn from the cached spans,
    evenly interleaved with plain windows drawn from the whole split. The student reads as much
    fresh text as it would without a budget, and each cached target is used about `share` x
    (micro-batches x batch x seq_len) / positions times; the step count is the whole state."""

    def __init__(self, plain: BatchSampler, distill: DistillSampler, share: float):
        self.plain, self.distill, self.share, self.calls = plain, distill, share, 0

    def __call__(self) -> tuple[torch.Tensor, ...]:
        i, self.calls = self.calls, self.calls + 1
        return self.distill() if math.floor((i + 1) * self.share) > math.floor(i * self.share) else self.plain()

    def state(self) -> dict[str, Any]:
        return {"plain": self.plain.state(), "distill": self.distill.state(), "calls": self.calls}

    def set_state(self, state: dict[str, Any]) -> None:
        self.plain.set_state(state["plain"])
        self.distill.set_state(state["distill"])
        self.calls = int(state["calls"])


def distill_share(positions: int, tcfg: TrainConfig) -> float:
    """The share of micro-batches that distil: `train.distill.share` when set, else the cached
    positions over the tokens the run reads (at most 1: a cache at least that large serves every
    batch). With weight 1 the data's own next token is no target at all, so every batch distils,
    reading the cache as often as it takes."""
    if tcfg.distill.weight >= 1.0:
        return 1.0
    if tcfg.distill.share > 0:
        return tcfg.distill.share
    return min(1.0, positions / (tcfg.steps * tcfg.grad_accum * tcfg.batch_size * tcfg.seq_len))


class RowSampler:
    """Batches of packed rows (x, labels, segment_ids), epoch by epoch: each epoch visits every row
    once in a fresh seeded order; a batch may straddle two epochs."""

    def __init__(self, packed: Packed | Images, batch_size: int, seed: int):
        self.packed, self.batch_size = packed, batch_size
        self.rng = np.random.default_rng(seed)
        self.order = self.rng.permutation(n_items(packed))
        self.drawn = 0  # rows handed out so far, over all epochs

    @property
    def rows(self) -> int:
        return n_items(self.packed)

    @property
    def epoch(self) -> float:
        """Epochs completed so far (fractional)."""
        return self.drawn / self.rows

    def picks(self) -> list[int]:
        """The next batch's row indices, in the epoch's seeded order."""
        picks = []
        for _ in range(self.batch_size):
            at = self.drawn % self.rows
            if at == 0 and self.drawn > 0:
                self.order = self.rng.permutation(self.rows)
            picks.append(int(self.order[at]))
            self.drawn += 1
        return picks

    def __call__(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        picks = self.picks()
        p = self.packed
        return (
            torch.from_numpy(p.input_ids[picks]),
            torch.from_numpy(p.labels[picks]),
            torch.from_numpy(p.segment_ids[picks].astype(np.int64)),
        )

    def state(self) -> dict[str, Any]:
        return {"rng": self.rng.bit_generator.state, "order": self.order.tolist(), "drawn": self.drawn}

    def set_state(self, state: dict[str, Any]) -> None:
        self.rng.bit_generator.state = state["rng"]
        self.order = np.asarray(state["order"], dtype=np.int64)
        self.drawn = int(state["drawn"])


class ImageSampler(RowSampler):
    """Batches of labelled images (pixels, labels), epoch by epoch as `RowSampler`'s rows."""

    def __call__(self) -> tuple[torch.Tensor, torch.Tensor]:
        picks = self.picks()
        return torch.from_numpy(self.packed.pixels[picks]), torch.from_numpy(self.packed.labels[picks])


def make_sampler(
    data: np.ndarray | Packed | Images, tcfg: TrainConfig, seed: int, teacher: object = None
) -> BatchSampler | DistillSampler | MixedSampler | RowSampler:
    """Seeded batches: random windows of a token stream (with their cached donor targets when
    `teacher` is a TeacherCache: all of them, or a share drawn from its spans), epochs over packed
    rows, or epochs over labelled images."""
    if is_images(data):
        return ImageSampler(data, tcfg.batch_size, seed)
    if is_rows(data):
        return RowSampler(data, tcfg.batch_size, seed)
    windows = BatchSampler(data, tcfg.batch_size, tcfg.seq_len, seed)
    if not isinstance(teacher, TeacherCache):
        return windows
    if teacher.tokens is None:
        return DistillSampler(windows, teacher, tcfg.distill.top_k)
    whole = teacher.meta.source == "donor"  # its continuations are one window each
    spans = BatchSampler(teacher.tokens, tcfg.batch_size, tcfg.seq_len, seed + 1, whole)
    return MixedSampler(
        windows, DistillSampler(spans, teacher, tcfg.distill.top_k), distill_share(len(spans.data), tcfg)
    )


def sequence_length(data: np.ndarray | Packed, tcfg: TrainConfig) -> int:
    """Positions per training row: train.seq_len for token streams, the packed row length for rows,
    1 for images (the loop's tokens per second are then images per second)."""
    if is_images(data):
        return 1
    return int(data.input_ids.shape[1]) if is_rows(data) else tcfg.seq_len


def check_split_fits(n_tokens: int, split: str, batch_size: int, seq_len: int) -> None:
    """A split must hold at least one window, and the batch must not exceed what is there."""
    if n_tokens < seq_len + 1:
        raise ConfigError(
            problem(
                "config key train.seq_len",
                f"at most {n_tokens - 1} (the {split} split has {n_tokens} tokens)",
                str(seq_len),
                "lower train.seq_len or pack a larger corpus",
            )
        )
    if split == "train" and batch_size * seq_len > n_tokens:
        raise ConfigError(
            problem(
                "config keys train.batch_size x train.seq_len",
                f"at most the {n_tokens} tokens of the train split",
                f"{batch_size} x {seq_len} = {batch_size * seq_len}",
                "lower the batch or sequence length, or pack a larger corpus",
            )
        )


def check_batches(model: nn.Module, train_data: Any, val_data: Any, tcfg: TrainConfig, optim: OptimConfig) -> None:
    """Everything about the batch shape and options that the data, model or job cannot serve."""
    if is_images(train_data):
        _check_images(model, train_data, tcfg)
        return
    length = sequence_length(train_data, tcfg)
    key = "data.max_seq_len" if is_rows(train_data) else "train.seq_len"
    if length > model.cfg.context_length:
        raise ConfigError(
            problem(
                f"config key {key}",
                f"at most the model's context_length={model.cfg.context_length}",
                str(length),
                f"lower {key}",
            )
        )
    if not is_rows(train_data):
        check_split_fits(len(train_data), "train", tcfg.batch_size, tcfg.seq_len)
        check_split_fits(len(val_data), "val", 1, tcfg.seq_len)
    elif len(train_data.input_ids) < tcfg.batch_size:
        raise ConfigError(
            problem(
                "config key train.batch_size",
                f"at most the {len(train_data.input_ids)} packed train rows (one batch must not repeat a row)",
                str(tcfg.batch_size),
                "lower train.batch_size, or add examples to the data",
            )
        )
    info = dist.env_info()
    dist.check_batch_divides(tcfg.batch_size, info)
    if info.is_main:
        warn_overfitting(train_data, tcfg)
    if optim.name == "lbfgs" and info.enabled and tcfg.parallel == "fsdp":
        raise ConfigError(
            problem("config key optim.name", "adamw with train.parallel=fsdp", "lbfgs", "use DDP or AdamW")
        )


def _check_images(model: nn.Module, train_data: Images, tcfg: TrainConfig) -> None:
    """Images of the model's shape, and a batch the train split can fill without repeating an image."""
    want = (model.cfg.channels, model.cfg.image_size, model.cfg.image_size)
    if tuple(train_data.pixels.shape[1:]) != want:
        raise ConfigError(
            problem(
                "packed images (data/packed)",
                f"(channels, height, width) = {want}, the model's",
                str(tuple(train_data.pixels.shape[1:])),
                "re-run realize after pack: dvc repro realize",
            )
        )
    if n_items(train_data) < tcfg.batch_size:
        raise ConfigError(
            problem(
                "config key train.batch_size",
                f"at most the {n_items(train_data)} train images",
                str(tcfg.batch_size),
                "lower train.batch_size, or add images",
            )
        )
    info = dist.env_info()
    dist.check_batch_divides(tcfg.batch_size, info)
    if info.is_main:
        warn_overfitting(train_data, tcfg)


def epochs_planned(train_data: Any, tcfg: TrainConfig) -> float:
    """How many times `train.steps` batches pass over the train split (rows or images, or tokens of windows)."""
    per_step = tcfg.batch_size * tcfg.grad_accum
    if is_rows(train_data) or is_images(train_data):
        return tcfg.steps * per_step / max(n_items(train_data), 1)
    return tcfg.steps * per_step * tcfg.seq_len / max(len(train_data), 1)


def steps_for_epochs(train_data: Any, tcfg: TrainConfig) -> int:
    """`train.epochs` passes over the train split as a step count (at least one step)."""
    per_pass = epochs_planned(train_data, replace(tcfg, steps=1))
    return max(1, math.ceil(tcfg.epochs / per_pass - 1e-9))


def warn_overfitting(train_data: Any, tcfg: TrainConfig) -> float:
    """Warn once when a small split will be seen so often that val loss likely rises (a 31k-token
    corpus gets 14 epochs at the default 400 x 8 x 128); returns the epochs."""
    epochs = epochs_planned(train_data, tcfg)
    if tcfg.max_epochs and epochs > tcfg.max_epochs:
        log.warning(
            f"warning: train.steps={tcfg.steps} pass over the train split {epochs:.1f} times (more than "
            f"train.max_epochs={tcfg.max_epochs:g}): expect val loss to rise as the model memorises it; "
            "use fewer train.steps or more data (train.max_epochs=0 silences this)"
        )
    return epochs


def check_distill(train_data: Any, tcfg: TrainConfig, teacher: object) -> None:
    """Distillation needs a token stream and the donor's targets for it: the cache of exactly this
    split, holding at least `train.distill.top_k` tokens per position, or the donor itself (online)."""
    d = tcfg.distill
    if not d.enabled:
        return
    if is_rows(train_data):
        raise ConfigError(
            problem(
                "config key train.distill.weight",
                "0 for instruction rows (distillation needs a token corpus)",
                str(d.weight),
                "set train.distill.weight=0, or distil on text data",
            )
        )
    if d.mode == "online":
        if not isinstance(teacher, nn.Module):
            raise ConfigError(problem("online distillation", "the donor model", type(teacher).__name__, "pass it"))
        return
    tcfg.check_distill_context()
    if not isinstance(teacher, TeacherCache):
        raise ConfigError(problem("cached distillation", "the teach stage's cache", type(teacher).__name__, "pass it"))
    spans, sequence = teacher.meta.spans, teacher.meta.sequence
    covered = sum(e - s for s, e in spans) if spans else len(train_data)
    if teacher.meta.source == "donor":  # one continuation of `sequence` tokens per prompt span
        covered = len(spans) * sequence
        if sequence != tcfg.seq_len + 1:
            fix = f"set train.seq_len={sequence - 1}, or re-run: dvc repro teach"
            found = f"train.seq_len={tcfg.seq_len}"
            raise ConfigError(
                problem(str(teacher.dir), f"continuations of train.seq_len={sequence - 1} + 1", found, fix)
            )
    if teacher.meta.positions != covered or (spans and spans[-1][1] > len(train_data)):
        raise DataError(
            problem(
                str(teacher.dir),
                f"a cache of the {len(train_data)} train positions" + (f" ({covered} in spans)" if spans else ""),
                f"{teacher.meta.positions} cached positions",
                "re-run: dvc repro teach",
            )
        )
    if d.top_k > teacher.meta.top_k:
        raise ConfigError(
            problem(
                "config key train.distill.top_k",
                f"at most {teacher.meta.top_k}, the k {teacher.dir} was cached with",
                str(d.top_k),
                f"lower it, or re-run teach with train.distill.top_k={d.top_k} (dvc repro teach)",
            )
        )
