"""Fine-tuning recipes through the ordinary stages: the model is a pretrained GGUF (`donor.path`).

Modes, from the recipe config: `lora` (base dequantized to fp32 and frozen, adapters train),
`qlora` (base matrices stay in their GGUF blocks, frozen, adapters train) and `full` (every base
parameter trains).

A fine-tuning model directory (models/init, models/train) holds `finetune.json` (mode, the base
GGUF's path and sha256 fingerprint, the LoRA settings), `config.json` (the base's shape) and its
trained state: `adapter.safetensors` (the adapters only) for lora/qlora, `model.safetensors`
(all weights) for a trained full fine-tune. The base weights are never copied: they are re-read
from the GGUF, whose fingerprint must still match.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from pipeline.checkpoint import fingerprint
from pipeline.config import RecipeConfig
from pipeline.errors import ConfigError, problem
from pipeline.lora import LoRAConfig, attach_lora, load_base, load_lora_state_dict, lora_state_dict, trainable_summary

SPEC_FILE = "finetune.json"
ADAPTER_FILE = "adapter.safetensors"
MODEL_FILE = "model.safetensors"
MODES = {"lora": "lora", "qlora": "qlora", "full": "full-finetune"}  # mode -> lora.load_base's recipe


@dataclass(frozen=True)
class FinetuneSpec:
    """What a fine-tuning model directory is built from."""

    mode: str  # lora | qlora | full
    base: str  # absolute path of the base GGUF
    base_fingerprint: str
    lora: dict[str, Any] | None = None  # LoRAConfig fields (lora/qlora)

    def lora_config(self) -> LoRAConfig:
        return LoRAConfig(**{**self.lora, "targets": tuple(self.lora["targets"])})


def mode_of(recipe: RecipeConfig) -> str:
    """lora, qlora or full, from `recipe.trainable` / `recipe.quantized`."""
    if recipe.trainable == "lora":
        return "qlora" if recipe.quantized else "lora"
    return "full"


def is_finetune_dir(model_dir: Path) -> bool:
    return (Path(model_dir) / SPEC_FILE).is_file()


def read_spec(model_dir: Path) -> FinetuneSpec:
    path = Path(model_dir) / SPEC_FILE
    try:
        return FinetuneSpec(**json.loads(path.read_text()))
    except (OSError, json.JSONDecodeError, TypeError) as e:
        raise ConfigError(problem(str(path), "a fine-tuning spec", f"unreadable ({e})", "re-run: dvc repro")) from None


def build_model(spec: FinetuneSpec) -> nn.Module:
    """The base GGUF as the spec's mode loads it (frozen or not), with fresh adapters attached."""
    model, _ = load_base(Path(spec.base), MODES[spec.mode])
    if spec.mode in ("lora", "qlora"):
        attach_lora(model, spec.lora_config())
    return model


def check_base(spec: FinetuneSpec) -> None:
    """The base GGUF is still the file realize read (its fingerprint), else a named error."""
    base = Path(spec.base)
    if not base.is_file():
        raise ConfigError(problem(f"base GGUF {base}", "the file realize read", "no such file", "re-run: dvc repro"))
    found = fingerprint([base])
    if found != spec.base_fingerprint:
        raise ConfigError(
            problem(
                f"base GGUF {base}",
                f"the file realize read (fingerprint {spec.base_fingerprint})",
                f"a changed file (fingerprint {found})",
                "re-run realize: dvc repro",
            )
        )


def load_finetuned(model_dir: Path) -> nn.Module:
    """A fine-tuning model directory as a module: base + its saved adapters, or its full weights."""
    model_dir = Path(model_dir)
    spec = read_spec(model_dir)
    check_base(spec)
    model = build_model(spec)
    if spec.mode in ("lora", "qlora"):
        path = model_dir / ADAPTER_FILE
        if not path.is_file():
            raise ConfigError(problem(str(path), "the adapter weights", "no such file", "re-run: dvc repro"))
        load_lora_state_dict(model, load_file(str(path)), where=str(path))
    elif (model_dir / MODEL_FILE).is_file():
        model.load_state_dict(load_file(str(model_dir / MODEL_FILE)), strict=True)
    return model.eval()  # adapter dropout off until a training loop asks for train mode


def load_any(model_dir: Path) -> nn.Module:
    """Whatever realize or train wrote: a fine-tuning directory or a plain saved model."""
    if is_finetune_dir(model_dir):
        return load_finetuned(model_dir)
    from pipeline.realize import load_model

    return load_model(model_dir)


def weight_files(model_dir: Path) -> list[Path]:
    """The files that identify a model directory's weights (for checkpoint compatibility)."""
    names = (SPEC_FILE, ADAPTER_FILE, MODEL_FILE)
    return [Path(model_dir) / n for n in names if (Path(model_dir) / n).is_file()]


def save_finetuned(
    model: nn.Module, spec: FinetuneSpec, out_dir: Path, weights: dict[str, torch.Tensor] | None = None
) -> None:
    """Spec + config + trained state into `out_dir` (an existing, empty directory).

    `weights` (names as in `model.state_dict()`, e.g. from the training loop's snapshot) default
    to the model's own. lora/qlora keep only the adapters; a full fine-tune saves every weight.
    """
    out_dir = Path(out_dir)
    (out_dir / SPEC_FILE).write_text(json.dumps(asdict(spec), indent=2) + "\n")
    (out_dir / "config.json").write_text(model.cfg.to_json() + "\n")
    if spec.mode in ("lora", "qlora"):
        state = lora_state_dict(model) if weights is None else {k: v for k, v in weights.items() if ".lora_" in k}
        save_file({k: v.contiguous() for k, v in state.items()}, str(out_dir / ADAPTER_FILE))
    elif weights is not None:
        save_file({k: v.contiguous() for k, v in weights.items()}, str(out_dir / MODEL_FILE))


def realize_finetune(recipe: RecipeConfig, base: Path, packed_vocab: int, out_dir: Path) -> dict[str, float]:
    """The realize stage for a fine-tuning recipe: load and check the base, attach seeded adapters,
    write the spec (and the initial adapters) atomically. Returns the stage metrics."""
    from pipeline.atomic import atomic_dir

    base = Path(base).resolve()
    mode = mode_of(recipe)
    lora = asdict(recipe.lora.to_lora()) if mode != "full" else None
    if lora is not None:
        lora["targets"] = list(lora["targets"])
    spec = FinetuneSpec(mode=mode, base=str(base), base_fingerprint=fingerprint([base]), lora=lora)
    model = build_model(spec)
    if model.cfg.vocab_size != packed_vocab:
        raise ConfigError(
            problem(
                f"base GGUF {base}",
                f"{packed_vocab} tokens (the packed data's vocab)",
                str(model.cfg.vocab_size),
                "pack the data with the base's tokenizer: donor.path is both",
            )
        )
    with atomic_dir(out_dir) as tmp:
        save_finetuned(model, spec, tmp)
        (tmp / "realize.json").write_text(json.dumps({"init": "base", "mode": mode, "base": str(base)}) + "\n")
    counts = trainable_summary(model)
    return {
        "parameters": float(counts["total_params"]),
        "trainable_parameters": float(counts["trainable_params"]),
        "vocab_size": float(model.cfg.vocab_size),
    }


def export_finetuned(
    train_dir: Path, out_dir: Path, dtype: str, provenance: dict[str, Any], lora_dropout: float = 0.0
) -> dict[str, float]:
    """The export stage for a fine-tune: the merged model as a full GGUF (`model.gguf`, any export
    type), and for lora/qlora the adapter as a llama.cpp LoRA GGUF (`adapter.gguf`) and as a PEFT
    directory (`peft/`), all under `out_dir`, written atomically."""
    from pipeline.adapters import export_merged_gguf, save_adapter_gguf, save_peft_adapter
    from pipeline.atomic import atomic_dir
    from pipeline.convert import donor_tokenizer_metadata
    from pipeline.gguf_io import GGUFFile, count_tensors

    spec = read_spec(train_dir)
    model = load_finetuned(train_dir)
    tok_meta = donor_tokenizer_metadata(GGUFFile(spec.base))
    with atomic_dir(out_dir) as tmp:
        merged = export_merged_gguf(model, tmp / "model.gguf", tok_meta, provenance, dtype)
        metrics = {"file_bytes": float(merged.stat().st_size), "tensors": float(count_tensors(merged))}
        if spec.mode in ("lora", "qlora"):
            adapter = save_adapter_gguf(model, tmp / "adapter.gguf", provenance)
            save_peft_adapter(model, tmp / "peft", base_model=spec.base, dropout=lora_dropout)
            metrics["adapter_bytes"] = float(adapter.stat().st_size)
            metrics["peft_bytes"] = float((tmp / "peft" / "adapter_model.safetensors").stat().st_size)
    return metrics
