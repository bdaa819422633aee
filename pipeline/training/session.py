"""One training process's model as the loop drives it: wrapped for DDP/FSDP, its optimizer, and
full snapshots of both (a collective under FSDP) for checkpoints and outputs."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from pipeline.config import DistillConfig, OptimConfig, TrainConfig
from pipeline.models.ops.losses import head_targets
from pipeline.training import distributed as dist
from pipeline.training.optim import load_named_optimizer_state, make_optimizer, named_optimizer_state, table_parameters


class Forward(nn.Module):
    """One module whose forward is the training loss (or logits without targets), so that DDP's and
    FSDP's forward hooks wrap exactly what a step runs.

    With distillation on, the loss is the model's `distill_loss` against the donor's targets: the
    batch's cached ones, or (online) the donor's top-k on this very batch. The donor is held
    outside the module's parameters (a plain list), so no wrapper, optimizer or checkpoint sees it.
    """

    def __init__(self, model: nn.Module, distill: DistillConfig | None = None, donor: nn.Module | None = None):
        super().__init__()
        self.model = model
        self.distill = distill if distill is not None and distill.enabled else None
        self._donor = [] if donor is None else [donor]
        self.parts: list[torch.Tensor] = []  # detached (CE, KD) of each distillation micro-batch

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None, *extra: torch.Tensor) -> torch.Tensor:
        """`extra`: what else the batch holds for the loss (instruct rows: segment ids; distillation:
        the cached donor ids, log-probs and tail)."""
        if targets is None:
            return self.model(idx)
        if self.distill is None or not (extra or self._donor):  # a plain batch between cached ones
            return self.model.loss(idx, targets, *extra)
        teacher = tuple(extra) if extra else self.online_targets(idx)
        loss, parts = self.model.distill_loss(idx, targets, teacher, self.distill.weight, self.distill.temperature)
        self.parts.append(parts)
        return loss

    @torch.no_grad()
    def online_targets(self, idx: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The donor's top-k targets for every position of `idx` (it sees exactly the student's window)."""
        donor = self._donor[0]
        return head_targets(donor.hidden(idx).flatten(0, 1), donor.head_weight(), self.distill.top_k)


def trainable_names(model: nn.Module) -> set[str]:
    """Names of the parameters that train (all of them, or a LoRA run's adapters)."""
    return {n for n, p in model.named_parameters() if p.requires_grad}


class Session:
    """The model, its DDP/FSDP wrapper and optimizer in one process; snapshots hold only what trains
    (a frozen base, as in LoRA, is re-read from its file)."""

    def __init__(
        self,
        model: nn.Module,
        tcfg: TrainConfig,
        optim: OptimConfig,
        device: torch.device,
        donor: nn.Module | None = None,
    ):
        """`donor`: the teacher of online distillation (moved to `device`, never trained)."""
        self.model, self.device = model, device
        self.info = dist.env_info()
        self.fsdp = self.info.enabled and tcfg.parallel == "fsdp"
        self.forward = Forward(model, tcfg.distill, None if donor is None else donor.to(device))
        self.module = dist.wrap(self.forward, tcfg.parallel, self.info, device)
        self.opt = make_optimizer(self.module, optim)
        self.names = {id(p): n for n, p in model.named_parameters()}
        self.eval_module = self.module if self.fsdp else model
        trainable = trainable_names(model)
        frozen = {id(p) for p in model.parameters() if not p.requires_grad}
        table = {id(p) for p in table_parameters(model)}  # a frozen table is the student's own: saved with it
        self.keep = None if frozen <= table else trainable
        self.params = [p for p in self.module.parameters() if p.requires_grad]

    def weights(self) -> dict[str, torch.Tensor]:
        """Full trainable weights, copied to CPU (a collective under FSDP)."""
        if not self.fsdp:
            return {k: v.detach().cpu().clone().contiguous() for k, v in self._kept(self.model.state_dict()).items()}
        # FSDP only, and 0.6 s to import: not at module top
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
        return self._kept(_strip(get_model_state_dict(self.module, options=opts)))

    def snapshot(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """Full weights and name-keyed optimizer state on CPU (a collective under FSDP)."""
        weights = self.weights()
        if not self.fsdp:
            return weights, named_optimizer_state(self.opt, self.names)
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
        osd = get_optimizer_state_dict(self.module, self.opt, options=opts)
        if osd:
            osd = {
                "state": _strip(osd["state"]),
                "param_groups": [{**g, "params": [_unprefix(n) for n in g["params"]]} for g in osd["param_groups"]],
            }
        return weights, osd

    def loss_parts(self, read: bool = True) -> dict[str, float | torch.Tensor]:
        """The train loss's two parts over the last step's micro-batches (mean over ranks too):
        `train_ce`, `train_kd`; {} without distillation. Every rank calls it (a collective).
        With `read=False` they stay 0-d tensors on the device (read later, see `queued`)."""
        if not self.forward.parts:
            return {}
        parts = dist.mean_across(torch.stack(self.forward.parts).mean(0), self.info)
        ce, kd = parts.tolist() if read else parts.unbind()
        return {"train_ce": ce, "train_kd": kd}

    def _kept(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return state if self.keep is None else {k: v for k, v in state.items() if k in self.keep}

    def load_optimizer(self, named: dict[str, Any]) -> None:
        if not self.fsdp:
            load_named_optimizer_state(self.opt, named, self.names)
            return
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        prefixed = {
            "state": {f"model.{k}": v for k, v in named["state"].items()},
            "param_groups": [{**g, "params": [f"model.{n}" for n in g["params"]]} for g in named["param_groups"]],
        }
        set_optimizer_state_dict(self.module, self.opt, prefixed, options=StateDictOptions(full_state_dict=True))

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
