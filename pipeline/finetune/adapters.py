"""Adapter exports: a llama.cpp LoRA GGUF, a PEFT directory, and the merged model as a GGUF.

- GGUF adapter (`llama-cli -m base.gguf --lora adapter.gguf`): `general.type = adapter`,
  `adapter.type = lora`, `adapter.lora.alpha`, tensors `blk.N.attn_q.weight.lora_a` (r, in) and
  `.lora_b` (out, r) in numpy order, as llama.cpp's convert_lora_to_gguf.py writes them. Our Q/K
  rows are already in GGUF order, so tensors go out as they are.
- PEFT (`PeftModel.from_pretrained(hf_base, dir)`): `adapter_config.json` +
  `adapter_model.safetensors` with HF module names. transformers un-permutes Q/K rows when it
  loads a llama GGUF (GGUF's adjacent RoPE pairs -> HF's rotate-half halves), so lora_B of q and
  k gets the same row permutation; lora_A (the input side) is unaffected.
- merged: adapters folded into the weights (quantized layers dequantized), exported with
  `pipeline.architectures.export_gguf`.
"""

from __future__ import annotations

import copy
import json
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn

from pipeline.config import LoraConfig
from pipeline.errors import AdapterError, GGUFError, one_line, problem
from pipeline.finetune.lora import (
    attach_lora,
    check_architecture,
    load_lora_state_dict,
    lora_config_of,
    lora_layers,
    merge_lora,
    target_paths,
)
from pipeline.finetune.quant import QuantMatrix, dequantize_model
from pipeline.gguf.reader import GGUFFile
from pipeline.gguf.writer import write_gguf
from pipeline.io.files import atomic_dir, default_mode
from pipeline.models.names import LLAMA_LAYERS, LORA_TARGETS
from pipeline.models.registry import export_gguf

# our layer path inside a block -> GGUF tensor stem / HF module path inside a decoder layer
GGUF_LAYERS = {x.ours: x.gguf for x in LLAMA_LAYERS if x.lora}
HF_LAYERS = {x.ours: x.hf for x in LLAMA_LAYERS if x.lora}
PEFT_PREFIX = "base_model.model.model.layers"


@dataclass(frozen=True)
class Adapter:
    """An adapter read from a file, in our naming (`blocks.0.attn.wq.lora_A`), fp32."""

    rank: int
    alpha: float
    targets: tuple[str, ...]
    state: dict[str, torch.Tensor]
    file_names: dict[str, str]  # our name -> the name in the file, for error messages
    source: str


def _split(path: str) -> tuple[int, str]:
    """`blocks.3.attn.wq` -> (3, `attn.wq`)."""
    _, i, rest = path.split(".", 2)
    return int(i), rest


# ----- llama.cpp GGUF adapter -----


def adapter_gguf_tensors(model: nn.Module) -> dict[str, np.ndarray]:
    """`blk.N.<layer>.weight.lora_a` (r, in) and `.lora_b` (out, r), fp32, numpy order."""
    out: dict[str, np.ndarray] = {}
    for path, m in lora_layers(model).items():
        i, layer = _split(path)
        stem = f"blk.{i}.{GGUF_LAYERS[layer]}.weight"
        out[f"{stem}.lora_a"] = m.lora_A.detach().float().cpu().numpy()
        out[f"{stem}.lora_b"] = m.lora_B.detach().float().cpu().numpy()
    return out


def save_adapter_gguf(model: nn.Module, path: str | os.PathLike[str], keys: dict[str, Any] | None = None) -> Path:
    """The attached adapters as a llama.cpp LoRA adapter GGUF (f32), written atomically. `keys` are
    the export's `general.*` keys (name, base_model.*: pipeline.export.naming) and provenance; the adapter's
    own keys (general.type, adapter.*) are set last so nothing in `keys` can turn it into a model."""
    info = lora_config_of(model)
    metadata: dict[str, Any] = dict(keys or {})
    metadata |= {"general.type": "adapter", "adapter.type": "lora", "adapter.lora.alpha": float(info["alpha"])}
    return write_gguf(path, model.cfg.arch, metadata, adapter_gguf_tensors(model), dtype="f32")


_GGUF_NAME = re.compile(r"^blk\.(\d+)\.(\w+)\.weight\.lora_([ab])$")


def read_adapter_gguf(path: str | os.PathLike[str]) -> Adapter:
    """A llama.cpp LoRA adapter GGUF (ours or convert_lora_to_gguf.py's) in our naming."""
    g = GGUFFile(path)
    where = str(g.path)
    for key, want in (("general.type", "adapter"), ("adapter.type", "lora")):
        if g.metadata.get(key) != want:
            raise GGUFError(
                problem(f"{where} {key}", repr(want), repr(g.metadata.get(key)), "pass a LoRA adapter GGUF")
            )
    check_architecture(g.architecture, f"{where} general.architecture", "lora")
    layers = {v: k for k, v in GGUF_LAYERS.items()}
    state: dict[str, torch.Tensor] = {}
    names: dict[str, str] = {}
    for name in g.tensor_names():
        match = _GGUF_NAME.match(name)
        if match is None or match.group(2) not in layers:
            raise AdapterError(
                problem(
                    f"{where} tensor {name}",
                    f"blk.N.<{'|'.join(layers)}>.weight.lora_a/lora_b",
                    "another name",
                    "use an adapter of attention/feed-forward matrices",
                )
            )
        ours = f"blocks.{match.group(1)}.{layers[match.group(2)]}.lora_{match.group(3).upper()}"
        state[ours] = torch.from_numpy(g.tensor(name))
        names[ours] = name
    return _adapter(state, names, float(g.metadata.get("adapter.lora.alpha", 0.0)), where)


def _adapter(state: dict[str, torch.Tensor], names: dict[str, str], alpha: float, where: str) -> Adapter:
    """Check A/B pairs and a single rank; alpha 0 means 'unset' (llama.cpp then scales by 1)."""
    if not state:
        raise AdapterError(problem(where, "LoRA tensors", "none", "export the adapter again"))
    paths = sorted({n.rsplit(".", 1)[0] for n in state}, key=lambda p: (_split(p)[0], p))
    ranks = set()
    for p in paths:
        for x in ("A", "B"):
            if f"{p}.lora_{x}" not in state:
                raise AdapterError(
                    problem(where, f"both lora_a and lora_b for {p}", f"no lora_{x.lower()}", "export it again")
                )
        a, b = state[f"{p}.lora_A"], state[f"{p}.lora_B"]
        if a.ndim != 2 or b.ndim != 2 or a.shape[0] != b.shape[1]:
            raise AdapterError(
                problem(
                    f"{where} tensor {names[f'{p}.lora_A']}",
                    "lora_a (r, in) and lora_b (out, r) sharing r",
                    f"{tuple(a.shape)} and {tuple(b.shape)}",
                    "export it again (A/B transposed?)",
                )
            )
        if a.shape[0] == 0:
            raise AdapterError(problem(f"{where} tensor {names[f'{p}.lora_A']}", "rank >= 1", "rank 0", _RESAVE))
        ranks.add(int(a.shape[0]))
    if len(ranks) != 1:
        raise AdapterError(problem(where, "one rank for all layers", f"ranks {sorted(ranks)}", "export it again"))
    rank = ranks.pop()
    targets = tuple(t for t in LORA_TARGETS if any(_split(p)[1] == LORA_TARGETS[t] for p in paths))
    return Adapter(rank, alpha if alpha > 0 else float(rank), targets, state, names, where)


def apply_adapter(model: nn.Module, adapter: Adapter, dropout: float = 0.0) -> list[str]:
    """Attach `adapter` to a base model (freezing it); every tensor must fit the base's layers."""
    n_layer = len(model.blocks)
    for name, t in adapter.state.items():
        path, which = name.rsplit(".", 1)
        i, layer = _split(path)
        if i >= n_layer:
            raise AdapterError(
                problem(
                    f"{adapter.source} tensor {adapter.file_names[name]}",
                    f"a layer index below the base's {n_layer} layers",
                    f"layer {i}",
                    "apply the adapter to the base model it was trained on",
                )
            )
        base = model.get_submodule(path)
        base = getattr(base, "base", base)
        want = (adapter.rank, base.in_features) if which == "lora_A" else (base.out_features, adapter.rank)
        if tuple(t.shape) != want:
            raise AdapterError(
                problem(
                    f"{adapter.source} tensor {adapter.file_names[name]}",
                    f"shape {want} (rank {adapter.rank}, base layer {base.out_features}x{base.in_features})",
                    f"shape {tuple(t.shape)}",
                    "apply the adapter to the base model it was trained on",
                )
            )
    paths = sorted({n.rsplit(".", 1)[0] for n in adapter.state})
    expected = set(target_paths(model, adapter.targets))
    if set(paths) != expected:
        missing = sorted(expected - set(paths))[:3]
        raise AdapterError(
            problem(
                adapter.source,
                f"adapters on every layer for targets {list(adapter.targets)}",
                f"layers without one: {missing}",
                "use an adapter trained on this base (all layers)",
            )
        )
    cfg = LoraConfig(rank=adapter.rank, alpha=adapter.alpha, dropout=dropout, targets=list(adapter.targets))
    attached = attach_lora(model, cfg)
    load_lora_state_dict(model, adapter.state, adapter.source)
    return attached


# ----- PEFT -----


def _rope_rows_to_hf(b: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Rows of a q/k output from GGUF order (adjacent RoPE pairs) to HF's (two halves), per head."""
    out, r = b.shape
    return b.reshape(n_heads, out // n_heads // 2, 2, r).transpose(1, 2).reshape(out, r)


def _rope_rows_from_hf(b: torch.Tensor, n_heads: int) -> torch.Tensor:
    out, r = b.shape
    return b.reshape(n_heads, 2, out // n_heads // 2, r).transpose(1, 2).reshape(out, r)


def _rope_heads(model_cfg: Any, layer: str) -> int | None:
    """The heads of a q/k layer whose rows GGUF orders otherwise than HF: llama's (adjacent pairs);
    Qwen's and Gemma's files keep HF's halves (`Family.rope_halves`), so theirs go out as they are."""
    if model_cfg.family.rope_halves:
        return None
    return {"attn.wq": model_cfg.n_head, "attn.wk": model_cfg.n_kv_head}.get(layer)


def peft_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """PEFT's saved names (`base_model.model.model.layers.N.self_attn.q_proj.lora_A.weight`) -> fp32."""
    out: dict[str, torch.Tensor] = {}
    for path, m in lora_layers(model).items():
        i, layer = _split(path)
        a = m.lora_A.detach().float().cpu().contiguous()
        b = m.lora_B.detach().float().cpu()
        heads = _rope_heads(model.cfg, layer)
        if heads is not None:
            b = _rope_rows_to_hf(b, heads)
        stem = f"{PEFT_PREFIX}.{i}.{HF_LAYERS[layer]}"
        out[f"{stem}.lora_A.weight"] = a
        out[f"{stem}.lora_B.weight"] = b.contiguous()
    return out


def save_peft_adapter(
    model: nn.Module, out_dir: str | os.PathLike[str], base_model: str = "", dropout: float = 0.0
) -> Path:
    """`adapter_config.json` + `adapter_model.safetensors` that peft loads onto transformers' llama."""
    info = lora_config_of(model)
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": info["rank"],
        "lora_alpha": info["alpha"],
        "lora_dropout": dropout,
        "target_modules": [HF_LAYERS[LORA_TARGETS[t]].split(".")[-1] for t in info["targets"]],
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "init_lora_weights": True,
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
        "layers_to_transform": None,
        "rank_pattern": {},
        "alpha_pattern": {},
    }
    out_dir = Path(out_dir)
    with atomic_dir(out_dir) as tmp:
        (tmp / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
        save_file(peft_tensors(model), str(tmp / "adapter_model.safetensors"), metadata={"format": "pt"})
        default_mode(tmp / "adapter_model.safetensors")
    return out_dir


_PEFT_NAME = re.compile(r"^base_model\.model\.model\.layers\.(\d+)\.(\w+\.\w+)\.lora_([AB])\.weight$")


def read_peft_adapter(adapter_dir: str | os.PathLike[str], model_cfg: Any) -> Adapter:
    """A PEFT LoRA directory in our naming (q/k lora_B rows back to GGUF order for `model_cfg`)."""
    adapter_dir = Path(adapter_dir)
    where = str(adapter_dir)
    cfg_path, weights = adapter_dir / "adapter_config.json", adapter_dir / "adapter_model.safetensors"
    for p in (cfg_path, weights):
        if not p.is_file():
            raise AdapterError(problem(str(p), "a PEFT adapter file", "no such file", "point at a PEFT adapter dir"))
    config = _peft_config(cfg_path)
    unsupported = [
        k for k in ("use_dora", "use_rslora", "fan_in_fan_out", "rank_pattern", "alpha_pattern") if config.get(k)
    ]
    if config.get("peft_type") != "LORA" or unsupported:
        raise AdapterError(
            problem(
                str(cfg_path),
                "a plain LoRA adapter (one rank and alpha, no DoRA/rsLoRA)",
                f"peft_type={config.get('peft_type')!r}, {unsupported or 'no extras'}",
                "train a plain LoRA adapter",
            )
        )
    layers = {v: k for k, v in HF_LAYERS.items()}
    state: dict[str, torch.Tensor] = {}
    names: dict[str, str] = {}
    for name, t in _peft_tensors(weights).items():
        match = _PEFT_NAME.match(name)
        if match is None or match.group(2) not in layers:
            raise AdapterError(
                problem(
                    f"{weights} tensor {name}", "llama q/k/v/o/gate/up/down LoRA weights", "another name", "use LoRA"
                )
            )
        layer = layers[match.group(2)]
        t = t.float()
        heads = _rope_heads(model_cfg, layer)
        if heads is not None and match.group(3) == "B" and t.ndim == 2 and t.shape[0] % (2 * heads) == 0:
            t = _rope_rows_from_hf(t, heads)
        ours = f"blocks.{match.group(1)}.{layer}.lora_{match.group(3)}"
        state[ours], names[ours] = t, name
    return _adapter(state, names, float(config.get("lora_alpha", 0.0)), where)


_RESAVE = "re-save the adapter (PEFT's save_pretrained, or the export stage), or point lora= at a whole one"


def _peft_config(path: Path) -> dict[str, Any]:
    """`adapter_config.json` as a JSON object with a numeric `lora_alpha` (when it has one)."""
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise AdapterError(problem(str(path), "a JSON object", f"unreadable ({one_line(e, 120)})", _RESAVE)) from None
    if not isinstance(config, dict):
        raise AdapterError(problem(str(path), "a JSON object", type(config).__name__, _RESAVE))
    alpha = config.get("lora_alpha", 0.0)
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha) or alpha < 0:
        raise AdapterError(problem(f"{path} lora_alpha", "a number >= 0", repr(alpha)[:60], _RESAVE))
    return config


def _peft_tensors(path: Path) -> dict[str, torch.Tensor]:
    """The adapter's tensors; a truncated or garbage safetensors file is a named error."""
    try:
        return load_file(str(path))
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        found = f"not a readable safetensors file ({one_line(e, 120)})"
        raise AdapterError(problem(str(path), "LoRA weights in safetensors format", found, _RESAVE)) from None


# ----- merged -----


def export_merged_gguf(
    model: nn.Module,
    path: str | os.PathLike[str],
    tokenizer_meta: dict[str, Any],
    provenance: dict[str, Any],
    dtype: str = "f32",
) -> Path:
    """`model` as a model GGUF, adapters merged and quantized layers dequantized in a copy (the
    model itself keeps them)."""
    return export_gguf(plain_model(model), Path(path), tokenizer_meta, provenance, dtype)


def plain_model(model: nn.Module) -> nn.Module:
    """`model` with adapters merged and quantized layers dequantized, in a copy (or itself when it has neither)."""
    if lora_layers(model) or any(isinstance(m, QuantMatrix) for m in model.modules()):
        return dequantize_model(merge_lora(copy.deepcopy(model)))
    return model
