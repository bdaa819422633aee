"""Where and how a training process runs: device, allocator, autocast, the model's speed switches
(fused kernels, activation checkpointing, compiled blocks), and the signals that ask it to stop."""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from pipeline.config import TrainConfig
from pipeline.errors import ConfigError, TrainingInterrupted, problem
from pipeline.models.ops.fused import use_fused_kernels
from pipeline.models.ops.varlen import keep_attend_eager

log = logging.getLogger(__name__)

KERNEL_CACHE_CAPACITY = 128  # matmul shapes kept compiled: a step of packed rows uses ~50


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


def bound_kernel_caches(capacity: int = KERNEL_CACHE_CAPACITY) -> None:
    """Keep at most `capacity` compiled CPU matmul kernels in oneDNN's and torch's (ideep's) caches.

    Each new matmul shape compiles kernels that stay cached, ~0.6 MB a shape, up to 1024 shapes by
    default. Packed rows change the token count every step (only real tokens are computed), so each
    step brings ~25 new shapes: over the 40 steps of `preset=lora` the heap in use grew 455 -> 1054 MB;
    capped, it stays at 545 MB with the same losses. Both libraries read the setting at the process's
    first oneDNN matmul, so this runs before it; a value already in the environment wins.
    """
    for name in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY"):
        os.environ.setdefault(name, str(capacity))


def trim_freed_memory() -> bool:
    """Hand the heap's free pages back to the OS (glibc's `malloc_trim`); False where there is none."""
    try:
        return bool(ctypes.CDLL("libc.so.6").malloc_trim(0))
    except (OSError, AttributeError):
        return False


def resident_bytes() -> int:
    """This process's resident set size now (0 where /proc is missing)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


class HeapGuard:
    """Keeps a CPU run's resident size near what its steps really hold.

    With freed memory kept (`keep_freed_memory`), batches whose sizes change every step (packed rows:
    only the real tokens are computed) leave the heap fragmented: measured on LoRA steps of 603-864
    tokens, peak RSS climbed 1.42 -> 2.18 GB in eight steps, 1.90 GB with the free pages returned.
    After a step whose resident size is more than `slack` above the first step's, the free pages go
    back to the OS: the page faults that costs are paid only after the heap grew. Only for packed
    rows: with token windows every step has the same shapes, and a resident size raised by validation
    or a teacher would make it trim (and re-fault) after every step.
    """

    def __init__(self, slack: float = 0.1):
        self.slack, self.reference = slack, 0

    def after_step(self) -> None:
        rss = resident_bytes()
        if not self.reference:
            self.reference = rss
        elif rss > self.reference * (1 + self.slack):
            trim_freed_memory()


def autocast(device: torch.device, precision: str, cache: bool = True) -> AbstractContextManager:
    """bf16 autocast for matmuls (AMX/AVX512-BF16 on CPU, tensor cores on CUDA), or nothing for fp32.
    `cache=False` recasts a weight at every use (what a CUDA graph capture needs: the cache's copies
    would live in the graph's memory pool and be freed at the context's exit); the values are the same."""
    if precision == "bf16":
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16, cache_enabled=cache)
    return nullcontext()


def enable_activation_checkpointing(model: nn.Module) -> None:
    """Recompute each block's activations in backward instead of keeping them (any model with `blocks`).

    The block's `forward` is wrapped in place, so parameter names and checkpoints are unchanged;
    without gradients (validation, generation) blocks run as usual.
    """
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


def compile_wanted(tcfg: TrainConfig, device: torch.device) -> bool:
    """`train.compile`: true, or auto on CUDA (where compiling pays within a run; on a CPU it costs more
    than the default run's steps save: docs/training.md)."""
    return tcfg.compile == "true" or (tcfg.compile == "auto" and device.type == "cuda")


def compile_blocks(model: nn.Module) -> None:
    """torch.compile each block in place (names unchanged); the chunked loss stays eager. Every block runs
    the same code, so one compilation serves them all (the whole 30-layer forward as one graph took over
    200 s to compile on an H100 machine's 16 cores, against ~35 s for 4 layers: compile time grows with
    the layers unrolled, a block's does not). Where compilation fails, the block runs eagerly from then
    on (`CompiledOrEager`).

    Static shapes first; a second shape (packed rows: the real tokens' count varies by batch) makes
    that dimension dynamic instead of compiling once per count."""
    keep_attend_eager()
    for block in getattr(model, "blocks", []):
        block._compiled_call_impl = CompiledOrEager(block._call_impl, block)  # what nn.Module.compile sets


class CompiledOrEager:
    """A block's call through torch.compile, or the plain call from the first one whose compilation fails (a
    warning says why: no C compiler, an unsupported op): a run that asked for speed still trains, eagerly."""

    def __init__(self, fn: Callable[..., Any], module: nn.Module):
        self.fn, self.module = fn, module
        self.compiled: Callable[..., Any] | None = torch.compile(fn, dynamic=None)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.compiled is not None:
            try:
                return self.compiled(*args, **kwargs)
            except torch._dynamo.exc.TorchDynamoException as e:  # compile errors, not the model's own
                log.warning(f"train.compile: {type(self.module).__name__} runs eagerly ({one_line(e)})")
                self.compiled = None
        return self.fn(*args, **kwargs)


def one_line(e: BaseException) -> str:
    """An exception as one short line: its type and the first line of its message."""
    first = (str(e).strip().splitlines() or [""])[0]
    return f"{type(e).__name__}: {first[:200]}"


def speed_switches(model: nn.Module, tcfg: TrainConfig, device: torch.device) -> None:
    """Apply `train.fused_kernels`, `train.activation_checkpointing` and `train.compile` to the placed model."""
    use_fused_kernels(model, tcfg.fused_kernels)
    if tcfg.activation_checkpointing:
        enable_activation_checkpointing(model)
    if compile_wanted(tcfg, device):
        compile_blocks(model)


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
        log.warning(
            f"{signal.Signals(signum).name}: finishing this step, then writing a checkpoint (again to abort now)"
        )

    previous = {s: signal.signal(s, handle) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield asked
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


DVC_TEMP_COPY = "/.dvc/tmp/exps/"  # where `dvc exp run --queue/--temp` runs a copy of the project


def interrupted(signum: int, step: int, last: str | None) -> TrainingInterrupted:
    """The error a stop request ends the run with, naming the checkpoint to continue from."""
    where = f"checkpoint {last}" if last else "no checkpoint (train.checkpoint_dir unset)"
    name = signal.Signals(signum).name
    fix = "run again with train.resume=auto to continue"
    if last and DVC_TEMP_COPY in Path(last).as_posix():  # DVC deletes the copy, the checkpoint with it
        fix = (
            "this ran in a DVC queued/--temp copy, which DVC removes with its checkpoints, so running it again "
            "starts over; to continue after a stop, run experiments in the workspace (dvc exp run, no --queue/--temp)"
        )
    stopped = f"train stopped by {name} after step {step}"
    return TrainingInterrupted(problem(stopped, "an uninterrupted run", f"a stop request; wrote {where}", fix), signum)
