"""The one training loop every recipe uses.

Recipes differ only in what the model holds (what requires grad, how it was realized) and what
its `loss` adds; the loop is the same: a seeded batch, forward/backward under autocast
(accumulated, DDP/FSDP-synchronised), clipping, an AdamW or L-BFGS step on the schedule's LR,
fp32 validation, logging through a plain callback (this module knows nothing of MLflow), and
checkpoints from which a resumed run ends bit-identical to an uninterrupted one.
"""

from __future__ import annotations

import logging
import math
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch
from torch import nn

from pipeline.config import OptimConfig, TrainConfig
from pipeline.data.packed import Images, Packed, is_images, is_rows
from pipeline.data.teacher_cache import TeacherCache
from pipeline.errors import NonFiniteError
from pipeline.models.devices import resolve_precision, to_device
from pipeline.models.ops.head_rows import whole_vocabulary
from pipeline.models.ops.losses import IGNORE_INDEX
from pipeline.progress import Progress
from pipeline.training import checkpoint as ckpt
from pipeline.training import distributed as dist
from pipeline.training.batches import check_batches, check_distill, make_sampler, sequence_length
from pipeline.training.graphed import GraphedStep, wants_graphs
from pipeline.training.optim import (
    clip_gradients,
    gradient_norm,
    lbfgs_step,
    lr_at,
    nonfinite_message,
    set_lr,
)
from pipeline.training.qat import QuantSwap
from pipeline.training.queued import QueuedSteps, defers, nonfinite
from pipeline.training.resume import CheckpointPlan, LoopState, prepare_model, restore, restore_best, save_checkpoint
from pipeline.training.runtime import (
    HeapGuard,
    autocast,
    interrupted,
    speed_switches,
    stop_on_signals,
    trim_freed_memory,
)
from pipeline.training.session import Session
from pipeline.training.validation import validation_metrics

LogFn = Callable[[dict[str, float], int], None]
log = logging.getLogger(__name__)


def _ignore(*_: Any) -> None: ...


@dataclass
class Hooks:
    """Where the loop reports: `log(metrics, step)` (main rank only), `flush()` before each
    checkpoint so the tracker holds every metric up to it, and the run id checkpoints record."""

    log: LogFn = _ignore
    flush: Callable[[], None] = _ignore
    run_id: str | None = None


@dataclass
class TrainJob:
    """One training run's settings, as the train stage hands them to the loop (and tests and benchmarks
    build them): the train and optim config, the seed, the checkpoint plan, a progress display."""

    train: TrainConfig
    optim: OptimConfig
    seed: int
    plan: CheckpointPlan | None = None  # checkpoints and resume (`training.resume.plan_checkpoints`)
    progress: bool = True  # a progress display on the main rank (off for quiet/json output)


@dataclass
class TrainResult:
    steps: int
    tokens_seen: int
    final_train_loss: float
    final_val_loss: float
    seconds: float
    history: list[dict[str, float]] = field(default_factory=list)  # one row per logged step
    resumed_from: int = 0  # the step a checkpoint resumed at (0: a fresh start)
    skipped_steps: int = 0
    checkpoint: str | None = None  # the final checkpoint
    weights: dict[str, torch.Tensor] | None = field(default=None, repr=False)  # full, on the main rank
    optimizer_state: dict[str, Any] | None = field(default=None, repr=False)  # name-keyed, main rank
    initial_val_loss: float | None = None  # instruct rows: val loss before the first step (the base model's)
    kept_step: int = 0  # the step whose weights `weights` are (the best by val loss with train.keep_best)
    kept_val_loss: float = float("nan")  # their val loss
    stopped_early: bool = False  # train.early_stop_patience ended the run before train.steps

    @property
    def final_val_ppl(self) -> float:
        return math.exp(self.final_val_loss)


def train(
    model: nn.Module,
    train_data: np.ndarray | Packed | Images,
    val_data: np.ndarray | Packed | Images,
    job: TrainJob,
    hooks: Hooks | None = None,
    teacher: TeacherCache | nn.Module | None = None,
    val_bits_per_token: float | None = None,
) -> TrainResult:
    """Train `model` in place for `job.train.steps` optimizer steps.

    The data are token streams (random windows of train.seq_len), packed instruct rows (epochs
    over the rows, response-only loss, segment-masked attention, an extra validation at step 0 and
    at the end of every epoch) or labelled images (epochs over the images, cross-entropy of the
    class logits, validation also at the end of every epoch, with val_accuracy beside val_loss).
    With a `job.plan`, checkpoints every `train.checkpoint_every` steps and at the end, and continues
    from `plan.resume` if set. With `train.distill.weight` > 0,
    `teacher` is the donor's cached targets of `train_data` (cached mode) or the donor (online).
    `val_bits_per_token` turns each val loss (nats/token) into bits per byte, logged as `val_bpb` beside it.
    """
    tcfg = job.train
    check_batches(model, train_data, val_data, tcfg, job.optim)
    check_distill(train_data, tcfg, teacher)
    run = _Run(model, train_data, val_data, job, hooks or Hooks(), teacher, val_bits_per_token)
    if is_rows(train_data) and run.state.initial_val_loss is None:  # the base model's held-out loss, first
        with whole_vocabulary(model):  # what it is compared with at the end is too (`training.trainer`)
            run.state.initial_val_loss = run.validate()["val_loss"]
        run.log({"val_loss": run.state.initial_val_loss, "val_ppl": math.exp(run.state.initial_val_loss)}, 0)
    start = run.state.step
    bar = Progress("train", total=tcfg.steps, unit="steps", enabled=job.progress and run.info.is_main, initial=start)
    heap = HeapGuard() if run.device.type == "cpu" and is_rows(train_data) else None  # packed rows vary in size
    with stop_on_signals() as asked:
        for step in range(start, start if run.state.stopped_early else tcfg.steps):
            row, epoch_end = run.step(step)
            run.record(step, row, epoch_end)
            if heap is not None:
                heap.after_step()
            if isinstance(row["train_loss"], float):  # read already (a queued step's is read when logged)
                bar.note(f"loss={row['train_loss']:.3f}, lr={row['lr']:.2e}")
            bar.update(1)
            stop = run.stop_agreed(bool(asked))
            run.checkpoint_if_due(stop or run.state.stopped_early)
            if stop:
                bar.close()
                raise interrupted(asked.get("signum", signal.SIGTERM), run.state.step, run.last_checkpoint)
            if run.state.stopped_early:
                break
    bar.close()
    return run.result(start)


class _Run:
    """One call of `train`: the process set up, the session, the sampler and the loop state."""

    def __init__(self, model, train_data, val_data, job: TrainJob, hooks: Hooks, teacher, bits: float | None):
        tcfg, optim, seed, plan = job.train, job.optim, job.seed, job.plan
        self.tcfg, self.optim, self.hooks, self.plan, self.val_data = tcfg, optim, hooks, plan, val_data
        self.bits_per_token = bits  # val loss (nats/token) -> bits per byte
        self.device = prepare_model(model, tcfg, optim, seed, plan)  # the token table frozen here, once
        self.tcfg = tcfg = replace(tcfg, precision=resolve_precision(tcfg.precision, self.device))
        speed_switches(model, tcfg, self.device)
        donor = teacher if isinstance(teacher, nn.Module) and tcfg.distill.enabled else None
        self.session = Session(model, tcfg, optim, self.device, donor)
        self.info = self.session.info
        self.sampler = make_sampler(train_data, tcfg, seed, teacher if tcfg.distill.enabled else None)
        self.packed, self.images = is_rows(train_data), is_images(train_data)
        self.rows = self.packed or self.images  # epochs over items, not random windows
        self.tokens_per_step = tcfg.batch_size * sequence_length(train_data, tcfg) * tcfg.grad_accum
        resume = None if plan is None else plan.resume
        self.state = LoopState() if resume is None else restore(resume, self.session, self.sampler)
        self.best = None if resume is None or not tcfg.keep_best else restore_best(resume, self.state, self.session)
        if plan is not None and tcfg.resume in ("auto", "never") and self.info.is_main:
            # never: a fresh run supersedes this config's old checkpoints; auto: every step dir past the one
            # resumed is corrupt (reported), and left in place it would outrank, and prune, the new ones
            ckpt.remove_newer(plan.root, 0 if resume is None else resume.step)
        self.last_checkpoint = None if resume is None else str(resume.path)
        lbfgs = optim.name == "lbfgs"
        self.queue = None if lbfgs or not defers(self.device, self.session.opt, self.session.fsdp) else QueuedSteps()
        one = not self.info.enabled
        self.graphs = wants_graphs(tcfg, model, self.device, not self.rows, self.queue is not None, one)
        self.graph: GraphedStep | None = None
        self.qat = QuantSwap(model, tcfg.qat, int(tcfg.qat_start * tcfg.steps))
        self.started = time.perf_counter()

    def log(self, row: dict[str, float], step: int) -> None:
        if self.info.is_main:
            self.hooks.log(row, step)

    def stop_agreed(self, asked: bool) -> bool:
        """Whether every rank stops after this step, agreed by an all-reduce that waits for the device: a
        queued run under DDP votes only right after its figures were read (a stop asked in between takes
        effect at the next such step; every rank reads at the same steps)."""
        if self.info.enabled and self.queue is not None and self.queue.rows:
            return False
        return dist.any_rank(asked, self.info, self.device)

    def validate(self) -> dict[str, float]:
        """`val_loss` (and `val_accuracy` for images). On CPU the heap's free pages go back first: else
        validation's large blocks (fp32 logits) grow the fragmented heap past the step's own peak."""
        if self.device.type == "cpu":
            trim_freed_memory()
        module, t = self.session.eval_module, self.tcfg
        with self.qat.swapped(None):  # with train.qat, the weights the export will hold
            return validation_metrics(module, self.val_data, t.seq_len, t.batch_size, self.device)

    def step(self, step: int) -> tuple[dict[str, float], bool]:
        """One optimizer step on this step's (accumulated) batches; its log row, and whether an epoch ended."""
        t0 = time.perf_counter()
        opt, params = self.session.opt, self.session.params
        lr = lr_at(step, self.optim, self.tcfg.steps)
        set_lr(opt, lr)
        epoch_before = int(self.sampler.epoch) if self.rows else 0
        batches = [tuple(dist.shard_rows(t, self.info) for t in self.sampler()) for _ in range(self.tcfg.grad_accum)]
        if self.optim.name == "lbfgs":
            loss, grad_norm = lbfgs_step(opt, lambda: self._forward_backward(batches), params, self.optim.grad_clip)
        elif self.queue is not None:  # nothing read here: see `queued` (and `graphed`)
            with self.qat.swapped(step):
                loss, grad_norm, opt.found_inf = self._graphed(batches) if self.graphs else self._queued_step(batches)
            opt.step()
        else:
            with self.qat.swapped(step):  # train.qat: forward and backward on the export's weights
                loss = float(self._forward_backward(batches))
            grad_norm = clip_gradients(params, self.optim.grad_clip)
            if math.isfinite(loss) and math.isfinite(grad_norm):
                opt.step()
        if not self.graphs:  # a graph's backward writes the same gradient tensors every replay
            opt.zero_grad(set_to_none=True)
        row = {"train_loss": loss, **self.session.loss_parts(self.queue is None), "lr": lr, "grad_norm": grad_norm}
        if self.rows:
            row["epoch"] = self.sampler.epoch
        if self.queue is not None:
            self.queue.add(step, row)
        else:
            row["tokens_per_second"] = self.tokens_per_step / (time.perf_counter() - t0)
            self.check_read(step, row)
        return row, self.rows and int(self.sampler.epoch) > epoch_before

    def _queued_step(self, batches: list[tuple[torch.Tensor, ...]]) -> tuple[torch.Tensor, ...]:
        """Forward and backward, the clipped gradients' norm and the non-finite flag fused AdamW skips on:
        all left on the device."""
        loss = self._forward_backward(batches)
        grad_norm = gradient_norm(self.session.params, self.optim.grad_clip)
        return loss, grad_norm, nonfinite(loss, grad_norm)

    def _graphed(self, batches: list[tuple[torch.Tensor, ...]]) -> tuple[torch.Tensor, ...]:
        """`_queued_step` replayed as a CUDA graph, captured at the first step (`graphed`)."""
        if self.graph is None:
            self.graph = GraphedStep(self._queued_step, batches, self.session.params, self.device)
        return self.graph(batches)

    def check_read(self, step: int, row: dict[str, Any]) -> None:
        """A step whose figures are read: a non-finite one fails the run (or, with train.skip_nonfinite,
        counts as skipped: its update was not applied); the epoch's loss list grows."""
        loss, grad_norm = row["train_loss"], row["grad_norm"]
        if not (math.isfinite(loss) and math.isfinite(grad_norm)):
            if not self.tcfg.skip_nonfinite or self.optim.name == "lbfgs":
                raise NonFiniteError(nonfinite_message(step + 1, loss, grad_norm, self.last_checkpoint, self.optim))
            self.state.skipped_steps += 1
        if self.tcfg.skip_nonfinite:
            row["skipped_steps"] = float(self.state.skipped_steps)
        if self.rows:
            self.state.epoch_losses.append(loss)

    def read_queued(self) -> None:
        """Read the queued steps' figures (one wait for the device) and check each in order
        (`check_read`); the last one's tokens/s is over all of them."""
        if self.queue is None or not self.queue.rows:
            return
        rows, seconds = self.queue.read()
        for step, row in rows:
            self.check_read(step, row)
        rows[-1][1]["tokens_per_second"] = self.tokens_per_step * len(rows) / max(seconds, 1e-9)

    def _forward_backward(self, batches: list[tuple[torch.Tensor, ...]]) -> torch.Tensor:
        self.session.forward.parts.clear()  # an L-BFGS step may evaluate several times: keep the last
        total = torch.zeros((), device=self.device)
        cast = self.tcfg.precision
        for i, batch in enumerate(batches):
            with self.session.grad_sync(i == len(batches) - 1), autocast(self.device, cast, not self.graphs):
                loss = self.session.module(*self._placed(batch))
            loss = loss * self._rank_share(batch)
            (loss / len(batches)).backward()
            total += loss.detach().float()
        return dist.mean_across(total / len(batches), self.info)

    def _placed(self, batch: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        """A micro-batch as the model takes it. Inputs (and cached donor targets) go to the device; on CUDA a
        token batch's labels and a packed batch's segment ids stay on the host, where the model finds the
        positions that count without waiting for the queued kernels (`select_targets`, `PackedRows`)."""
        if self.device.type != "cuda" or self.images:
            return tuple(to_device(t, self.device) for t in batch)
        x, y, *extra = batch
        return (to_device(x, self.device), y, *(t if self.packed else to_device(t, self.device) for t in extra))

    def _rank_share(self, batch: tuple[torch.Tensor, ...]) -> torch.Tensor | float:
        """Instruct rows under DDP/FSDP: this rank's share of the micro-batch's labelled positions, times the
        world size, so that the ranks' averaged gradients (and losses) are the whole batch's token-weighted
        mean, as one process computes it, however the response tokens fall on the ranks; 1 otherwise."""
        if not (self.rows and self.info.enabled):
            return 1.0
        n = to_device((batch[1] != IGNORE_INDEX).sum().float(), self.device)  # counted on the host: no wait
        return n / dist.mean_across(n, self.info)

    def record(self, step: int, row: dict[str, float], epoch_end: bool) -> None:
        """Validation when due, per-epoch perplexity, the log and the history row of step `step`."""
        done = self.state.step = step + 1
        validating = done % self.tcfg.eval_every == 0 or done == self.tcfg.steps or epoch_end
        if validating or done % self.tcfg.log_every == 0 or step == 0:
            self.read_queued()
        if validating:
            row.update(self.validate())
            row["val_ppl"] = math.exp(row["val_loss"])
            if self.bits_per_token is not None:
                row["val_bpb"] = row["val_loss"] * self.bits_per_token
            self.track_best(done, row["val_loss"])
        if epoch_end:  # perplexity per epoch: the epoch's mean train loss and the val loss at its end
            losses = self.state.epoch_losses
            row["epoch_train_ppl"] = math.exp(sum(losses) / len(losses))
            row["epoch_val_ppl"] = row["val_ppl"]
            self.state.epoch_losses = []
        if done % self.tcfg.log_every == 0 or "val_loss" in row or step == 0 or epoch_end:
            self.log(row, done)
            self.state.history.append({"step": done, **row})
            if self.queue is not None:
                self.queue.restart_clock()

    def track_best(self, done: int, val_loss: float) -> None:
        """Remember the lowest val loss (and, with train.keep_best, its weights); with
        train.early_stop_patience, end the run after that many evaluations without a new best."""
        state = self.state
        if state.best_val_loss is None or val_loss < state.best_val_loss:
            state.best_val_loss, state.best_step, state.evals_since_best = val_loss, done, 0
            if self.tcfg.keep_best:
                self.best = self.session.weights()
            return
        state.evals_since_best += 1
        patience = self.tcfg.early_stop_patience
        if patience and state.evals_since_best >= patience and done < self.tcfg.steps:
            state.stopped_early = True
            if self.info.is_main:
                log.info(
                    f"train: early stop at step {done}: val loss {val_loss:.4f} has not beaten "
                    f"{state.best_val_loss:.4f} (step {state.best_step}) in {patience} evaluations "
                    "(train.early_stop_patience)"
                )

    def checkpoint_if_due(self, stop: bool) -> None:
        plan, done = self.plan, self.state.step
        if plan is None or not (stop or done == self.tcfg.steps or (plan.every > 0 and done % plan.every == 0)):
            return
        self.read_queued()  # a checkpoint holds no step whose figures were not read
        self.hooks.flush()
        best = self.best if self.best is not None and self.state.best_step != done else None
        state = replace(self.state, seconds=self.seconds())
        path = save_checkpoint(plan, state, self.session, self.sampler, self.hooks.run_id, best)
        self.last_checkpoint = None if path is None else str(path)

    def seconds(self) -> float:
        return self.state.seconds + time.perf_counter() - self.started

    def result(self, resumed_from: int) -> TrainResult:
        """The outcome; `weights` are the last step's, or the best step's with train.keep_best."""
        weights, optimizer_state = self.session.snapshot()
        history, state = self.state.history, self.state
        kept_step, kept_loss = state.step, history[-1]["val_loss"]
        if self.best is not None and state.best_step != state.step:
            weights, kept_step, kept_loss = self.best, state.best_step, state.best_val_loss
        main = self.info.is_main
        return TrainResult(
            steps=state.step,
            tokens_seen=self.tokens_per_step * state.step,
            kept_step=kept_step,
            kept_val_loss=kept_loss,
            stopped_early=state.stopped_early,
            final_train_loss=history[-1]["train_loss"] if history else float("nan"),
            final_val_loss=history[-1]["val_loss"],
            seconds=self.seconds(),
            history=history,
            resumed_from=resumed_from,
            skipped_steps=self.state.skipped_steps,
            checkpoint=self.last_checkpoint,
            weights=weights if main else None,
            optimizer_state=optimizer_state if main else None,
            initial_val_loss=self.state.initial_val_loss,
        )
