"""The optimizer side of a step: AdamW or L-BFGS, the learning-rate schedule, gradient clipping,
and optimizer state keyed by parameter name (portable across DDP/FSDP wrappers and resumes)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from pipeline.config import OptimConfig
from pipeline.errors import problem


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


def make_optimizer(model: nn.Module, optim: OptimConfig) -> torch.optim.Optimizer:
    """AdamW (decay on matrices only, fused where torch has it) or L-BFGS with a line search.

    Only parameters that require grad take part: a LoRA run's optimizer holds the adapters alone.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    if optim.name == "lbfgs":
        return torch.optim.LBFGS(
            params,
            lr=optim.lr,
            history_size=optim.lbfgs_history,
            max_iter=optim.lbfgs_max_iter,
            line_search_fn="strong_wolfe",
        )
    table = {id(p) for p in table_parameters(model)}
    decay = [p for p in params if p.ndim >= 2 and id(p) not in table]
    no_decay = [p for p in params if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": optim.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    scaled = [p for p in params if id(p) in table]
    if scaled:  # the token table (and an untied head) at its own rate
        groups.append({"params": scaled, "weight_decay": optim.weight_decay, "lr_scale": optim.table_lr_scale})
    kwargs = dict(lr=optim.lr, betas=(optim.beta1, optim.beta2), eps=optim.eps)
    try:
        return torch.optim.AdamW(groups, fused=True, **kwargs)
    except (RuntimeError, TypeError):
        return torch.optim.AdamW(groups, **kwargs)


def set_lr(opt: torch.optim.Optimizer, lr: float) -> None:
    for group in opt.param_groups:
        group["lr"] = lr * group.get("lr_scale", 1.0)


def table_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The token table and an untied output head: what `optim.table_lr_scale` applies to."""
    return [p for n, p in model.named_parameters() if n.split(".")[-2:] in (["tok_embd", "weight"], ["head", "weight"])]


def freeze_table(model: nn.Module, optim: OptimConfig) -> None:
    """`optim.table_lr_scale=0`: the table and head keep their initial weights and get no gradient (the
    tied head's weight gradient, a third of its matmuls, is not computed)."""
    if optim.table_lr_scale == 0:
        for p in table_parameters(model):
            p.requires_grad_(False)


def clip_gradients(params: list[nn.Parameter], max_norm: float) -> float:
    """Gradient norm before clipping (clipping only when max_norm > 0)."""
    return float(gradient_norm(params, max_norm))


def gradient_norm(params: list[nn.Parameter], max_norm: float) -> torch.Tensor:
    """`clip_gradients` without reading the norm: a tensor on the gradients' device (nothing waits)."""
    grads = [p.grad for p in params if p.grad is not None]
    if max_norm > 0:
        norm = torch.nn.utils.clip_grad_norm_([p for p in params if p.grad is not None], max_norm)
    else:
        norm = torch.nn.utils.get_total_norm(grads)
    if hasattr(norm, "full_tensor"):  # FSDP: a sharded (DTensor) norm
        norm = norm.full_tensor()
    return norm


def lbfgs_step(
    opt: torch.optim.Optimizer,
    forward_backward: Callable[[], torch.Tensor],
    params: list[nn.Parameter],
    grad_clip: float,
) -> tuple[float, float]:
    """One L-BFGS step (its line search re-evaluates the same batches); (loss before it, its gradient norm)."""
    first: dict[str, float] = {}

    def closure() -> torch.Tensor:
        opt.zero_grad(set_to_none=True)
        loss = forward_backward()
        first.setdefault("norm", clip_gradients(params, grad_clip))
        return loss

    loss = opt.step(closure)
    return float(loss), first["norm"]


def nonfinite_message(step: int, loss: float, grad_norm: float, last: str | None, optim: OptimConfig) -> str:
    kept = f"the last good checkpoint is {last}" if last else "no checkpoint was written yet"
    skip = "" if optim.name == "lbfgs" else ", or set train.skip_nonfinite=true to skip such steps"
    return problem(
        f"train step {step}",
        "a finite loss and gradient norm",
        f"loss={loss} grad_norm={grad_norm}",
        f"lower optim.lr or set optim.grad_clip{skip}; {kept} (train.resume=auto continues from it)",
    )


def named_optimizer_state(opt: torch.optim.Optimizer, names: dict[int, str]) -> dict[str, Any]:
    """`opt.state_dict()` keyed by parameter name instead of position (portable across wrappers)."""
    sd = opt.state_dict()
    by_index = {}
    for saved, group in zip(sd["param_groups"], opt.param_groups):
        by_index.update({i: names[id(p)] for i, p in zip(saved["params"], group["params"])})
    return {
        "state": {by_index[i]: s for i, s in sd["state"].items()},
        "param_groups": [{**g, "params": [by_index[i] for i in g["params"]]} for g in sd["param_groups"]],
    }


def load_named_optimizer_state(opt: torch.optim.Optimizer, named: dict[str, Any], names: dict[int, str]) -> None:
    current = opt.state_dict()
    index = {}
    for saved, group in zip(current["param_groups"], opt.param_groups):
        index.update({names[id(p)]: i for i, p in zip(saved["params"], group["params"])})
    groups = [{**g, "params": c["params"]} for g, c in zip(named["param_groups"], current["param_groups"])]
    opt.load_state_dict({"state": {index[n]: s for n, s in named["state"].items()}, "param_groups": groups})
