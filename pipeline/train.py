"""The one training loop every recipe uses.

AdamW with linear warmup and cosine decay to a floor (optionally restarting), gradient clipping
and accumulation, bf16 autocast, seeded batch sampling from the packed memmap, and validation in
fp32 over the whole val split so the number is exactly reproducible by the evaluate stage.
Tracking is a callback: this module knows nothing of MLflow.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch import nn

from pipeline.config import OptimConfig, TrainConfig
from pipeline.errors import ConfigError, problem
from pipeline.model import Llama

LogFn = Callable[[dict[str, float], int], None]


def pick_device(name: str) -> torch.device:
    """`auto` prefers CUDA, then MPS, then CPU."""
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        if torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    return torch.device(name)


def autocast(device: torch.device, precision: str):
    """bf16 autocast for matmuls (AMX on this CPU), or nothing for fp32."""
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
    """Random windows of `seq_len + 1` tokens from a memmapped split, from a seeded generator."""

    def __init__(self, data: np.ndarray, batch_size: int, seq_len: int, seed: int):
        self.data, self.batch_size, self.seq_len = data, batch_size, seq_len
        self.rng = np.random.default_rng(seed)

    def __call__(self) -> tuple[torch.Tensor, torch.Tensor]:
        starts = self.rng.integers(0, len(self.data) - self.seq_len - 1, size=self.batch_size, endpoint=True)
        rows = np.stack([np.asarray(self.data[s : s + self.seq_len + 1], dtype=np.int64) for s in starts])
        t = torch.from_numpy(rows)
        return t[:, :-1], t[:, 1:]


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
    """AdamW; weight decay on matrices only (not norms), fused where torch has it."""
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": optim.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    kwargs = dict(lr=optim.lr, betas=(optim.beta1, optim.beta2), eps=optim.eps)
    try:
        return torch.optim.AdamW(groups, fused=True, **kwargs)
    except (RuntimeError, TypeError):
        return torch.optim.AdamW(groups, **kwargs)


@dataclass
class TrainResult:
    steps: int
    tokens_seen: int
    final_train_loss: float
    final_val_loss: float
    seconds: float
    history: list[dict[str, float]] = field(default_factory=list)  # one row per logged step

    @property
    def final_val_ppl(self) -> float:
        return math.exp(self.final_val_loss)


def train(
    model: Llama,
    train_data: np.ndarray,
    val_data: np.ndarray,
    tcfg: TrainConfig,
    optim: OptimConfig,
    seed: int,
    log: LogFn | None = None,
    progress: bool = True,
) -> tuple[TrainResult, torch.optim.Optimizer]:
    """Train `model` in place for `tcfg.steps` optimizer steps; returns the result and optimizer."""
    from tqdm.auto import tqdm

    log = log or (lambda metrics, step: None)
    if tcfg.seq_len > model.cfg.context_length:
        raise ConfigError(
            problem(
                "config key train.seq_len",
                f"at most the model's context_length={model.cfg.context_length}",
                str(tcfg.seq_len),
                "lower train.seq_len",
            )
        )
    check_split_fits(len(train_data), "train", tcfg.batch_size, tcfg.seq_len)
    check_split_fits(len(val_data), "val", 1, tcfg.seq_len)
    if tcfg.threads > 0:
        torch.set_num_threads(tcfg.threads)
    device = pick_device(tcfg.device)
    torch.manual_seed(seed)
    model.to(device).train()
    opt = make_optimizer(model, optim)
    sampler = BatchSampler(train_data, tcfg.batch_size, tcfg.seq_len, seed)
    history: list[dict[str, float]] = []
    tokens_per_step = tcfg.batch_size * tcfg.seq_len * tcfg.grad_accum
    start = time.perf_counter()
    loss_value = float("nan")
    bar = tqdm(range(tcfg.steps), desc="train", disable=not progress, dynamic_ncols=True)
    for step in bar:
        t0 = time.perf_counter()
        lr = lr_at(step, optim, tcfg.steps)
        for group in opt.param_groups:
            group["lr"] = lr
        loss_sum = 0.0
        for _ in range(tcfg.grad_accum):
            x, y = sampler()
            with autocast(device, tcfg.precision):
                loss = model.loss(x.to(device), y.to(device))
            (loss / tcfg.grad_accum).backward()
            loss_sum += loss.item()
        loss_value = loss_sum / tcfg.grad_accum
        grad_norm = _clip(model, optim.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        dt = time.perf_counter() - t0
        row = {"train_loss": loss_value, "lr": lr, "grad_norm": grad_norm, "tokens_per_second": tokens_per_step / dt}
        last = step == tcfg.steps - 1
        if (step + 1) % tcfg.eval_every == 0 or last:
            row["val_loss"] = evaluate_loss(model, val_data, tcfg.seq_len, tcfg.batch_size, device)
            row["val_ppl"] = math.exp(row["val_loss"])
        if (step + 1) % tcfg.log_every == 0 or "val_loss" in row or step == 0:
            log(row, step + 1)
            history.append({"step": step + 1, **row})
        bar.set_postfix(loss=f"{loss_value:.3f}", lr=f"{lr:.2e}")
    bar.close()
    final_val = history[-1]["val_loss"]
    result = TrainResult(
        steps=tcfg.steps,
        tokens_seen=tokens_per_step * tcfg.steps,
        final_train_loss=loss_value,
        final_val_loss=final_val,
        seconds=time.perf_counter() - start,
        history=history,
    )
    return result, opt


def _clip(model: nn.Module, max_norm: float) -> float:
    """Gradient norm before clipping (clipping only when max_norm > 0)."""
    params = [p for p in model.parameters() if p.grad is not None]
    if max_norm > 0:
        return float(torch.nn.utils.clip_grad_norm_(params, max_norm))
    return float(torch.linalg.vector_norm(torch.stack([p.grad.detach().norm() for p in params])))


def save_optimizer(opt: torch.optim.Optimizer, path: Path) -> None:
    torch.save(opt.state_dict(), path)


def run_train(
    tcfg: TrainConfig,
    optim: OptimConfig,
    seed: int,
    init_dir: Path,
    packed_dir: Path,
    out_dir: Path,
    log: LogFn | None = None,
    run_id: str | None = None,
) -> TrainResult:
    """The train stage: initial weights + packed data in, final weights + optimizer state out."""
    import json

    from pipeline.atomic import atomic_dir
    from pipeline.pack import load_meta, load_split
    from pipeline.realize import load_model, save_model

    model = load_model(init_dir)
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
    result, opt = train(model, load_split(packed_dir, "train"), load_split(packed_dir, "val"), tcfg, optim, seed, log)
    state = {
        "steps": result.steps,
        "tokens_seen": result.tokens_seen,
        "final_train_loss": result.final_train_loss,
        "final_val_loss": result.final_val_loss,
        "seq_len": tcfg.seq_len,
        "batch_size": tcfg.batch_size,
        "mlflow_run_id": run_id,
    }
    with atomic_dir(out_dir) as tmp:
        save_model(model.cpu(), tmp)
        save_optimizer(opt, tmp / "optimizer.pt")
        (tmp / "train_state.json").write_text(json.dumps(state, indent=2) + "\n")
    return result
