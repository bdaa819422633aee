"""The device a process runs on, whether bf16 runs at speed there, moving a host tensor to the GPU
without making the host wait, and the dtype matmuls run in now.

A blocking host-to-device copy waits for every kernel already queued on the stream; from pinned memory,
without blocking, the copy is queued like a kernel and the host goes on (torch's caching host allocator
reuses the pinned blocks). The training loop and the losses move batches, labels' indexes and small
tables this way, so a CUDA step never waits for the previous one.
"""

from __future__ import annotations

import logging
import time
from functools import cache

import torch

from pipeline.errors import ConfigError, problem

log = logging.getLogger(__name__)


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


BF16_MIN_SPEEDUP = 1.2  # bf16 rounds more than fp32: on a CPU it has to buy clearly more speed to be picked
PROBE_MKN = (1024, 384, 1024)  # the default model's FFN matmul over one 8 x 128 batch: 0.8 GFLOP


def native_bf16(device: torch.device) -> bool:
    """Whether bf16 matmuls run at speed on `device`. A CPU needs bf16 instructions (AVX512-BF16, AMX, an
    Arm core's BF16: on an AVX2-only CPU torch's bf16 matmul takes a slow path, 31x fp32's time for the
    default's training step) and a bf16 matmul measured faster than an fp32 one (`cpu_bf16_speedup`)."""
    if device.type == "cuda":  # emulated bf16 (before sm80) is no faster than fp32
        try:
            return torch.cuda.is_bf16_supported(including_emulation=False)
        except TypeError:  # torch before 2.3 counts only the real thing
            return torch.cuda.is_bf16_supported()
    if device.type != "cpu":
        return True
    return cpu_bf16_instructions() and cpu_bf16_speedup() >= BF16_MIN_SPEEDUP


def cpu_bf16_instructions() -> bool:
    """What `torch.cpu.get_capabilities()` reports: any bf16 instruction set."""
    caps = torch.cpu.get_capabilities() if hasattr(torch.cpu, "get_capabilities") else {}
    return any(on is True and "bf16" in name for name, on in caps.items())


@cache
def cpu_bf16_speedup() -> float:
    """fp32's time over bf16's for one matmul of `PROBE_MKN` (best of 5 each; ~0.1 s, once per process).
    The instructions are not enough: a 2-core Intel Xeon reporting AVX512-BF16 without AMX ran the
    default's training step 1.70x slower in bf16 than in fp32 (docs/training.md, "Precision")."""
    m, k, n = PROBE_MKN
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(m, k, generator=gen), torch.randn(k, n, generator=gen)
    best = {}
    for dtype in (torch.float32, torch.bfloat16):
        x, y = a.to(dtype), b.to(dtype)
        x @ y  # the first call sets up the kernel
        times = []
        for _ in range(5):
            start = time.perf_counter()
            x @ y
            times.append(time.perf_counter() - start)
        best[dtype] = min(times)
    return best[torch.float32] / best[torch.bfloat16]


def slow_bf16_reason(kind: str) -> str:
    """Why bf16 is not native on a device of type `kind`, for a log line."""
    if kind != "cpu":
        return "no bf16 support"
    if not cpu_bf16_instructions():
        return "no bf16 instructions"
    return f"a bf16 matmul measured {cpu_bf16_speedup():.2f}x fp32's speed, under {BF16_MIN_SPEEDUP}x"


def resolve_precision(precision: str, device: torch.device, key: str = "train.precision") -> str:
    """`auto`: bf16 where it runs at speed, else fp32. An explicit bf16 where it does not is kept, and said."""
    fast = native_bf16(device)
    if precision == "auto":
        return "bf16" if fast else "fp32"
    if precision == "bf16" and not fast:
        _warn_slow_bf16(key, device.type)
    return precision


@cache
def _warn_slow_bf16(key: str, kind: str) -> None:
    """Once per process: the train stage and its loop both resolve the setting."""
    log.warning(
        f"{key}=bf16 on a {kind} where bf16 is slow ({slow_bf16_reason(kind)}): its matmuls run slower "
        f"than fp32 here; {key}=auto picks fp32 on this machine"
    )


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
