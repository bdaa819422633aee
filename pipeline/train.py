"""The one training loop every recipe uses.

AdamW (or L-BFGS) with linear warmup and cosine decay to a floor (optionally restarting), gradient
clipping and accumulation, bf16 autocast, seeded batch sampling from the packed memmap, and
validation in fp32 over the whole val split so the number is exactly reproducible by the evaluate
stage. Checkpoints (pipeline/checkpoint.py) hold everything the loop's future depends on, so a
resumed run ends bit-identical to an uninterrupted one. Under torchrun it trains data-parallel
(DDP) or sharded (FSDP) through pipeline/distributed.py. Tracking is a callback: this module
knows nothing of MLflow.
"""

from __future__ import annotations

import ctypes
import json
import math
import random
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from pipeline import checkpoint as ckpt
from pipeline import distributed as dist
from pipeline.config import OptimConfig, TrainConfig
from pipeline.errors import ConfigError, PipelineError, problem
from pipeline.model import Llama, TransformerConfig

LogFn = Callable[[dict[str, float], int], None]

# Settings that change the training trajectory: a checkpoint resumes only a run that agrees on all
# of them. Cadence (eval/log/checkpoint), threads, device, world size and the skip/checkpointing
# switches are left out: changing them on resume is legitimate (not always bit-exact).
TRAJECTORY_KEYS = ("steps", "batch_size", "seq_len", "grad_accum", "precision", "compile")


class NonFiniteError(PipelineError):
    """A step produced a NaN/inf loss or gradient; the run stops before applying it."""


class TrainingInterrupted(PipelineError):
    """SIGINT/SIGTERM: the step finished, a checkpoint was written, the run stops."""

    mlflow_status = "KILLED"

    def __init__(self, message: str, signum: int):
        super().__init__(message)
        self.exit_code = 128 + signum


def pick_device(name: str) -> torch.device:
    """`auto` prefers CUDA, then MPS, then CPU; a named device must be available here."""
    available = {"cpu": True, "cuda": torch.cuda.is_available(), "mps": torch.backends.mps.is_available()}
    if name == "auto":
        return torch.device(next(d for d in ("cuda", "mps", "cpu") if available[d]))
    if not available.get(name.split(":")[0], False):
        raise ConfigError(
            problem("config key train.device", "a device this machine has", f"{name} (unavailable)", "use auto or cpu")
        )
    return torch.device(name)


def keep_freed_memory() -> bool:
    """Serve large CPU tensors from the heap and keep freed memory for reuse (glibc's malloc).

    By default glibc maps every allocation above 32 MB fresh from the kernel and unmaps it when
    freed, so a step that allocates a 50 MB gradient pays ~20 ms of page faults for it, every
    step (~12% of a step of the benchmark model). Process-wide; the resident size then stays at
    its high-water mark. False where there is no glibc.
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    m_trim_threshold, m_mmap_max = -1, -4
    return bool(libc.mallopt(m_mmap_max, 0)) and bool(libc.mallopt(m_trim_threshold, 2**31 - 1))


def autocast(device: torch.device, precision: str):
    """bf16 autocast for matmuls (AMX/AVX512-BF16 on CPU, tensor cores on CUDA), or nothing for fp32."""
    if precision == "bf16":
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return nullcontext()


def lr_at(step: int, optim: OptimConfig, total_steps: int) -> float:
    """Linear warmup to `lr`, then cosine to `lr * min_lr_ratio` (restarting every `cycle_steps`)."""
    if step < optim.warmup_steps:
        return optim.lr * (step + 1) / optim.warmup_steps
    t = step - optim.warmup_steps
    if optim.cycle_steps > 0:
        progress = (t % optim.cycle_steps) / optim.cycle_steps
    else:
        progress = min(1.0, t / max(1, total_steps - optim.warmup_steps))
    floor = optim.lr * optim.min_lr_ratio
    return floor + (optim.lr - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


class BatchSampler:
    """Random windows of `seq_len + 1` tokens from a memmapped split, from a seeded generator.

    Its whole future is its generator state (`state()` / `set_state()`), which checkpoints carry.
    """

    def __init__(self, data: np.ndarray, batch_size: int, seq_len: int, seed: int):
        self.data, self.batch_size, self.seq_len = data, batch_size, seq_len
        self.rng = np.random.default_rng(seed)

    def __call__(self) -> tuple[torch.Tensor, torch.Tensor]:
        starts = self.rng.integers(0, len(self.data) - self.seq_len - 1, size=self.batch_size, endpoint=True)
        rows = np.stack([np.asarray(self.data[s : s + self.seq_len + 1], dtype=np.int64) for s in starts])
        t = torch.from_numpy(rows)
        return t[:, :-1], t[:, 1:]

    def state(self) -> dict[str, Any]:
        return self.rng.bit_generator.state

    def set_state(self, state: dict[str, Any]) -> None:
        self.rng.bit_generator.state = state


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


def is_rows(data: Any) -> bool:
    """Instruct data (packed rows with labels and segments) rather than a token stream."""
    return hasattr(data, "segment_ids")


def sequence_length(data: Any, tcfg: TrainConfig) -> int:
    """Positions per training row: train.seq_len for token streams, the packed row length for rows."""
    return int(data.input_ids.shape[1]) if is_rows(data) else tcfg.seq_len


def check_config(model: nn.Module, train_data: Any, val_data: Any, tcfg: TrainConfig, optim: OptimConfig) -> None:
    """Everything about the batch shape and options that the data, model or job cannot serve."""
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
    if tcfg.grad_accum < 1:
        raise ConfigError(
            problem("config key train.grad_accum", "an integer >= 1", str(tcfg.grad_accum), "use 1 for none")
        )
    if not is_rows(train_data):
        check_split_fits(len(train_data), "train", tcfg.batch_size, tcfg.seq_len)
        check_split_fits(len(val_data), "val", 1, tcfg.seq_len)
    info = dist.env_info()
    dist.check_batch_divides(tcfg.batch_size, info)
    if optim.name == "lbfgs" and info.enabled and tcfg.parallel == "fsdp":
        raise ConfigError(
            problem("config key optim.name", "adamw with train.parallel=fsdp", "lbfgs", "use DDP or AdamW")
        )


def make_sampler(data: Any, tcfg: TrainConfig, seed: int) -> Any:
    """Seeded batches: random windows of a token stream, or epochs over packed rows."""
    if is_rows(data):
        from pipeline.instruct import RowSampler

        return RowSampler(data, tcfg.batch_size, seed)
    return BatchSampler(data, tcfg.batch_size, tcfg.seq_len, seed)


def validation_loss(model: nn.Module, data: Any, seq_len: int, batch_size: int, device: torch.device) -> float:
    """The deterministic fp32 val loss: every window of `seq_len` of a token stream, or every labelled
    (response) position of packed rows. The train and evaluate stages both report this number."""
    if is_rows(data):
        from pipeline.instruct import response_nll

        return response_nll(model, data, batch_size, device)
    return evaluate_loss(model, data, seq_len, batch_size, device)


@torch.no_grad()
def evaluate_loss(model: Llama, data: np.ndarray, seq_len: int, batch_size: int, device: torch.device) -> float:
    """Token-weighted mean NLL over consecutive non-overlapping windows of the whole split, fp32.

    Deterministic (no sampling, no autocast) so the train stage's final number and the evaluate
    stage's number on the exported GGUF can be compared to 1e-3.
    """
    was_training = model.training
    model.eval()
    n = (len(data) - 1) // seq_len
    tokens = np.asarray(data[: n * seq_len + 1], dtype=np.int64)
    x_all = torch.from_numpy(tokens[:-1].reshape(n, seq_len))
    y_all = torch.from_numpy(tokens[1:].reshape(n, seq_len))
    total, count = 0.0, 0
    for i in range(0, n, batch_size):
        x, y = x_all[i : i + batch_size].to(device), y_all[i : i + batch_size].to(device)
        logits = model(x).float()
        total += torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="sum").item()
        count += y.numel()
    model.train(was_training)
    return total / count


def make_optimizer(model: nn.Module, optim: OptimConfig) -> torch.optim.Optimizer:
    """AdamW (decay on matrices only, fused where torch has it) or L-BFGS with a line search."""
    params = [p for p in model.parameters() if p.requires_grad]
    if optim.name == "lbfgs":
        return torch.optim.LBFGS(
            params,
            lr=optim.lr,
            history_size=optim.lbfgs_history,
            max_iter=optim.lbfgs_max_iter,
            line_search_fn="strong_wolfe",
        )
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": optim.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    kwargs = dict(lr=optim.lr, betas=(optim.beta1, optim.beta2), eps=optim.eps)
    try:
        return torch.optim.AdamW(groups, fused=True, **kwargs)
    except (RuntimeError, TypeError):
        return torch.optim.AdamW(groups, **kwargs)


def enable_activation_checkpointing(model: nn.Module) -> None:
    """Recompute each block's activations in backward instead of keeping them (any model with `blocks`).

    The block's `forward` is wrapped in place, so parameter names and checkpoints are unchanged;
    without gradients (validation, generation) blocks run as usual.
    """
    from torch.utils.checkpoint import checkpoint

    blocks = getattr(model, "blocks", None)
    if blocks is None:
        raise ConfigError(
            problem(
                "config key train.activation_checkpointing",
                "a model with transformer `blocks`",
                type(model).__name__,
                "set train.activation_checkpointing=false",
            )
        )
    for block in blocks:
        inner = block.forward

        def forward(*args, _inner=inner, **kwargs):
            if torch.is_grad_enabled():
                return checkpoint(_inner, *args, use_reentrant=False, **kwargs)
            return _inner(*args, **kwargs)

        block.forward = forward


def compile_blocks(model: nn.Module) -> None:
    """torch.compile each block in place (names unchanged); the chunked loss stays eager."""
    for block in getattr(model, "blocks", []):
        block.compile(dynamic=False)


class _Forward(nn.Module):
    """One module whose forward is the training loss (or logits without targets), so that DDP's and
    FSDP's forward hooks wrap exactly what a step runs."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None, *extra: torch.Tensor) -> torch.Tensor:
        """`extra`: what else the batch holds for the loss (instruct rows: segment ids)."""
        return self.model(idx) if targets is None else self.model.loss(idx, targets, *extra)


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

    @property
    def final_val_ppl(self) -> float:
        return math.exp(self.final_val_loss)


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
    model_cfg: TransformerConfig, tcfg: TrainConfig, optim: OptimConfig, seed: int, init_fp: str, data_fp: str
) -> dict[str, Any]:
    """What must match for a checkpoint to continue this run, as JSON values (the form it is saved in)."""
    compat = {
        "model": asdict(model_cfg),
        "init_weights": init_fp,
        "data": data_fp,
        "seed": seed,
        "train": {k: getattr(tcfg, k) for k in TRAJECTORY_KEYS},
        "optim": asdict(optim),
    }
    return json.loads(json.dumps(compat))


def plan_checkpoints(
    tcfg: TrainConfig,
    optim: OptimConfig,
    seed: int,
    init_dir: Path,
    packed_dir: Path,
    checkpoint_dir: Path,
    report: Callable[[str], None] | None = None,
) -> CheckpointPlan:
    """The checkpoint directory of this configuration and the checkpoint to resume from, if any.

    `train.resume=auto`: the newest valid checkpoint of this configuration (corrupt ones are
    reported and skipped); `never`: none; a path: that checkpoint, which must have been made with
    this configuration (else a ConfigError naming the differing keys).
    """
    from pipeline.finetune import weight_files
    from pipeline.pack import data_files

    init_dir, packed_dir = Path(init_dir), Path(packed_dir)
    data_fp = ckpt.fingerprint(data_files(packed_dir))  # a named error when the pack stage has not run
    weights = weight_files(init_dir)
    if not (init_dir / "config.json").is_file() or not weights:
        raise ConfigError(
            problem(str(init_dir), "initial weights (config.json + weights)", "no such files", "run: dvc repro realize")
        )
    model_cfg = TransformerConfig.load(init_dir / "config.json")
    init_fp = ckpt.fingerprint(weights)
    compat = compat_dict(model_cfg, tcfg, optim, seed, init_fp, data_fp)
    root = Path(checkpoint_dir) / ckpt.config_key(compat)
    plan = CheckpointPlan(root, compat, None, tcfg.keep_checkpoints, tcfg.checkpoint_every)
    if tcfg.resume == "auto":
        plan.resume = ckpt.newest_valid(root, report)
    elif tcfg.resume != "never":
        found = ckpt.resolve(Path(tcfg.resume), report)
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
        plan.resume = found
    return plan


@contextmanager
def stop_on_signals() -> Iterator[dict[str, int]]:
    """SIGINT/SIGTERM ask the loop to stop after the current step (it checkpoints first); a second
    signal interrupts at once. Yields a dict that holds `signum` once a stop was asked for."""
    asked: dict[str, int] = {}
    if threading.current_thread() is not threading.main_thread():
        yield asked
        return

    def handle(signum: int, frame: object) -> None:
        if asked:
            raise KeyboardInterrupt
        asked["signum"] = signum
        print(
            f"\n{signal.Signals(signum).name}: finishing this step, then writing a checkpoint (again to abort now)",
            file=sys.stderr,
        )

    previous = {s: signal.signal(s, handle) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield asked
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


def _named_optimizer_state(opt: torch.optim.Optimizer, names: dict[int, str]) -> dict[str, Any]:
    """`opt.state_dict()` keyed by parameter name instead of position (portable across wrappers)."""
    sd = opt.state_dict()
    by_index = {}
    for saved, group in zip(sd["param_groups"], opt.param_groups):
        by_index.update({i: names[id(p)] for i, p in zip(saved["params"], group["params"])})
    return {
        "state": {by_index[i]: s for i, s in sd["state"].items()},
        "param_groups": [{**g, "params": [by_index[i] for i in g["params"]]} for g in sd["param_groups"]],
    }


def _load_named_optimizer_state(opt: torch.optim.Optimizer, named: dict[str, Any], names: dict[int, str]) -> None:
    current = opt.state_dict()
    index = {}
    for saved, group in zip(current["param_groups"], opt.param_groups):
        index.update({names[id(p)]: i for i, p in zip(saved["params"], group["params"])})
    groups = [{**g, "params": c["params"]} for g, c in zip(named["param_groups"], current["param_groups"])]
    opt.load_state_dict({"state": {index[n]: s for n, s in named["state"].items()}, "param_groups": groups})


class _Session:
    """The state of one training process: model, wrappers, optimizer, sampler, counters."""

    def __init__(self, model: nn.Module, tcfg: TrainConfig, optim: OptimConfig, device: torch.device):
        self.model, self.tcfg, self.optim, self.device = model, tcfg, optim, device
        self.info = dist.env_info()
        self.fsdp = self.info.enabled and tcfg.parallel == "fsdp"
        self.module = dist.wrap(_Forward(model), tcfg.parallel, self.info, device)
        self.opt = make_optimizer(self.module, optim)
        self.names = {id(p): n for n, p in model.named_parameters()}
        self.eval_module = self.module if self.fsdp else model
        # a frozen base (LoRA) is re-read from its file: snapshots hold only what trains
        trainable = trainable_names(model)
        self.keep = None if len(trainable) == len(self.names) else trainable

    def snapshot(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """Full weights and name-keyed optimizer state on CPU (a collective under FSDP)."""
        if self.fsdp:
            from torch.distributed.checkpoint.state_dict import (
                StateDictOptions,
                get_model_state_dict,
                get_optimizer_state_dict,
            )

            opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
            weights = self._kept(_strip(get_model_state_dict(self.module, options=opts)))
            osd = get_optimizer_state_dict(self.module, self.opt, options=opts)
            if osd:
                osd = {
                    "state": _strip(osd["state"]),
                    "param_groups": [{**g, "params": [_unprefix(n) for n in g["params"]]} for g in osd["param_groups"]],
                }
            return weights, osd
        weights = {k: v.detach().cpu().contiguous() for k, v in self._kept(self.model.state_dict()).items()}
        return weights, _named_optimizer_state(self.opt, self.names)

    def _kept(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return state if self.keep is None else {k: v for k, v in state.items() if k in self.keep}

    def load_optimizer(self, named: dict[str, Any]) -> None:
        if self.fsdp:
            from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

            prefixed = {
                "state": {f"model.{k}": v for k, v in named["state"].items()},
                "param_groups": [{**g, "params": [f"model.{n}" for n in g["params"]]} for g in named["param_groups"]],
            }
            set_optimizer_state_dict(self.module, self.opt, prefixed, options=StateDictOptions(full_state_dict=True))
        else:
            _load_named_optimizer_state(self.opt, named, self.names)

    @contextmanager
    def grad_sync(self, enabled: bool) -> Iterator[None]:
        """Gradient all-reduce only on the last micro-batch of an accumulated step."""
        if not self.info.enabled or enabled:
            yield
        elif self.fsdp:
            self.module.set_requires_gradient_sync(False)
            try:
                yield
            finally:
                self.module.set_requires_gradient_sync(True)
        else:
            with self.module.no_sync():
                yield


def _unprefix(name: str) -> str:
    return name[len("model.") :] if name.startswith("model.") else name


def _strip(d: dict[str, Any]) -> dict[str, Any]:
    return {_unprefix(k): v for k, v in d.items()}


def _rng_states(device: torch.device) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
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


def _set_rng_states(json_states: dict[str, Any], tensors: dict[str, torch.Tensor], device: torch.device) -> None:
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


def _save_checkpoint(
    plan: CheckpointPlan,
    step: int,
    session: _Session,
    sampler: Any,
    extra: dict[str, Any],
) -> Path | None:
    """Every rank takes part (the FSDP gather); rank 0 writes."""
    weights, optimizer_state = session.snapshot()
    path = None
    if session.info.is_main:
        from safetensors.torch import save_file

        json_rng, tensor_rng = _rng_states(session.device)
        state = {**extra, "compat": plan.compat, "sampler": sampler.state(), "rng": json_rng}
        writers = {
            "model.safetensors": lambda p: save_file(weights, str(p)),
            "config.json": lambda p: p.write_text(session.model.cfg.to_json() + "\n"),
            "optimizer.pt": lambda p: torch.save(optimizer_state, p),
            "rng.pt": lambda p: torch.save(tensor_rng, p),
        }
        path = ckpt.write(plan.root, step, writers, state, plan.keep)
    dist.barrier(session.info)
    return path


def _load_checkpoint(found: ckpt.Checkpoint, model: nn.Module) -> None:
    """Weights into the (still unwrapped) model; the rest is restored once the optimizer exists."""
    from safetensors.torch import load_file

    state = load_file(str(found.path / "model.safetensors"))
    trainable = trainable_names(model)
    partial = set(state) == trainable and len(trainable) < len(model.state_dict())  # adapters only
    model.load_state_dict(state, strict=not partial)


def trainable_names(model: nn.Module) -> set[str]:
    """Names of the parameters that train (all of them, or a LoRA run's adapters)."""
    return {n for n, p in model.named_parameters() if p.requires_grad}


def _restore(found: ckpt.Checkpoint, session: _Session, sampler: Any, keys: list[str]) -> dict[str, Any]:
    """Optimizer, sampler and RNG states from a checkpoint; returns its loop counters (`keys`)."""
    session.load_optimizer(torch.load(found.path / "optimizer.pt", weights_only=True))
    sampler.set_state(found.state["sampler"])
    _set_rng_states(found.state["rng"], torch.load(found.path / "rng.pt", weights_only=True), session.device)
    return {k: found.state[k] for k in keys}


def _clip(params: list[nn.Parameter], max_norm: float) -> float:
    """Gradient norm before clipping (clipping only when max_norm > 0)."""
    grads = [p.grad for p in params if p.grad is not None]
    if max_norm > 0:
        norm = torch.nn.utils.clip_grad_norm_([p for p in params if p.grad is not None], max_norm)
    else:
        norm = torch.nn.utils.get_total_norm(grads)
    if hasattr(norm, "full_tensor"):  # FSDP: a sharded (DTensor) norm
        norm = norm.full_tensor()
    return float(norm)


def train(
    model: Llama,
    train_data: Any,
    val_data: Any,
    tcfg: TrainConfig,
    optim: OptimConfig,
    seed: int,
    log: LogFn | None = None,
    progress: bool = True,
    plan: CheckpointPlan | None = None,
    run_id: str | None = None,
    flush: Callable[[], None] | None = None,
) -> tuple[TrainResult, torch.optim.Optimizer]:
    """Train `model` in place for `tcfg.steps` optimizer steps; returns the result and optimizer.

    The data are token streams (np arrays: random windows of train.seq_len) or packed instruct rows
    (`pipeline.instruct.Packed`: epochs over the rows, response-only loss, segment-masked
    attention, an extra validation at step 0 and at the end of every epoch).

    With a `plan`, checkpoints every `train.checkpoint_every` steps and at the end, and continues
    from `plan.resume` if set. `flush` is called before each checkpoint so the tracker holds every
    metric up to it.
    """
    from tqdm.auto import tqdm

    log = log or (lambda metrics, step: None)
    flush = flush or (lambda: None)
    check_config(model, train_data, val_data, tcfg, optim)
    if tcfg.threads > 0:
        torch.set_num_threads(tcfg.threads)
    info = dist.env_info()
    device = dist.rank_device(pick_device(tcfg.device), info)
    dist.setup(device)
    if device.type == "cpu":
        keep_freed_memory()
    torch.manual_seed(seed)
    resume = plan.resume if plan is not None else None
    dist.check_same(0 if resume is None else resume.step, "the step training resumes at", info, device)
    if resume is not None:
        _load_checkpoint(resume, model)
    model.to(device).train()
    if tcfg.activation_checkpointing:
        enable_activation_checkpointing(model)
    if tcfg.compile:
        compile_blocks(model)
    session = _Session(model, tcfg, optim, device)
    opt = session.opt
    sampler = make_sampler(train_data, tcfg, seed)
    rows = is_rows(train_data)
    state: dict[str, Any] = {"history": [], "skipped_steps": 0, "seconds": 0.0, "initial_val_loss": None}
    if resume is not None:
        state = _restore(resume, session, sampler, list(state))
    elif plan is not None and tcfg.resume == "never" and info.is_main:
        ckpt.remove_newer(plan.root, 0)
    start_step = 0 if resume is None else resume.step
    history: list[dict[str, float]] = state["history"]
    tokens_per_step = tcfg.batch_size * sequence_length(train_data, tcfg) * tcfg.grad_accum
    params = [p for p in session.module.parameters() if p.requires_grad]
    started = time.perf_counter()
    last_checkpoint = None if resume is None else str(resume.path)
    loss_value = history[-1]["train_loss"] if history else float("nan")

    def validate() -> float:
        return validation_loss(session.eval_module, val_data, tcfg.seq_len, tcfg.batch_size, device)

    if rows and state["initial_val_loss"] is None:  # the base model's held-out loss, before any step
        state["initial_val_loss"] = validate()
        if info.is_main:
            log({"val_loss": state["initial_val_loss"], "val_ppl": math.exp(state["initial_val_loss"])}, 0)
    epoch_losses: list[float] = []

    def forward_backward(batches: list[tuple[torch.Tensor, ...]]) -> torch.Tensor:
        total = torch.zeros((), device=device)
        for i, batch in enumerate(batches):
            with session.grad_sync(i == len(batches) - 1), autocast(device, tcfg.precision):
                loss = session.module(*(t.to(device, non_blocking=True) for t in batch))
            (loss / len(batches)).backward()
            total += loss.detach().float()
        return dist.mean_across(total / len(batches), info)

    def checkpoint(done: int) -> str | None:
        flush()
        extra = {**state, "seconds": state["seconds"] + time.perf_counter() - started, "mlflow_run_id": run_id}
        path = _save_checkpoint(plan, done, session, sampler, extra)
        return None if path is None else str(path)

    bar = tqdm(
        total=tcfg.steps, initial=start_step, desc="train", disable=not (progress and info.is_main), dynamic_ncols=True
    )
    with stop_on_signals() as asked:
        for step in range(start_step, tcfg.steps):
            t0 = time.perf_counter()
            lr = lr_at(step, optim, tcfg.steps)
            for group in opt.param_groups:
                group["lr"] = lr
            epoch_before = int(sampler.epoch) if rows else 0
            batches = [tuple(dist.shard_rows(t, info) for t in sampler()) for _ in range(tcfg.grad_accum)]
            if optim.name == "lbfgs":
                loss_value, grad_norm = _lbfgs_step(opt, forward_backward, batches, params, optim.grad_clip)
                finite = math.isfinite(loss_value) and math.isfinite(grad_norm)
            else:
                loss_value = float(forward_backward(batches))
                grad_norm = _clip(params, optim.grad_clip)
                finite = math.isfinite(loss_value) and math.isfinite(grad_norm)
                if finite:
                    opt.step()
            opt.zero_grad(set_to_none=True)
            if not finite:
                if not tcfg.skip_nonfinite or optim.name == "lbfgs":
                    raise NonFiniteError(_nonfinite_message(step + 1, loss_value, grad_norm, last_checkpoint, optim))
                state["skipped_steps"] += 1
            dt = time.perf_counter() - t0
            row = {"train_loss": loss_value, "lr": lr, "grad_norm": grad_norm}
            row["tokens_per_second"] = tokens_per_step / dt
            if tcfg.skip_nonfinite:
                row["skipped_steps"] = float(state["skipped_steps"])
            done = step + 1
            epoch_end = False
            if rows:
                row["epoch"] = sampler.epoch
                epoch_losses.append(loss_value)
                epoch_end = int(sampler.epoch) > epoch_before
            if done % tcfg.eval_every == 0 or done == tcfg.steps or epoch_end:
                row["val_loss"] = validate()
                row["val_ppl"] = math.exp(row["val_loss"])
            if epoch_end:  # perplexity per epoch: the epoch's mean train loss and the val loss at its end
                row["epoch_train_ppl"] = math.exp(sum(epoch_losses) / len(epoch_losses))
                row["epoch_val_ppl"] = row["val_ppl"]
                epoch_losses = []
            if done % tcfg.log_every == 0 or "val_loss" in row or step == 0 or epoch_end:
                if info.is_main:
                    log(row, done)
                history.append({"step": done, **row})
            bar.update(1)
            bar.set_postfix(loss=f"{loss_value:.3f}", lr=f"{lr:.2e}")
            stop = dist.any_rank(bool(asked), info, device)
            every = plan is not None and plan.every > 0 and done % plan.every == 0
            if plan is not None and (every or done == tcfg.steps or stop):
                last_checkpoint = checkpoint(done)
            if stop:
                bar.close()
                raise _interrupted(asked.get("signum", signal.SIGTERM), done, last_checkpoint)
    bar.close()
    weights, optimizer_state = session.snapshot()
    final_val = history[-1]["val_loss"]
    result = TrainResult(
        steps=tcfg.steps,
        tokens_seen=tokens_per_step * tcfg.steps,
        final_train_loss=loss_value,
        final_val_loss=final_val,
        seconds=state["seconds"] + time.perf_counter() - started,
        history=history,
        resumed_from=start_step,
        skipped_steps=state["skipped_steps"],
        checkpoint=last_checkpoint,
        weights=weights if info.is_main else None,
        optimizer_state=optimizer_state if info.is_main else None,
        initial_val_loss=state["initial_val_loss"],
    )
    return result, opt


def _lbfgs_step(
    opt: torch.optim.Optimizer,
    forward_backward: Callable[[list], torch.Tensor],
    batches: list,
    params: list[nn.Parameter],
    grad_clip: float,
) -> tuple[float, float]:
    """One L-BFGS step on this step's batches; (loss before the step, its gradient norm)."""
    first: dict[str, float] = {}

    def closure() -> torch.Tensor:
        opt.zero_grad(set_to_none=True)
        loss = forward_backward(batches)
        norm = _clip(params, grad_clip)
        first.setdefault("norm", norm)
        return loss

    loss = opt.step(closure)
    return float(loss), first["norm"]


def _nonfinite_message(step: int, loss: float, grad_norm: float, last: str | None, optim: OptimConfig) -> str:
    kept = f"the last good checkpoint is {last}" if last else "no checkpoint was written yet"
    skip = "" if optim.name == "lbfgs" else ", or set train.skip_nonfinite=true to skip such steps"
    return problem(
        f"train step {step}",
        "a finite loss and gradient norm",
        f"loss={loss} grad_norm={grad_norm}",
        f"lower optim.lr or set optim.grad_clip{skip}; {kept} (train.resume=auto continues from it)",
    )


def _interrupted(signum: int, step: int, last: str | None) -> TrainingInterrupted:
    where = f"checkpoint {last}" if last else "no checkpoint (train.checkpoint_dir unset)"
    name = signal.Signals(signum).name
    return TrainingInterrupted(
        problem(
            f"train stopped by {name} after step {step}",
            "an uninterrupted run",
            f"a stop request; wrote {where}",
            "run again with train.resume=auto to continue",
        ),
        signum,
    )


def run_train(
    tcfg: TrainConfig,
    optim: OptimConfig,
    seed: int,
    init_dir: Path,
    packed_dir: Path,
    out_dir: Path,
    log: LogFn | None = None,
    run_id: str | None = None,
    plan: CheckpointPlan | None = None,
    flush: Callable[[], None] | None = None,
) -> TrainResult:
    """The train stage: initial weights + packed data in, final weights + optimizer state out.

    `plan` (from `plan_checkpoints`) turns on checkpointing and resume. Only the main rank writes.
    """
    from pipeline.atomic import atomic_dir
    from pipeline.finetune import is_finetune_dir, load_any, read_spec, save_finetuned
    from pipeline.pack import load_data, load_meta

    model = load_any(init_dir)
    meta = load_meta(packed_dir)
    if meta.vocab_size != model.cfg.vocab_size:
        raise ConfigError(
            problem(
                str(init_dir / "config.json"),
                f"vocab_size {meta.vocab_size} (packed data)",
                str(model.cfg.vocab_size),
                "re-run realize after pack",
            )
        )
    train_data, val_data = load_data(packed_dir, "train"), load_data(packed_dir, "val")
    try:
        result, _ = train(model, train_data, val_data, tcfg, optim, seed, log, plan=plan, run_id=run_id, flush=flush)
    finally:
        dist.teardown(dist.env_info())
    if result.weights is None:
        return result
    state = {
        "steps": result.steps,
        "tokens_seen": result.tokens_seen,
        "final_train_loss": result.final_train_loss,
        "final_val_loss": result.final_val_loss,
        "seq_len": tcfg.seq_len,
        "batch_size": tcfg.batch_size,
        "mlflow_run_id": run_id,
        "resumed_from": result.resumed_from,
        "skipped_steps": result.skipped_steps,
        "checkpoint": result.checkpoint,
        "world_size": dist.env_info().world_size,
        "initial_val_loss": result.initial_val_loss,
        "history": result.history,
    }
    from safetensors.torch import save_file

    with atomic_dir(out_dir) as tmp:
        if is_finetune_dir(init_dir):
            save_finetuned(model, read_spec(init_dir), tmp, result.weights)
        else:
            save_file(result.weights, str(tmp / "model.safetensors"))
            (tmp / "config.json").write_text(model.cfg.to_json() + "\n")
        torch.save(result.optimizer_state, tmp / "optimizer.pt")
        (tmp / "train_state.json").write_text(json.dumps(state, indent=2) + "\n")
    return result
