"""Evaluate an exported GGUF through our own reader: proves the export is the trained model.

On instruct data the number is the held-out response NLL (prompt tokens masked), and with a base
GGUF (fine-tuning recipes) the base's NLL on the same rows is measured beside it.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

from pipeline.architectures import load_gguf
from pipeline.config import EvaluateConfig
from pipeline.errors import PipelineError
from pipeline.generate import default_stop_ids, generate_ids
from pipeline.instruct import response_nll
from pipeline.pack import load_data
from pipeline.tokenizer import tokenizer_from_gguf
from pipeline.train import is_rows, pick_device, validation_loss

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
    base_gguf: Path | None = None,
    instruct: Any = None,
) -> tuple[dict[str, float], list[dict[str, str]]]:
    """Val loss/perplexity of the GGUF and samples (greedy and temperature/top-k) per prompt.

    Instruct data (`instruct`: its InstructConfig): response NLL over the val rows, the base GGUF's
    beside it, and greedy answers of both to the first held-out prompts.
    """
    model, g = load_gguf(gguf_path)
    tok = tokenizer_from_gguf(g)
    dev = pick_device(device)
    model.to(dev)
    val = load_data(packed_dir, "val")
    val_loss = validation_loss(model, val, seq_len, batch_size, dev)
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
    if is_rows(val):
        return _evaluate_instruct(model, g, tok, packed_dir, val, batch_size, ecfg, dev, metrics, base_gguf, instruct)
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


def _evaluate_instruct(
    model: torch.nn.Module,
    g: Any,
    tok: Any,
    packed_dir: Path,
    val: Any,
    batch_size: int,
    ecfg: EvaluateConfig,
    dev: torch.device,
    metrics: dict[str, float],
    base_gguf: Path | None,
    instruct: Any,
) -> tuple[dict[str, float], list[dict[str, str]]]:
    """Base-model NLL beside the tuned one, and greedy answers of both to held-out prompts."""
    from pipeline.instruct import Formatter, read_instruct_jsonl

    base = None
    if base_gguf is not None:
        base, _ = load_gguf(base_gguf)
        base.to(dev)
        base_loss = response_nll(base, val, batch_size, dev)
        metrics.update(
            base_val_loss=base_loss,
            base_val_ppl=math.exp(base_loss),
            val_loss_improvement=base_loss - metrics["val_loss"],
        )
    examples = read_instruct_jsonl(Path(packed_dir) / "val.jsonl")[: len(ecfg.prompts)]
    fmt = Formatter(tok, g.metadata, instruct)
    stops = default_stop_ids(tok, chat=True)
    samples = []
    for ex in examples:
        ids, _ = fmt.encode(ex)
        sample = {"prompt": ex.messages[-1]["content"], "reference": ex.response}
        sample["tuned"] = tok.decode(generate_ids(model, ids, ecfg.max_new_tokens, stop_ids=stops))
        if base is not None:
            sample["base"] = tok.decode(generate_ids(base, ids, ecfg.max_new_tokens, stop_ids=stops))
        samples.append(sample)
    return metrics, samples
