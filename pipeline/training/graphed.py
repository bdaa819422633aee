"""A training step's forward and backward replayed as one CUDA graph (`train.cuda_graph`).

At small shapes a GPU step is launch-bound: the default 8 x 128 run is ~1700 kernels a step, and
launching them from Python took longer than running them (an H100 trained it at 46k tokens/s). Token
windows have the same shapes every step, so the step's forward, backward, gradient clipping and
non-finite check are captured once, on static batch tensors, and replayed as one launch; each step
copies its batch into those tensors first. Compiled blocks (`train.compile`) are captured with the rest: they
compile in the warm-up steps before the capture. The optimizer's
step stays outside the graph: fused AdamW is a few launches, and its learning rate changes every step.

The captured backward assigns the gradients (they were None at capture), so they are never zeroed
between replays; the outputs (loss, gradient norm, the non-finite flag) are overwritten by the next
replay, so each step gets copies. Packed rows (their token count varies), several processes, checkpointed
blocks and dropout are not graphed (`graphable`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from torch import nn

from pipeline.config import TrainConfig
from pipeline.models.cuda_graph import GraphedCall
from pipeline.models.devices import to_device

log = logging.getLogger(__name__)

Batches = list[tuple[torch.Tensor, ...]]
StepFn = Callable[[Batches], tuple[torch.Tensor, ...]]


def graphable(tcfg: TrainConfig, model: nn.Module, device: torch.device, windows: bool, queued: bool) -> str | None:
    """Why this run's steps cannot be a CUDA graph, or None when they can (and `train.cuda_graph` asks)."""
    reasons = (
        (tcfg.cuda_graph == "false", "train.cuda_graph=false"),
        (device.type != "cuda", f"device {device.type}"),
        (not windows, "packed rows or images change shape"),
        (not queued, "the step reads its loss on the host (FSDP, L-BFGS or a non-fused optimizer)"),
        (tcfg.activation_checkpointing, "train.activation_checkpointing"),
        (_dropout(model) > 0, "dropout draws random numbers every step"),
    )
    return next((why for cond, why in reasons if cond), None)


def wants_graphs(
    tcfg: TrainConfig, model: nn.Module, device: torch.device, windows: bool, queued: bool, one_process: bool
) -> bool:
    """Whether the steps run as a CUDA graph: asked for (true, or auto) and possible; when asked for by
    true but not possible, a warning (every process) says why."""
    why = graphable(tcfg, model, device, windows, queued) if one_process else "several processes"
    if why is not None and tcfg.cuda_graph == "true":
        log.warning(f"train.cuda_graph: steps run eagerly ({why})")
    return why is None


def _dropout(model: nn.Module) -> float:
    """The largest drop probability in `model`: its config's, an `nn.Dropout`'s or a LoRA adapter's (`p`)."""
    cfg = getattr(model, "cfg", None)
    probs = [float(getattr(cfg, "dropout", 0.0) or 0.0)]
    probs += [m.p for m in model.modules() if isinstance(getattr(m, "p", None), float)]
    return max(probs)


class GraphedStep:
    """`fn(batches)` captured on `device` (a `GraphedCall` on the first step's batches); `self(batches)`
    replays it.

    `fn` runs forward and backward and returns 0-d tensors (loss, gradient norm, non-finite flag ...).
    Off CUDA, or when capture fails, each call runs `fn` eagerly instead, its gradients set to None
    first: exactly what a replay computes, one launch per kernel."""

    def __init__(self, fn: StepFn, batches: Batches, params: list[nn.Parameter], device: torch.device, warmup: int = 2):
        self.fn, self.params, self.device = fn, params, device
        self.sizes = [len(batch) for batch in batches]  # tensors per micro-batch: the flat inputs' layout
        self.graph: GraphedCall | None = None
        if device.type == "cuda":
            try:
                self.graph = GraphedCall(self._run_flat, self._flat(batches), warmup, self._clear_grads)
            except RuntimeError as e:  # a kernel that cannot be captured: run eagerly, same numbers
                log.warning(f"train.cuda_graph: capture failed ({str(e).splitlines()[0][:200]}); running eagerly")
                torch.cuda.synchronize()
                self._clear_grads()

    def _flat(self, batches: Batches) -> tuple[torch.Tensor, ...]:
        return tuple(to_device(t, self.device) for batch in batches for t in batch)

    def _run_flat(self, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        it = iter(tensors)
        return self.fn([tuple(next(it) for _ in range(n)) for n in self.sizes])

    def _clear_grads(self) -> None:
        for p in self.params:
            p.grad = None

    def __call__(self, batches: Batches) -> tuple[torch.Tensor, ...]:
        """This step's batches through the captured step; copies of its outputs (the next replay
        overwrites them)."""
        if self.graph is not None:
            outputs = self.graph(*(t for batch in batches for t in batch))
        else:
            self._clear_grads()
            outputs = self._run_flat(*self._flat(batches))
        return tuple(t.clone() for t in outputs)
