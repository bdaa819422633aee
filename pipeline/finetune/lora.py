"""LoRA adapters on a frozen base: attach, train only the adapters, merge, save/load their tensors.

A target layer `W` (nn.Linear, or QLoRA's `QuantLinear`) is wrapped as
`y = W x + (alpha / r) * B A dropout(x)`, with A (r, in) random and B (out, r) zero, so the
wrapped model computes exactly the base's function at step 0. Everything else is frozen: only
A and B require grad, so an optimizer built from `p.requires_grad` parameters holds nothing else.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pipeline.config import LoraConfig
from pipeline.errors import AdapterError, ConfigError, GGUFError, PipelineError, problem
from pipeline.finetune.lora_cpu import dropout, project
from pipeline.models.names import LLAMA_FAMILY, LORA_TARGETS

SUPPORTED_ARCHS = LLAMA_FAMILY


class LoRALinear(nn.Module):
    """`base(x) + scaling * B(A(dropout(x)))`; `base` is frozen and untouched."""

    def __init__(self, base: nn.Module, rank: int, alpha: float, dropout: float = 0.0):
        super().__init__()
        self.base = base
        self.in_features, self.out_features = int(base.in_features), int(base.out_features)
        self.rank, self.alpha = rank, float(alpha)
        self.scaling = self.alpha / rank
        self.lora_A = nn.Parameter(torch.zeros(rank, self.in_features))
        self.lora_B = nn.Parameter(torch.zeros(self.out_features, rank))
        self.p = float(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The scalings multiply the rank-r product (r/out of the work of scaling the output); on CPU over
        a frozen base with `weight_as` (recipe=lora and qlora), `project`'s fused step."""
        if x.device.type == "cpu" and hasattr(self.base, "weight_as"):
            return project(x, self, self.training)
        kept, factor = dropout(x, self.p, self.training)
        delta = F.linear(F.linear(kept, self.lora_A) * (self.scaling * factor), self.lora_B)
        return self.base(x) + delta

    @property
    def bias(self) -> torch.Tensor | None:
        """The base's bias (Qwen2's q/k/v), which adapters leave as it is."""
        return getattr(self.base, "bias", None)

    def delta_weight(self) -> torch.Tensor:
        """scaling * B @ A, the (out, in) update merging adds to the base weight (fp32)."""
        return (self.lora_B.float() @ self.lora_A.float()) * self.scaling

    def base_weight(self) -> torch.Tensor:
        """The base's fp32 weight (dequantized for QLoRA)."""
        if hasattr(self.base, "dequantize"):
            return self.base.dequantize()
        return self.base.weight.float()

    def extra_repr(self) -> str:
        return f"rank={self.rank}, alpha={self.alpha}, dropout={self.p}"


def target_paths(model: nn.Module, targets: Iterable[str]) -> list[str]:
    """`blocks.{i}.attn.wq` ... for every block and target, in block order."""
    n = len(model.blocks)
    return [f"blocks.{i}.{LORA_TARGETS[t]}" for i in range(n) for t in targets]


def check_architecture(arch: str, where: str, recipe: str, error: type[PipelineError] = GGUFError) -> None:
    """The recipes adapt the llama family only (the layer names above); `where` names the key."""
    if arch not in SUPPORTED_ARCHS:
        raise error(
            problem(
                where,
                f"an architecture recipe={recipe} supports ({', '.join(SUPPORTED_ARCHS)})",
                repr(arch),
                f"use a base GGUF of the llama family ({', '.join(SUPPORTED_ARCHS)})",
            )
        )


def freeze(model: nn.Module) -> None:
    for p in model.parameters():
        p.requires_grad_(False)


def attach_lora(model: nn.Module, cfg: LoraConfig) -> list[str]:
    """Freeze `model` and wrap its target layers with adapters; returns the wrapped layers' paths."""
    arch = getattr(getattr(model, "cfg", None), "arch", type(model).__name__)
    check_architecture(arch, "model config arch", "lora", ConfigError)
    paths = target_paths(model, cfg.targets)
    for path in paths:
        try:
            layer = model.get_submodule(path)
        except AttributeError:
            layer = None
        if layer is None or not hasattr(layer, "in_features") or isinstance(layer, LoRALinear):
            found = "no such layer" if layer is None else type(layer).__name__
            raise ConfigError(
                problem(
                    f"config key recipe.lora.targets ({path})",
                    "a plain linear layer of the model",
                    found,
                    "target q,k,v,o,gate,up,down of a llama model without adapters attached",
                )
            )
        width = min(int(layer.in_features), int(layer.out_features))
        if cfg.rank > width:
            raise ConfigError(
                problem(
                    "config key recipe.lora.rank",
                    f"at most the width of {path} ({layer.out_features}x{layer.in_features}): {width}",
                    str(cfg.rank),
                    f"set recipe.lora.rank <= {width}",
                )
            )
    freeze(model)
    for path in paths:
        parent_path, attr = path.rsplit(".", 1)
        parent = model.get_submodule(parent_path)
        base = getattr(parent, attr)
        wrapped = LoRALinear(base, cfg.rank, cfg.alpha, cfg.dropout).to(_device(base))
        _init_adapter(wrapped, cfg, path)
        setattr(parent, attr, wrapped)
    return paths


def _device(module: nn.Module) -> torch.device:
    for t in (*module.parameters(), *module.buffers()):
        return t.device
    return torch.device("cpu")


def _init_adapter(layer: LoRALinear, cfg: LoraConfig, path: str) -> None:
    """A ~ U(-b, b) * init_scale with b = 1/sqrt(in) from a generator seeded by (seed, path); B = 0."""
    g = torch.Generator().manual_seed(cfg.init_seed * 1_000_003 + zlib.crc32(path.encode()))
    bound = 1.0 / math.sqrt(layer.in_features)
    with torch.no_grad():
        a = (torch.rand(layer.lora_A.shape, generator=g) * 2 - 1) * bound * cfg.init_scale
        layer.lora_A.copy_(a)
        layer.lora_B.zero_()


def lora_layers(model: nn.Module) -> dict[str, LoRALinear]:
    """Wrapped layers by path (`blocks.0.attn.wq`), in module order."""
    return {name: m for name, m in model.named_modules() if isinstance(m, LoRALinear)}


def lora_config_of(model: nn.Module) -> dict[str, Any]:
    """rank, alpha and targets of the attached adapters (all layers share them)."""
    layers = lora_layers(model)
    if not layers:
        raise AdapterError(problem("model", "LoRA adapters attached", "none", "call attach_lora first"))
    first = next(iter(layers.values()))
    inverse = {v: k for k, v in LORA_TARGETS.items()}
    targets = []
    for path in layers:
        short = inverse[path.split(".", 2)[2]]
        if short not in targets:
            targets.append(short)
    return {"rank": first.rank, "alpha": first.alpha, "targets": [t for t in LORA_TARGETS if t in targets]}


def lora_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """`{path}.lora_A` / `{path}.lora_B` -> fp32 CPU copies (the whole trained state of a LoRA run)."""
    out: dict[str, torch.Tensor] = {}
    for path, m in lora_layers(model).items():
        out[f"{path}.lora_A"] = m.lora_A.detach().float().cpu().clone()
        out[f"{path}.lora_B"] = m.lora_B.detach().float().cpu().clone()
    return out


def load_lora_state_dict(model: nn.Module, state: dict[str, torch.Tensor], where: str = "adapter") -> None:
    """Copy adapter tensors into the attached adapters; names and shapes must match exactly."""
    layers = lora_layers(model)
    expected = {f"{p}.lora_{x}": getattr(m, f"lora_{x}") for p, m in layers.items() for x in ("A", "B")}
    missing = sorted(set(expected) - set(state))
    extra = sorted(set(state) - set(expected))
    if missing or extra:
        raise AdapterError(
            problem(
                where,
                f"tensors for the attached layers ({len(expected)})",
                f"missing {missing[:3]}{'...' if len(missing) > 3 else ''}, unexpected {extra[:3]}"
                f"{'...' if len(extra) > 3 else ''}",
                "attach the adapter's own targets and rank to a base with the same layers",
            )
        )
    for name, param in expected.items():
        t = state[name]
        if tuple(t.shape) != tuple(param.shape):
            raise AdapterError(
                problem(
                    f"{where} tensor {name}",
                    f"shape {tuple(param.shape)} (from the base model and rank)",
                    f"shape {tuple(t.shape)}",
                    "apply the adapter to the base model it was trained on",
                )
            )
    with torch.no_grad():
        for name, param in expected.items():
            param.copy_(state[name].to(param.dtype))


def merge_lora(model: nn.Module) -> nn.Module:
    """Fold every adapter into its layer (W + scaling * B @ A, fp32) and remove the wrappers.

    A QuantLinear base becomes a plain fp32 nn.Linear (its dequantized weight plus the delta), so
    the merged model exports like any other.
    """
    for path, m in lora_layers(model).items():
        with torch.no_grad():
            w = m.base_weight() + m.delta_weight()
        device = m.lora_A.device
        merged = nn.Linear(m.in_features, m.out_features, bias=m.bias is not None, device="meta")
        merged.weight = nn.Parameter(w.to(device), requires_grad=False)
        if m.bias is not None:
            merged.bias = nn.Parameter(m.bias.detach().float().to(device), requires_grad=False)
        parent_path, attr = path.rsplit(".", 1)
        setattr(model.get_submodule(parent_path), attr, merged)
    return model


def trainable_summary(model: nn.Module) -> dict[str, int]:
    """Counts for logs: trainable vs total parameters (quantized blocks counted as weights)."""
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    total += sum(m.in_features * m.out_features for m in model.modules() if hasattr(m, "dequantize"))
    return {"trainable_params": int(trainable), "total_params": int(total)}
