"""The train stage: the realized model directory and the packed data in, the trained model
directory (weights, optimizer state, `train_state.json`) out, through the one training loop."""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch
from torch import nn

from pipeline.config import TrainConfig
from pipeline.data.packed import Images, PackMeta, load_data, load_meta
from pipeline.data.teacher_cache import TeacherCache
from pipeline.donor.load import load_donor
from pipeline.errors import ConfigError, problem
from pipeline.export.corpus_imatrix import IMATRIX_GGUF, ImatrixSource, corpus_imatrix
from pipeline.finetune.model import prepare_training
from pipeline.gguf.imatrix_format import Imatrix, write_imatrix
from pipeline.io.files import atomic_dir
from pipeline.modeldir import CONFIG_FILE, TrainState, is_finetune_dir, load_model_dir, read_spec, save_model_dir
from pipeline.models.devices import pick_device, resolve_precision, slow_bf16_reason
from pipeline.models.ops.head_rows import HeadVocab, corpus_vocabulary, wants_corpus_vocab, whole_vocabulary
from pipeline.training import distributed as dist
from pipeline.training.batches import steps_for_epochs
from pipeline.training.loop import Hooks, TrainJob, TrainResult, train
from pipeline.training.qat import use_imatrix
from pipeline.training.validation import validation_loss

log = logging.getLogger(__name__)


def sized(tcfg: TrainConfig, packed_dir: Path) -> TrainConfig:
    """`train.epochs` > 0 turns into the step count those passes over the train split take."""
    if tcfg.epochs <= 0:
        return tcfg
    steps = steps_for_epochs(load_data(packed_dir, "train"), tcfg)
    log.info(f"train: train.epochs={tcfg.epochs:g} passes over the train split = {steps} steps (train.steps ignored)")
    return replace(tcfg, steps=steps)


def with_precision(tcfg: TrainConfig) -> TrainConfig:
    """`train.precision=auto` made bf16 or fp32 for this machine's device, so that the checkpoints' key,
    the loop and the teacher agree on what ran."""
    device = pick_device(tcfg.device)
    mine = ran = resolve_precision(tcfg.precision, device)
    info = dist.env_info()
    if tcfg.precision == "auto" and info.enabled and device.type == "cpu":
        # each rank timed bf16 on its own: where the ratio sits near the threshold they could split, and
        # ranks training in different precisions drift apart; bf16 only where every rank picked it
        dist.setup(device)
        ran = "bf16" if dist.all_agree(mine == "bf16", info, device) else "fp32"
    if tcfg.precision == "auto":
        slow = "another rank found bf16 slow" if mine == "bf16" else slow_bf16_reason(device.type)
        why = "" if ran == "bf16" else f" ({slow})"
        log.info(f"train: precision auto = {ran} on this {device.type}{why}")
    return replace(tcfg, precision=ran)


@dataclass
class TrainInputs:
    """Where one execution of the train stage reads and writes (its settings are the loop's `TrainJob`)."""

    init_dir: Path  # the realized model directory
    packed_dir: Path  # the packed data
    out_dir: Path  # written by the main rank only
    teach_dir: Path | None = None  # the teacher with train.distill.mode=cached: the teach stage's cache
    donor: Path | None = None  # the teacher with train.distill.mode=online: the donor GGUF
    imatrix: ImatrixSource | None = None  # train.qat with export.imatrix: the matrix QAT and the export share


def run_train(inputs: TrainInputs, job: TrainJob, hooks: Hooks | None = None) -> TrainResult:
    """Train the model of `inputs.init_dir` on `inputs.packed_dir` as `job` says; write the trained model directory."""
    tcfg = with_precision(job.train)
    job = replace(job, train=tcfg)
    meta = load_meta(inputs.packed_dir)
    model, vocab = load_for_training(inputs.init_dir, meta, tcfg)
    imx = use_for_qat(model, inputs.imatrix) if inputs.imatrix is not None and tcfg.qat else None
    hooks = hooks or Hooks()
    bits = meta.bits_per_token("val")
    try:
        data = load_data(inputs.packed_dir, "train"), load_data(inputs.packed_dir, "val")
        teacher = load_teacher(tcfg, inputs.teach_dir, inputs.donor, vocab)
        model.head_vocab = head_vocabulary(tcfg, *data, teacher, vocab)
        result = train(model, *data, job, hooks, teacher, bits)
        if model.head_vocab is not None and result.weights is not None:
            whole_vocabulary_val_loss(model, result, data[1], tcfg)
    finally:
        dist.teardown(dist.env_info())
    if result.weights is None:
        return result
    state = TrainState(
        steps=result.steps,
        tokens_seen=result.tokens_seen,
        final_train_loss=result.final_train_loss,
        final_val_loss=result.final_val_loss,
        seq_len=tcfg.seq_len,
        batch_size=tcfg.batch_size,
        mlflow_run_id=hooks.run_id,
        resumed_from=result.resumed_from,
        skipped_steps=result.skipped_steps,
        checkpoint=result.checkpoint,
        world_size=dist.env_info().world_size,
        initial_val_loss=result.initial_val_loss,
        history=result.history,
        kept_step=result.kept_step,
        kept_val_loss=result.kept_val_loss,
        stopped_early=result.stopped_early,
    )
    spec = read_spec(inputs.init_dir) if is_finetune_dir(inputs.init_dir) else None
    with atomic_dir(inputs.out_dir) as tmp:
        save_model_dir(tmp, model, result.weights, spec, optimizer_state=result.optimizer_state, train_state=state)
        if imx is not None:
            write_imatrix(tmp / IMATRIX_GGUF, imx)
    return result


def head_vocabulary(tcfg: TrainConfig, train_data, val_data, teacher, vocab: int) -> HeadVocab | None:
    """Training's softmax rows (`train.vocab`): None for the whole vocabulary; else the ids the train and
    val splits and the teacher's cache hold, and `train.vocab_negatives` sampled others per step."""
    if not wants_corpus_vocab(tcfg.vocab, vocab) or isinstance(train_data, Images):
        return None
    if isinstance(teacher, nn.Module):  # an online teacher's top-k may fall anywhere in the vocabulary
        if tcfg.vocab == "corpus":
            raise ConfigError(
                problem("train.vocab", "full or auto with train.distill.mode=online", "corpus", "set train.vocab=auto")
            )
        log.warning("train: the whole vocabulary's softmax: an online teacher's top-k may fall anywhere in it")
        return None
    splits = [d if isinstance(d, np.ndarray) else d.input_ids.ravel() for d in (train_data, val_data)]
    teacher_ids = teacher.ids if isinstance(teacher, TeacherCache) else None
    used = corpus_vocabulary(splits, teacher_ids, vocab)
    hv = HeadVocab.of(used, vocab, tcfg.vocab_negatives)
    log.info(f"train: softmax over the {len(hv.ids):,} of {vocab:,} ids in use, +{hv.negatives:,} others a step")
    return hv


def whole_vocabulary_val_loss(model: nn.Module, result: TrainResult, val, tcfg: TrainConfig) -> None:
    """The kept weights' val loss over the whole vocabulary (training validated over the ids in use, a lower
    bound): what the train stage records, and what evaluate finds again in the export."""
    unexpected = model.load_state_dict(result.weights, strict=False).unexpected_keys  # a fine-tune's: adapters
    assert not unexpected, unexpected[:3]
    over_ids = result.kept_val_loss
    with whole_vocabulary(model):
        exact = validation_loss(model, val, tcfg.seq_len, tcfg.batch_size, next(model.parameters()).device)
    log.info(f"train: val loss of the weights kept {exact:.4f} over the whole vocabulary ({over_ids:.4f} over the ids)")
    if result.kept_step == result.steps:
        result.final_val_loss = exact
    result.kept_val_loss = exact


def use_for_qat(model: nn.Module, src: ImatrixSource) -> Imatrix:
    """train.qat with export.imatrix: the importance matrix of the model training starts from, which
    QAT's fake quant passes to ggml; the train directory keeps it and export takes that file, so the
    QAT target is exactly the exported file (recomputed identically on a resume)."""
    imx = corpus_imatrix(model, replace(src, reuse=None))
    use_imatrix(model, imx.weights())
    return imx


def load_for_training(init_dir: Path, meta: PackMeta, tcfg: TrainConfig) -> tuple[nn.Module, int]:
    """The model realize wrote, ready for this run's precision, and the size of its output that the packed
    data (`meta`) needs: its vocabulary, or its classes."""
    model = load_model_dir(init_dir)
    if is_finetune_dir(init_dir):
        prepare_training(model, read_spec(init_dir).mode, torch.bfloat16 if tcfg.precision == "bf16" else torch.float32)
    key = "n_classes" if meta.format == "images" else "vocab_size"
    vocab = getattr(meta, key)  # the size of the model's output: tokens, or classes
    if vocab != getattr(model.cfg, key):
        raise ConfigError(
            problem(
                str(Path(init_dir) / CONFIG_FILE),
                f"{key} {vocab} (packed data)",
                str(getattr(model.cfg, key)),
                "re-run realize after pack",
            )
        )
    return model, vocab


def load_teacher(
    tcfg: TrainConfig, teach_dir: Path | None, donor: Path | None, vocab: int
) -> TeacherCache | nn.Module | None:
    """What distillation learns from: the teach stage's cache, or the donor itself (online; with bf16
    weights when training runs in bf16, as the cache was made); None when distillation is off."""
    d = tcfg.distill
    if not d.enabled:
        return None
    if d.mode == "cached":
        return None if teach_dir is None else TeacherCache(teach_dir)
    if donor is None:
        return None  # the loop names what is missing
    model = load_donor(donor, vocab)
    return model.to(torch.bfloat16) if tcfg.precision == "bf16" else model
