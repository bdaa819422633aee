"""The export stage: the trained model as a GGUF that llama.cpp and transformers load, with the
donor's tokenizer and our provenance; for a LoRA/QLoRA fine-tune also the adapter as a llama.cpp
LoRA GGUF and as a PEFT directory. Everything lands in `out_dir` at once (temp dir + rename)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pipeline.errors import GGUFError, problem
from pipeline.files import atomic_dir
from pipeline.finetune.adapters import export_merged_gguf, save_adapter_gguf, save_peft_adapter
from pipeline.finetune.lora import lora_layers
from pipeline.gguf.header import count_tensors
from pipeline.gguf.reader import GGUFFile, donor_tokenizer_metadata
from pipeline.modeldir import load_model_dir

MODEL_GGUF, ADAPTER_GGUF, PEFT_DIR = "model.gguf", "adapter.gguf", "peft"


def run_export(
    train_dir: Path, donor: Path, out_dir: Path, dtype: str, provenance: dict[str, Any], lora_dropout: float = 0.0
) -> dict[str, float]:
    """`model.gguf` (adapters merged, quantized layers dequantized) in `dtype`, plus `adapter.gguf`
    and `peft/` when the model carries LoRA adapters; returns the stage metrics."""
    model = load_model_dir(train_dir)
    tok_meta = donor_tokenizer_metadata(GGUFFile(donor))
    n_tokens = len(tok_meta["tokenizer.ggml.tokens"].value) if "tokenizer.ggml.tokens" in tok_meta else 0
    if n_tokens != model.cfg.vocab_size:
        raise GGUFError(
            problem(
                f"{donor} tokenizer.ggml.tokens",
                f"{model.cfg.vocab_size} tokens (the trained model's vocab)",
                str(n_tokens),
                "export with the donor the model was packed with",
            )
        )
    with atomic_dir(out_dir) as tmp:
        merged = export_merged_gguf(model, tmp / MODEL_GGUF, tok_meta, provenance, dtype)
        metrics = {"file_bytes": float(merged.stat().st_size), "tensors": float(count_tensors(merged))}
        if lora_layers(model):
            adapter = save_adapter_gguf(model, tmp / ADAPTER_GGUF, provenance)
            save_peft_adapter(model, tmp / PEFT_DIR, base_model=str(donor), dropout=lora_dropout)
            metrics["adapter_bytes"] = float(adapter.stat().st_size)
            metrics["peft_bytes"] = float((tmp / PEFT_DIR / "adapter_model.safetensors").stat().st_size)
    return metrics
