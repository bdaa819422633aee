"""The export stage: the trained model as a GGUF that llama.cpp and transformers load, with the
donor's tokenizer, `general.*` keys by llama.cpp's conventions and our provenance; for a LoRA/QLoRA
fine-tune also the adapter as a llama.cpp LoRA GGUF and as a PEFT directory. Everything lands in
`out_dir` at once (temp dir + rename).

`model.gguf` is the stable path the pipeline (and dvc.yaml) reads; the same file also carries its
conventional name (`SmolLM2-135M-Instruct-lora-pydoc-Q8_0.gguf`, see pipeline.export.naming) as a hard link,
and `README.md` is its model card.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torch import nn

from pipeline.errors import GGUFError, problem
from pipeline.export.auto_types import budget_mb, calibration_windows, export_auto
from pipeline.export.card import CardFacts, model_card
from pipeline.export.corpus_imatrix import IMATRIX_GGUF, ImatrixSource, corpus_imatrix, export_with_imatrix
from pipeline.export.naming import ShipInfo, donor_identity, file_name, general_keys, general_metadata, link_or_copy
from pipeline.finetune.adapters import plain_model, save_adapter_gguf, save_peft_adapter
from pipeline.finetune.lora import lora_layers
from pipeline.gguf.header import count_tensors
from pipeline.gguf.imatrix_format import write_imatrix
from pipeline.gguf.reader import GGUFFile
from pipeline.gguf.writer import check_export_dtype
from pipeline.io.files import atomic_dir
from pipeline.modeldir import load_model_dir, read_train_state
from pipeline.models.registry import export_gguf
from pipeline.tokenizer.pretokenizers import donor_tokenizer_metadata

MODEL_GGUF, ADAPTER_GGUF, PEFT_DIR, CARD = "model.gguf", "adapter.gguf", "peft", "README.md"


@dataclass(frozen=True)
class ExportPlan:
    """What to export as: the tensor type, the names (ShipInfo) and the PEFT adapter's dropout."""

    dtype: str = "f32"
    ship: ShipInfo = field(default_factory=ShipInfo)
    lora_dropout: float = 0.0
    imatrix: ImatrixSource | None = None  # export.imatrix: calibrate the quantized tensors on the corpus
    calibration: ImatrixSource | None = None  # export.dtype=auto:<MB>: the train windows the types are measured on


def run_export(
    train_dir: Path, donor: Path, out_dir: Path, plan: ExportPlan, provenance: dict[str, Any]
) -> dict[str, float]:
    """`model.gguf` (adapters merged, quantized layers dequantized) in `plan.dtype`, its conventional
    name beside it, the model card, plus `adapter.gguf` and `peft/` when the model carries LoRA
    adapters; returns the stage metrics. `provenance` keys override the generated `general.*` ones."""
    if budget_mb(plan.dtype) is None:
        check_export_dtype(plan.dtype)  # before the model loads
    model = load_model_dir(train_dir)
    g = GGUFFile(donor)
    tok_meta = donor_tokenizer_metadata(g)
    _check_vocab(tok_meta, model.cfg.vocab_size, donor)
    plain = plain_model(model)
    identity = donor_identity(g)
    meta = general_metadata(identity, plan.ship, sum(p.numel() for p in plain.parameters()))
    keys = {**general_keys(meta, model.cfg.arch), **provenance}
    named = file_name(meta, plan.dtype)
    adapters = bool(lora_layers(model))
    with atomic_dir(out_dir) as tmp:
        merged, metrics = _model_file(plain, tmp, tok_meta, keys, plan)
        link_or_copy(merged, tmp / named)
        metrics |= {"file_bytes": float(merged.stat().st_size), "tensors": float(count_tensors(merged))}
        if adapters:
            adapter = save_adapter_gguf(model, tmp / ADAPTER_GGUF, keys)  # the merged model's name, base model
            save_peft_adapter(model, tmp / PEFT_DIR, base_model=identity.model_id, dropout=plan.lora_dropout)
            metrics["adapter_bytes"] = float(adapter.stat().st_size)
            metrics["peft_bytes"] = float((tmp / PEFT_DIR / "adapter_model.safetensors").stat().st_size)
        facts = _facts(train_dir, named, plan, adapters, donor.name)
        (tmp / CARD).write_text(model_card(meta, identity, plan.ship, facts))
    return metrics


def _model_file(
    plain: nn.Module, tmp: Path, tok_meta: dict[str, Any], keys: dict[str, Any], plan: ExportPlan
) -> tuple[Path, dict[str, float]]:
    """`tmp/model.gguf` at `plan.dtype`: a fixed type, with the corpus imatrix, or auto:<MB> (`auto_types`)."""
    if budget_mb(plan.dtype) is not None:
        if plan.calibration is None:
            raise ValueError("export.dtype=auto:<MB> needs the plan's calibration windows")
        windows = calibration_windows(plan.calibration.packed_dir, plan.calibration.seq_len)
        imx = None if plan.imatrix is None else corpus_imatrix(plain, plan.imatrix)
        if imx is not None:
            write_imatrix(tmp / IMATRIX_GGUF, imx)
        return export_auto(plain, tmp / MODEL_GGUF, tok_meta, keys, plan.dtype, windows, imx, IMATRIX_GGUF)
    if plan.imatrix is None:
        return export_gguf(plain, tmp / MODEL_GGUF, tok_meta, keys, plan.dtype), {}
    return export_with_imatrix(plain, tmp, MODEL_GGUF, tok_meta, keys, plan.dtype, plan.imatrix), {}


def run_image_export(train_dir: Path, out_dir: Path, dtype: str, keys: dict[str, Any]) -> dict[str, float]:
    """An image classifier (the ViT recipe) as `model.gguf` of its own architecture: every hyper-parameter,
    the class names and the pixel normalization as keys, `keys` (name, provenance) beside them. No
    tokenizer, no llama.cpp name or card: neither applies to it."""
    model = load_model_dir(train_dir)
    with atomic_dir(out_dir) as tmp:
        path = export_gguf(model, tmp / MODEL_GGUF, {}, keys, dtype)
        metrics = {"file_bytes": float(path.stat().st_size), "tensors": float(count_tensors(path))}
    return {**metrics, "parameters": float(sum(p.numel() for p in model.parameters()))}


def _facts(train_dir: Path, named: str, plan: ExportPlan, adapters: bool, base_file: str) -> CardFacts:
    """The card's numbers (the train stage's record of the weights it kept) and the adapter's base file."""
    state = read_train_state(train_dir)
    if state is None:
        return CardFacts(named, plan.dtype, has_adapters=adapters, base_file=base_file)
    metrics = {"val_loss": state.val_loss, "val_ppl": math.exp(state.val_loss)}
    if state.initial_val_loss is not None:
        metrics["initial_val_loss"] = state.initial_val_loss
    run_id = state.mlflow_run_id or ""
    return CardFacts(named, plan.dtype, metrics, state.steps, state.kept_step, adapters, run_id, base_file)


def _check_vocab(tok_meta: dict[str, Any], vocab_size: int, donor: Path) -> None:
    n_tokens = len(tok_meta["tokenizer.ggml.tokens"].value) if "tokenizer.ggml.tokens" in tok_meta else 0
    if n_tokens != vocab_size:
        raise GGUFError(
            problem(
                f"{donor} tokenizer.ggml.tokens",
                f"{vocab_size} tokens (the trained model's vocab)",
                str(n_tokens),
                "export with the donor the model was packed with",
            )
        )
