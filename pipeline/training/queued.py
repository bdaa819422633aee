"""A GPU step's figures kept on the device until the loop reads them.

Reading a CUDA tensor (`float(loss)`) waits for every kernel queued before it. Doing that each
step (loss, gradient norm, the distillation parts) keeps the host from queuing step n+1 while the
GPU runs step n, and at small shapes the GPU then idles for most of each step. So on CUDA the loop
queues each step's tensors here and reads them all at once (one wait) when it logs, validates,
checkpoints or ends; fused AdamW skips a non-finite step on the device (its `found_inf`, which
GradScaler uses the same way), so the weights are the ones the host-side check gives.
"""

from __future__ import annotations

import time
from typing import Any

import torch

DEFER_ON = ("cuda",)  # device types whose step figures are read only when the loop needs them


def defers(device: torch.device, opt: torch.optim.Optimizer, fsdp: bool) -> bool:
    """Whether this run queues its figures: on a DEFER_ON device, with a fused optimizer (the one
    that can skip a step on the device), not under FSDP (sharded parameters)."""
    return device.type in DEFER_ON and bool(opt.defaults.get("fused")) and not fsdp


def nonfinite(loss: torch.Tensor, grad_norm: torch.Tensor) -> torch.Tensor:
    """1.0 if `loss` or `grad_norm` is not finite, else 0.0, on the device (no wait): set as a fused
    optimizer's `found_inf`, its next `step()` leaves weights and optimizer state alone on 1."""
    return (~(torch.isfinite(loss) & torch.isfinite(grad_norm))).float()


class QueuedSteps:
    """Log rows whose tensor values are still on the device, oldest first."""

    def __init__(self) -> None:
        self.rows: list[tuple[int, dict[str, Any]]] = []
        self.since = time.perf_counter()

    def add(self, step: int, row: dict[str, Any]) -> None:
        self.rows.append((step, row))

    def read(self) -> tuple[list[tuple[int, dict[str, Any]]], float]:
        """The queued (step, row)s with every tensor read as a float (one wait for the device), and
        the seconds since the clock was last restarted; the queue empties."""
        tensors = [v for _, row in self.rows for v in row.values() if isinstance(v, torch.Tensor)]
        values = iter(torch.stack([t.detach().float().reshape(()) for t in tensors]).tolist() if tensors else [])
        for _, row in self.rows:
            for key, value in row.items():
                if isinstance(value, torch.Tensor):
                    row[key] = next(values)
        rows, self.rows = self.rows, []
        return rows, time.perf_counter() - self.since

    def restart_clock(self) -> None:
        """Steps are timed from here (after validation and logging, which are not steps)."""
        self.since = time.perf_counter()
