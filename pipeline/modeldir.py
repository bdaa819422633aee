"""The model-directory format (models/init, models/train, checkpoint weights) and the train state.

A plain model directory holds `config.json` (the architecture) and `model.safetensors`. A
fine-tune's directory holds `finetune.json` (mode, the base GGUF's path and fingerprint, the LoRA
settings), `config.json` (the base's shape) and its trained state: `adapter.safetensors` (the
adapters only) for lora/qlora, `model.safetensors` (every weight) for a trained full fine-tune.
The base weights are never copied: they are re-read from the GGUF, whose fingerprint must still
match. Beside them: `realize.json` (how realize made it), `train_state.json` (what train did) and
`optimizer.pt`. This module is the only writer and reader of all of these.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn

from pipeline.config import LoraConfig
from pipeline.errors import ConfigError, problem
from pipeline.finetune.lora import load_lora_state_dict, lora_state_dict
from pipeline.finetune.model import build_finetune
from pipeline.io.files import default_mode, fingerprint
from pipeline.io.records import field_problems
from pipeline.models.registry import build_model
from pipeline.models.transformer import DecoderLM, TransformerConfig
from pipeline.models.vit import ViTConfig

CONFIG_FILE = "config.json"
MODEL_FILE = "model.safetensors"
SPEC_FILE = "finetune.json"
ADAPTER_FILE = "adapter.safetensors"
REALIZE_FILE = "realize.json"
TRAIN_STATE_FILE = "train_state.json"
OPTIMIZER_FILE = "optimizer.pt"


@dataclass(frozen=True)
class FinetuneSpec:
    """What a fine-tuning model directory is built from."""

    mode: str  # lora | qlora | full (RecipeConfig.mode)
    base: str  # absolute path of the base GGUF
    base_fingerprint: str
    lora: dict[str, Any] | None = None  # LoraConfig fields (lora/qlora)

    @classmethod
    def of(cls, mode: str, base: Path, lora: LoraConfig | None) -> FinetuneSpec:
        base = Path(base).resolve()
        return cls(mode, str(base), fingerprint([base]), asdict(lora) if mode != "full" else None)

    def lora_config(self) -> LoraConfig | None:
        return None if self.lora is None else LoraConfig(**self.lora)


@dataclass
class TrainState:
    """What the train stage did, for export, evaluate and people: `train_state.json`."""

    steps: int
    tokens_seen: int
    final_train_loss: float
    final_val_loss: float
    seq_len: int
    batch_size: int
    mlflow_run_id: str | None = None
    resumed_from: int = 0
    skipped_steps: int = 0
    checkpoint: str | None = None
    world_size: int = 1
    initial_val_loss: float | None = None
    history: list[dict[str, float]] = field(default_factory=list)
    kept_step: int | None = None  # the step whose weights were written (train.keep_best: the best val loss)
    kept_val_loss: float | None = None  # their val loss: what evaluate must reproduce
    stopped_early: bool = False

    @property
    def val_loss(self) -> float:
        """The val loss of the weights written (older states knew only the last step's)."""
        return self.final_val_loss if self.kept_val_loss is None else self.kept_val_loss


def is_finetune_dir(model_dir: Path) -> bool:
    return (Path(model_dir) / SPEC_FILE).is_file()


def rerun(model_dir: Path) -> str:
    """The fix for a corrupt file in a model directory: re-run the stage that writes it (train writes
    train_state.json, realize realize.json; models/train and models/init by name otherwise)."""
    model_dir = Path(model_dir)
    if (model_dir / TRAIN_STATE_FILE).is_file() or model_dir.name == "train":
        return "the train stage writes it: re-run `dvc repro -f train`"
    if (model_dir / REALIZE_FILE).is_file() or model_dir.name == "init":
        return "the realize stage writes it: re-run `dvc repro -f realize`"
    return "re-run the stage that wrote it (`dvc repro -f realize` for models/init, `-f train` for models/train)"


def read_spec(model_dir: Path) -> FinetuneSpec:
    path = Path(model_dir) / SPEC_FILE
    try:
        return FinetuneSpec(**_read_json(path, "a fine-tuning spec"))
    except TypeError as e:
        raise ConfigError(problem(str(path), "a fine-tuning spec", f"unreadable ({e})", rerun(model_dir))) from None


def read_train_state(model_dir: Path) -> TrainState | None:
    """The train stage's record in `model_dir`, or None where there is none (a model not trained here)."""
    path = Path(model_dir) / TRAIN_STATE_FILE
    if not path.is_file():
        return None
    known = {f.name for f in fields(TrainState)}
    record = _read_json(path, "a train state")
    wrong = field_problems(record, TrainState)
    if wrong:
        raise ConfigError(
            problem(str(path), "a train state as the train stage writes it", "; ".join(wrong), rerun(model_dir))
        )
    return TrainState(**{k: v for k, v in record.items() if k in known})


def read_realize(model_dir: Path) -> dict[str, Any] | None:
    """How realize made `model_dir` (recipe, init, model config), or None for a dir without it."""
    path = Path(model_dir) / REALIZE_FILE
    return _read_json(path, "a realize record") if path.is_file() else None


def _read_json(path: Path, what: str) -> dict[str, Any]:
    """A JSON object; bad JSON, bytes that are not UTF-8 or another JSON type are a named error."""
    try:
        obj = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(problem(str(path), what, f"unreadable ({e})", rerun(path.parent))) from None
    if not isinstance(obj, dict):
        raise ConfigError(problem(str(path), f"{what} (a JSON object)", type(obj).__name__, rerun(path.parent)))
    return obj


def read_weights(path: Path) -> dict[str, torch.Tensor]:
    """A safetensors file of this directory; a truncated or garbage file names the stage that writes it."""
    try:
        return load_file(str(path))
    except (OSError, SafetensorError) as e:
        found = f"unreadable ({' '.join(str(e).split())[:100]})"
        raise ConfigError(problem(str(path), "a safetensors file", found, rerun(Path(path).parent))) from None


def load_weights_into(model: nn.Module, path: Path) -> None:
    """`path`'s tensors into `model`, every name and shape checked first (a file of another config is named)."""
    state = read_weights(path)
    check_state(model.state_dict(), state, path)
    model.load_state_dict(state, strict=True)


def check_state(expected: dict[str, torch.Tensor], state: dict[str, torch.Tensor], path: Path) -> None:
    """The saved tensors are exactly the model's, shape for shape."""
    missing, extra = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
    if missing or extra:
        found = f"missing {missing[:3]}, unexpected {extra[:3]}"
        raise ConfigError(
            problem(str(path), "the tensors of the model config.json describes", found, rerun(path.parent))
        )
    for name, t in expected.items():
        if tuple(state[name].shape) != tuple(t.shape):
            raise ConfigError(
                problem(
                    f"{path} tensor {name}",
                    f"shape {tuple(t.shape)} (from config.json)",
                    f"shape {tuple(state[name].shape)}",
                    rerun(path.parent),
                )
            )


def read_config(model_dir: Path) -> TransformerConfig | ViTConfig:
    """`config.json`, type- and range-checked, with the stage that writes it named on any fault
    (a ViT's config, `arch: vit`, has its own shape)."""
    path = Path(model_dir) / CONFIG_FILE
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError):
        raw = None  # TransformerConfig.load names the fault
    if isinstance(raw, dict) and raw.get("arch") == "vit":
        return ViTConfig.from_dict(raw, str(path), rerun(model_dir))
    return TransformerConfig.load(path, rerun(model_dir))


def _write_json(path: Path, obj: Any, sort_keys: bool = False) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=sort_keys) + "\n")


def write_weights(
    out_dir: Path, cfg: TransformerConfig, weights: dict[str, torch.Tensor], name: str = MODEL_FILE
) -> None:
    """`config.json` and a safetensors file of `weights` (a checkpoint's or a plain model's)."""
    save_file({k: v.detach().contiguous() for k, v in weights.items()}, str(Path(out_dir) / name))
    default_mode(Path(out_dir) / name)
    (Path(out_dir) / CONFIG_FILE).write_text(cfg.to_json() + "\n")


def save_model_dir(
    out_dir: Path,
    model: DecoderLM,
    weights: dict[str, torch.Tensor] | None = None,
    spec: FinetuneSpec | None = None,
    **records: Any,
) -> None:
    """A model directory in `out_dir` (an existing, empty directory: see `files.atomic_dir`).

    `weights` (names as in `model.state_dict()`, e.g. the training loop's snapshot) default to the
    model's own; a lora/qlora fine-tune keeps only the adapters. `records` are written beside them:
    `realize` (dict), `train_state` (TrainState), `optimizer_state` (torch-saved).
    """
    out_dir = Path(out_dir)
    state = model.state_dict() if weights is None else weights
    if spec is None:
        write_weights(out_dir, model.cfg, state)
    else:
        _write_json(out_dir / SPEC_FILE, asdict(spec))
        if spec.mode != "full":
            adapters = lora_state_dict(model) if weights is None else {k: v for k, v in state.items() if ".lora_" in k}
            write_weights(out_dir, model.cfg, adapters, ADAPTER_FILE)
        elif weights is not None:
            write_weights(out_dir, model.cfg, state)
        else:
            (out_dir / CONFIG_FILE).write_text(model.cfg.to_json() + "\n")
    _write_records(out_dir, **records)


def _write_records(
    out_dir: Path,
    realize: dict[str, Any] | None = None,
    train_state: TrainState | None = None,
    optimizer_state: dict[str, Any] | None = None,
) -> None:
    if realize is not None:
        _write_json(out_dir / REALIZE_FILE, realize)
    if optimizer_state is not None:
        torch.save(optimizer_state, out_dir / OPTIMIZER_FILE)
    if train_state is not None:
        _write_json(out_dir / TRAIN_STATE_FILE, asdict(train_state))


def load_model_dir(model_dir: Path) -> nn.Module:
    """Whatever realize or train wrote, as a module: a plain model, or a fine-tune's base with its
    saved adapters (or full weights), in eval mode until a training loop asks for train mode."""
    model_dir = Path(model_dir)
    if not is_finetune_dir(model_dir):
        _require(model_dir, (CONFIG_FILE, MODEL_FILE), rerun(model_dir))
        cfg = read_config(model_dir)
        state = read_weights(model_dir / MODEL_FILE)
        check_state(_shell(cfg, model_dir).state_dict(), state, model_dir / MODEL_FILE)  # before any allocation
        model = build_model(cfg)
        model.load_state_dict(state, strict=True)
        return model
    spec = read_spec(model_dir)
    check_base(spec)
    model = build_finetune(spec.base, spec.mode, spec.lora_config())
    if spec.mode != "full":
        _require(model_dir, (ADAPTER_FILE,), "re-run: dvc repro")
        load_lora_state_dict(model, read_weights(model_dir / ADAPTER_FILE), where=str(model_dir / ADAPTER_FILE))
    elif (model_dir / MODEL_FILE).is_file():
        load_weights_into(model, model_dir / MODEL_FILE)
    return model.eval()


def _shell(cfg: TransformerConfig, model_dir: Path) -> nn.Module:
    """The model on the meta device (no memory): its tensor names and shapes, to check a file against."""
    try:
        with torch.device("meta"):
            return build_model(cfg)
    except (RuntimeError, ValueError, OverflowError) as e:
        found = f"sizes torch cannot build ({' '.join(str(e).split())[:80]})"
        raise ConfigError(problem(str(model_dir / CONFIG_FILE), "a buildable model", found, rerun(model_dir))) from None


def _require(model_dir: Path, names: tuple[str, ...], fix: str) -> None:
    for name in names:
        if not (model_dir / name).is_file():
            raise ConfigError(problem(str(model_dir / name), "a saved model file", "no such file", fix))


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


def weight_files(model_dir: Path) -> list[Path]:
    """The files that identify a model directory's weights (for checkpoint compatibility)."""
    return [Path(model_dir) / n for n in (SPEC_FILE, ADAPTER_FILE, MODEL_FILE) if (Path(model_dir) / n).is_file()]


def model_config(model_dir: Path) -> TransformerConfig:
    """The architecture a model directory holds, without loading its weights."""
    _require(Path(model_dir), (CONFIG_FILE,), "run: dvc repro realize")
    return read_config(model_dir)
