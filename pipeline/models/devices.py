"""The device a process runs on, moving a host tensor to the GPU without making the host wait, and the
dtype matmuls run in now.

A blocking host-to-device copy waits for every kernel already queued on the stream; from pinned memory,
without blocking, the copy is queued like a kernel and the host goes on (torch's caching host allocator
reuses the pinned blocks). The training loop and the losses move batches, labels' indexes and small
tables this way, so a CUDA step never waits for the previous one.
"""

from __future__ import annotations

import torch

from pipeline.errors import ConfigError, problem


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


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`t` on `device` (itself when it is there already); a host tensor goes to CUDA from pinned memory."""
    if t.device == device:
        return t
    if device.type == "cuda" and t.device.type == "cpu":
        t = t.pin_memory()
    return t.to(device, non_blocking=True)


def matmul_dtype(kind: str, otherwise: torch.dtype) -> torch.dtype:
    """The dtype a matmul on device type `kind` runs in here: autocast's when it is on, else `otherwise`."""
    return torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else otherwise
