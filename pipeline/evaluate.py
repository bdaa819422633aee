"""Evaluate an exported GGUF through our own reader: proves the export is the trained model."""

from __future__ import annotations

import math
from pathlib import Path

from pipeline.architectures import load_gguf
from pipeline.config import EvaluateConfig
from pipeline.errors import PipelineError
from pipeline.generate import generate_ids
from pipeline.pack import load_split
from pipeline.tokenizer import tokenizer_from_gguf
from pipeline.train import evaluate_loss, pick_device

# f32 export: the re-read model must reproduce the train stage's val loss this closely
F32_TOLERANCE = 1e-3


def run_evaluate(
    gguf_path: Path,
    packed_dir: Path,
    seq_len: int,
    batch_size: int,
    ecfg: EvaluateConfig,
    trained_val_loss: float | None,
    export_dtype: str,
    device: str = "auto",
) -> tuple[dict[str, float], list[dict[str, str]]]:
    """Val loss/perplexity of the GGUF and samples (greedy and temperature/top-k) per prompt."""
    model, g = load_gguf(gguf_path)
    tok = tokenizer_from_gguf(g)
    dev = pick_device(device)
    model.to(dev)
    val_loss = evaluate_loss(model, load_split(packed_dir, "val"), seq_len, batch_size, dev)
    metrics = {"val_loss": val_loss, "val_ppl": math.exp(val_loss)}
    if trained_val_loss is not None:
        diff = abs(val_loss - trained_val_loss)
        metrics["trained_val_loss"] = trained_val_loss
        metrics["val_loss_abs_diff"] = diff
        if export_dtype == "f32" and diff > F32_TOLERANCE:
            raise PipelineError(
                f"{gguf_path}: expected val loss {trained_val_loss:.6f} (train stage) within {F32_TOLERANCE}, "
                f"found {val_loss:.6f}; fix: the export does not reproduce the trained model, re-run export"
            )
    stops = tuple(i for i in (tok.eos_id,) if i is not None)
    samples = []
    for prompt in ecfg.prompts:
        ids = tok.encode(prompt)
        if tok.add_bos and tok.bos_id is not None:
            ids = [tok.bos_id, *ids]
        greedy = generate_ids(model, ids, ecfg.max_new_tokens, stop_ids=stops)
        sampled = generate_ids(model, ids, ecfg.max_new_tokens, ecfg.temperature, ecfg.top_k, ecfg.seed, stops)
        samples.append({"prompt": prompt, "greedy": tok.decode(greedy), "sampled": tok.decode(sampled)})
    return metrics, samples
