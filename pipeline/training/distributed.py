"""Scale-out through `torchrun`: the process group, this rank's view, and DDP/FSDP wrapping.

torchrun sets RANK, LOCAL_RANK and WORLD_SIZE (and the rendezvous address); without them, or with
a world of one, training is a single process and nothing here touches torch.distributed. The
backend follows the device: gloo on CPU, nccl on CUDA. `train.batch_size` is the global batch:
every rank draws the same global batch from the same seeded sampler and keeps its own slice, so
N processes see exactly the rows one process would.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
from torch import nn

from pipeline.errors import ConfigError, problem


@dataclass(frozen=True)
class DistInfo:
    """Where this process sits in the job."""

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def env_info() -> DistInfo:
    """The job layout torchrun put in the environment (a single process when absent)."""
    return DistInfo(
        rank=int(os.environ.get("RANK", "0")),
        local_rank=int(os.environ.get("LOCAL_RANK", "0")),
        world_size=int(os.environ.get("WORLD_SIZE", "1")),
    )


def is_main_process() -> bool:
    """Rank 0 writes checkpoints, outputs, metrics and MLflow; the others only compute."""
    return env_info().is_main


def rank_device(device: torch.device, info: DistInfo) -> torch.device:
    """Each rank takes its own GPU (LOCAL_RANK); CPU ranks share the CPU."""
    if device.type == "cuda" and info.enabled:
        return torch.device("cuda", info.local_rank)
    return device


def setup(device: torch.device) -> DistInfo:
    """Join the torchrun job if there is one (idempotent); a world of one stays single-process."""
    info = env_info()
    if not info.enabled:
        return info
    if device.type == "mps":
        raise ConfigError(
            problem("config key train.device", "cpu or cuda under torchrun", "mps", "MPS runs one process only")
        )
    if not torch.distributed.is_initialized():
        if device.type == "cuda":
            torch.cuda.set_device(device)
        backend = "nccl" if device.type == "cuda" else "gloo"
        torch.distributed.init_process_group(backend, timeout=timedelta(minutes=10))
    return info


def teardown(info: DistInfo) -> None:
    if info.enabled and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def check_batch_divides(batch_size: int, info: DistInfo) -> None:
    """The global batch must split evenly, or ranks would train on different amounts of data."""
    if batch_size % info.world_size:
        raise ConfigError(
            problem(
                "config key train.batch_size",
                f"a multiple of the world size {info.world_size} (the global batch is split across ranks)",
                str(batch_size),
                f"set train.batch_size to a multiple of {info.world_size} or change --nproc_per_node/--nnodes",
            )
        )


def shard_rows(t: torch.Tensor, info: DistInfo) -> torch.Tensor:
    """This rank's contiguous slice of a global batch."""
    if not info.enabled:
        return t
    per = t.shape[0] // info.world_size
    return t[info.rank * per : (info.rank + 1) * per]


def mean_across(value: torch.Tensor, info: DistInfo) -> torch.Tensor:
    """The mean of a scalar tensor over ranks (every rank gets it)."""
    if not info.enabled:
        return value
    value = value.detach().clone().float()
    torch.distributed.all_reduce(value, op=torch.distributed.ReduceOp.SUM)
    return value / info.world_size


def any_rank(flag: bool, info: DistInfo, device: torch.device) -> bool:
    """True on every rank if it is true on any: ranks must agree to stop at the same step."""
    if not info.enabled:
        return flag
    t = torch.tensor([1.0 if flag else 0.0], device=device)
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
    return bool(t.item() > 0)


def check_same(value: int, what: str, info: DistInfo, device: torch.device) -> None:
    """Every rank must agree on `value` (e.g. the step a checkpoint resumes at), else a named error."""
    if not info.enabled:
        return
    t = torch.tensor([value, -value], dtype=torch.int64, device=device)
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
    high, low = int(t[0]), -int(t[1])
    if high != low:
        raise ConfigError(
            problem(
                what,
                "the same on every rank",
                f"{low} on some ranks and {high} on others",
                "put train.checkpoint_dir on storage every node shares, or resume with train.resume=<dir>",
            )
        )


def all_agree(flag: bool, info: DistInfo, device: torch.device) -> bool:
    """Whether `flag` holds on every rank (itself in a single process)."""
    if not info.enabled:
        return flag
    t = torch.tensor([int(flag)], dtype=torch.int64, device=device)
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MIN)
    return bool(t[0])


def barrier(info: DistInfo) -> None:
    if info.enabled:
        torch.distributed.barrier()


def wrap(module: nn.Module, mode: str, info: DistInfo, device: torch.device) -> nn.Module:
    """DDP (gradients all-reduced) or FSDP2 (parameters sharded per block) for a world > 1."""
    if not info.enabled:
        return module
    if mode == "fsdp":
        from torch.distributed.fsdp import fully_shard

        for block in getattr(module, "blocks", None) or getattr(module.model, "blocks", []):
            fully_shard(block)
        fully_shard(module)
        return module
    from torch.nn.parallel import DistributedDataParallel

    # buffers are constants every rank loads alike (a fine-tune's frozen blocks and their cached copies:
    # hundreds of MB), so they are not re-broadcast at every forward. No device_ids: with them DDP would move
    # every input to the GPU, and the loop keeps labels and segment ids on the host (`_Run._placed`).
    return DistributedDataParallel(module, device_ids=None, broadcast_buffers=False)
