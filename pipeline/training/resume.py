"""What a checkpoint saves and how a run resumes from one, so that it ends bit-identical to an
uninterrupted run: the loop state, weights, optimizer, sampler and every RNG; which settings a
checkpoint must share with the run that resumes it; and where this configuration's checkpoints
live. The on-disk format of a checkpoint directory is `pipeline.training.checkpoint`'s.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file
from torch import nn

from pipeline.config import OptimConfig, TrainConfig
from pipeline.data.packed import data_files
from pipeline.data.teacher_cache import META_FILE as TEACH_META
from pipeline.errors import ConfigError, problem
from pipeline.io.files import fingerprint
from pipeline.modeldir import MODEL_FILE, OPTIMIZER_FILE, model_config, weight_files, write_weights
from pipeline.models.devices import pick_device
from pipeline.models.transformer import TransformerConfig
from pipeline.training import checkpoint as ckpt
from pipeline.training import distributed as dist
from pipeline.training.checkpoint import LoopState
from pipeline.training.optim import freeze_table
from pipeline.training.runtime import bound_kernel_caches, keep_freed_memory
from pipeline.training.session import Session, trainable_names

# Settings that change the training trajectory: a checkpoint resumes only a run that agrees on all
# of them. Cadence (eval/log/checkpoint), threads, device, world size and the skip/checkpointing
# switches are left out: changing them on resume is legitimate (not always bit-exact).
TRAJECTORY_KEYS = ("steps", "batch_size", "seq_len", "grad_accum", "precision", "compile")
RNG_FILE = "rng.pt"
BEST_FILE = "best.safetensors"  # in a checkpoint: the best weights so far, when not the step's own


@dataclass
class CheckpointPlan:
    """Where this configuration's checkpoints live, what identifies it, and where to resume."""

    root: Path  # <checkpoint_dir>/<key>
    compat: dict[str, Any]
    resume: ckpt.Checkpoint | None = None
    keep: int = 2
    every: int = 0

    @property
    def run_id(self) -> str | None:
        return None if self.resume is None else self.resume.run_id


def compat_dict(
    model_cfg: TransformerConfig,
    tcfg: TrainConfig,
    optim: OptimConfig,
    seed: int,
    init_fp: str,
    data_fp: str,
    teacher_fp: str | None = None,
) -> dict[str, Any]:
    """What must match for a checkpoint to continue this run, as JSON values (the form it is saved in).

    With distillation on, its settings and the teacher (the teach stage's record) too, and QAT's with
    QAT on; with them off the dict is what it was before either existed, so older checkpoints still resume.
    """
    compat = {
        "model": asdict(model_cfg),
        "init_weights": init_fp,
        "data": data_fp,
        "seed": seed,
        "train": {k: getattr(tcfg, k) for k in TRAJECTORY_KEYS},
        "optim": asdict(optim),
    }
    if tcfg.distill.enabled:
        compat["distill"] = {**asdict(tcfg.distill), "teacher": teacher_fp}
    if tcfg.qat:  # another trajectory from qat_start on (a QAT run once resumed a plain run's last step)
        compat["qat"] = {"type": tcfg.qat, "start": tcfg.qat_start, "imatrix": tcfg.qat_imatrix}
    return json.loads(json.dumps(compat))


def plan_checkpoints(
    tcfg: TrainConfig,
    optim: OptimConfig,
    seed: int,
    init_dir: Path,
    packed_dir: Path,
    checkpoint_dir: Path,
    report: Callable[[str], None] | None = None,
    teach_dir: Path | None = None,
) -> CheckpointPlan:
    """The checkpoint directory of this configuration and the checkpoint to resume from, if any.

    `train.resume=auto`: the newest valid checkpoint of this configuration (corrupt ones are
    reported and skipped); `never`: none; a path: that checkpoint, which must have been made with
    this configuration (else a ConfigError naming the differing keys). `teach_dir`: the teach
    stage's output, whose record identifies the teacher of a distillation run.
    """
    data_fp = fingerprint(data_files(packed_dir))  # a named error when the pack stage has not run
    weights = weight_files(init_dir)
    if not weights:
        raise ConfigError(
            problem(str(init_dir), "initial weights (config.json + weights)", "no such files", "run: dvc repro realize")
        )
    teach_meta = None if teach_dir is None else Path(teach_dir) / TEACH_META
    teacher_fp = fingerprint([teach_meta]) if tcfg.distill.enabled and teach_meta and teach_meta.is_file() else None
    compat = compat_dict(model_config(init_dir), tcfg, optim, seed, fingerprint(weights), data_fp, teacher_fp)
    root = Path(checkpoint_dir) / ckpt.config_key(compat)
    plan = CheckpointPlan(root, compat, None, tcfg.keep_checkpoints, tcfg.checkpoint_every)
    if tcfg.resume == "auto":
        plan.resume = ckpt.newest_valid(plan.root, report)
    elif tcfg.resume != "never":
        plan.resume = _explicit(Path(tcfg.resume), compat, report)
    return plan


def _explicit(path: Path, compat: dict[str, Any], report: Callable[[str], None] | None) -> ckpt.Checkpoint:
    found = ckpt.resolve(path, report)
    diff = ckpt.differences(found.state.get("compat", {}), compat)
    if diff:
        raise ConfigError(
            problem(
                "config key train.resume",
                f"a checkpoint made with this configuration ({found.path})",
                "differences in " + "; ".join(diff),
                "resume with the configuration the checkpoint was made with, or use train.resume=auto|never",
            )
        )
    return found


def rng_states(device: torch.device) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(JSON-able python/numpy states, torch generator states) of this process."""
    py = random.getstate()
    npy = np.random.get_state(legacy=False)
    json_states = {
        "python": [py[0], list(py[1]), py[2]],
        "numpy": {**npy, "state": {"key": npy["state"]["key"].tolist(), "pos": int(npy["state"]["pos"])}},
    }
    tensors = {"torch": torch.get_rng_state()}
    if device.type == "cuda":
        tensors.update({f"cuda{i}": s for i, s in enumerate(torch.cuda.get_rng_state_all())})
    if device.type == "mps":
        tensors["mps"] = torch.mps.get_rng_state()
    return json_states, tensors


def set_rng_states(json_states: dict[str, Any], tensors: dict[str, torch.Tensor], device: torch.device) -> None:
    py = json_states["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    npy = json_states["numpy"]
    key = np.array(npy["state"]["key"], dtype=np.uint32)
    np.random.set_state({**npy, "state": {"key": key, "pos": npy["state"]["pos"]}})
    torch.set_rng_state(tensors["torch"])
    if device.type == "cuda":
        cuda = [tensors[k] for k in sorted(tensors) if k.startswith("cuda")]
        if cuda:
            torch.cuda.set_rng_state_all(cuda)
    if device.type == "mps" and "mps" in tensors:
        torch.mps.set_rng_state(tensors["mps"])


def save_checkpoint(
    plan: CheckpointPlan,
    state: LoopState,
    session: Session,
    sampler: Any,
    run_id: str | None,
    best: dict[str, torch.Tensor] | None = None,
) -> Path | None:
    """Every rank takes part (the FSDP gather); rank 0 writes. `state.step` names the checkpoint.
    `best`: the best weights so far when they are not this step's (train.keep_best)."""
    weights, optimizer_state = session.snapshot()
    path = None
    if session.info.is_main:
        json_rng, tensor_rng = rng_states(session.device)
        saved = {**asdict(state), "mlflow_run_id": run_id, "compat": plan.compat, "sampler": sampler.state()}

        def fill(d: Path) -> None:
            write_weights(d, session.model.cfg, weights)
            torch.save(optimizer_state, d / OPTIMIZER_FILE)
            torch.save(tensor_rng, d / RNG_FILE)
            if best is not None:
                write_weights(d, session.model.cfg, best, BEST_FILE)

        path = ckpt.write(plan.root, state.step, fill, {**saved, "rng": json_rng}, plan.keep)
    dist.barrier(session.info)
    return path


def load_weights(found: ckpt.Checkpoint, model: nn.Module) -> None:
    """A checkpoint's weights into the (still unwrapped) model: all of them, or a LoRA run's adapters."""
    state = load_file(str(found.path / MODEL_FILE))
    trainable = trainable_names(model)
    partial = set(state) == trainable and len(trainable) < len(model.state_dict())  # adapters only
    model.load_state_dict(state, strict=not partial)


def restore(found: ckpt.Checkpoint, session: Session, sampler: Any) -> LoopState:
    """Optimizer, sampler and RNG states from a checkpoint; returns its loop state."""
    session.load_optimizer(torch.load(found.path / OPTIMIZER_FILE, weights_only=True))
    sampler.set_state(found.state["sampler"])
    set_rng_states(found.state["rng"], torch.load(found.path / RNG_FILE, weights_only=True), session.device)
    return replace(LoopState.from_checkpoint(found.state), step=found.step)


def restore_best(found: ckpt.Checkpoint, state: LoopState, session: Session) -> dict[str, torch.Tensor] | None:
    """The best weights as of a checkpoint: its own (when it is the best step) or its best file."""
    if state.best_val_loss is None:
        return None
    if state.best_step == found.step:
        return session.weights()
    path = found.path / BEST_FILE
    return load_file(str(path)) if path.is_file() else None


def prepare_model(
    model: nn.Module, tcfg: TrainConfig, optim: OptimConfig, seed: int, plan: CheckpointPlan | None
) -> torch.device:
    """This process's device, threads, allocator and seed; the model on it (its token table frozen where
    `optim.table_lr_scale` is 0, resumed weights loaded)."""
    freeze_table(model, optim)
    if tcfg.threads > 0:
        torch.set_num_threads(tcfg.threads)
    info = dist.env_info()
    device = dist.rank_device(pick_device(tcfg.device), info)
    dist.setup(device)
    if device.type == "cpu":
        bound_kernel_caches()
        keep_freed_memory()
    torch.manual_seed(seed)
    resume = None if plan is None else plan.resume
    dist.check_same(0 if resume is None else resume.step, "the step training resumes at", info, device)
    if resume is not None:
        load_weights(resume, model)
    model.to(device).train()
    return device
