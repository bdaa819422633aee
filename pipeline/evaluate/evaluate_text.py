"""The evaluate stage: the exported GGUF read back through our own reader, to prove it is the
trained model (its fp32 val loss equals the train stage's), plus samples.

On instruct data the number is the held-out response NLL (prompt tokens masked), and for a
fine-tune the base GGUF's NLL on the same rows is measured beside it.
"""

from __future__ import annotations

import gc
import logging
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from pipeline.config import EvaluateConfig, PipelineConfig
from pipeline.data.instruct import Formatter, read_instruct_jsonl
from pipeline.data.packed import Packed, data_files, is_rows, load_data, load_meta
from pipeline.data.teacher_cache import META_FILE as TEACH_META
from pipeline.data.teacher_cache import read_meta as read_teach_meta
from pipeline.data.teacher_cache import read_val_choice
from pipeline.errors import ConfigError, PipelineError, problem
from pipeline.evaluate.parity import check_parity, our_logits, parity_windows
from pipeline.evaluate.quantized import quant_metrics
from pipeline.gguf.quantize import K_QUANTS, llamacpp_installed
from pipeline.inference.sampling import generate_ids
from pipeline.inference.speculative import draft_acceptance
from pipeline.io.files import sha256_file
from pipeline.modeldir import read_train_state
from pipeline.models.devices import pick_device
from pipeline.models.registry import load_gguf
from pipeline.tokenizer.chat_template import default_stop_ids
from pipeline.tokenizer.gguf_tokenizer import GGUFTokenizer, tokenizer_from_gguf
from pipeline.training.batches import check_split_fits
from pipeline.training.runtime import trim_freed_memory
from pipeline.training.validation import response_nll, scored_windows, validation_loss

log = logging.getLogger(__name__)

# f32 export: the re-read model must reproduce the train stage's val loss this closely
F32_TOLERANCE = 1e-3


def run_evaluate(
    gguf: Path,
    packed_dir: Path,
    train_dir: Path,
    cfg: PipelineConfig,
    donor: Path,
    teach_dir: Path | None = None,
    val_sha256: str | None = None,
) -> tuple[dict[str, float], list[dict[str, str]]]:
    """Val loss/perplexity of the GGUF and samples (greedy and temperature/top-k) per prompt.

    Running text: also bits per byte, and beside it the donor's val loss from the teach stage's
    record (`teach_dir`, when it measured one on this val split at this seq_len) and the gap to it.

    Instruct data: response NLL over the val rows, the base GGUF's (`donor`) beside it for a
    fine-tune, and greedy answers of both to the first held-out prompts.

    With llama-cpp-python installed, also llama.cpp's agreement with us on the first val windows
    (pipeline.evaluate.parity; a mean KL above `evaluate.llamacpp_max_kl` fails). Running text with
    `evaluate.quant_types`: the export quantized to each type, scored beside it
    (pipeline.evaluate.quantized).

    One model at a time (the stage's peak RSS, docs/finetuning.md): the tuned model does all its
    work and is freed, then llama.cpp loads the file, then the base. `val_sha256`: the val file's,
    when the caller has hashed it already (the stage, for its val_data tag).
    """
    dev = pick_device(cfg.train.device)
    check_quant_types(cfg.evaluate.quant_types)  # before any model loads
    val = load_data(packed_dir, "val")
    if not is_rows(val):  # as train and teach check it: at least one window of train.seq_len to score
        check_split_fits(len(val), "val", 1, cfg.train.seq_len)
    windows = parity_windows(val, cfg.train.seq_len, cfg.evaluate.llamacpp_windows)
    tuned = _tuned(gguf, val, windows, packed_dir, train_dir, cfg, dev)
    release_memory()
    metrics = tuned.metrics
    metrics.update(check_parity(gguf, windows, tuned.logits, cfg.evaluate.llamacpp_max_kl))
    release_memory()  # llama.cpp's buffers
    if not is_rows(val):
        metrics.update(reference_metrics(metrics["val_loss"], packed_dir, teach_dir, cfg.train.seq_len, val_sha256))
        metrics.update(gap_closed(metrics, cfg.evaluate.baseline_val_loss))
        if "donor_val_loss" in metrics:  # the teach stage scored the donor on these same windows
            metrics.update(draft_metrics(tuned.choice, teach_dir))
        ev = cfg.evaluate
        metrics.update(quant_metrics(gguf, ev.quant_types, val, cfg.train.seq_len, cfg.train.batch_size, dev, windows))
    elif cfg.evaluate.quant_types:
        log.info("evaluate: evaluate.quant_types skipped (instruction rows: running text only for now)")
    if is_rows(val) and cfg.recipe.finetune:
        metrics.update(_base(donor, val, tuned, cfg, dev))
    return metrics, tuned.samples


@dataclass
class _Tuned:
    """What evaluate keeps of the tuned model once it is freed."""

    metrics: dict[str, float]
    samples: list[dict[str, str]]
    logits: list[torch.Tensor]  # ours over the parity windows, for llama.cpp to be compared with
    tok: GGUFTokenizer
    prompts: list[list[int]]  # instruct data: the formatted held-out prompts the base answers too
    choice: np.ndarray | None = None  # running text: its greedy choice at every val window position


def _tuned(
    gguf: Path,
    val: np.ndarray | Packed,
    windows: list[list[int]],
    packed_dir: Path,
    train_dir: Path,
    cfg: PipelineConfig,
    dev: torch.device,
) -> _Tuned:
    """The tuned model's val metrics, its logits over the parity windows and its samples."""
    model, g = load_gguf(gguf)
    g.release_pages()  # the weights are copied out; the file's pages would count a second time
    model.to(dev)
    metrics, choice = _val_metrics(model, val, cfg, dev, train_dir, gguf)
    logits = our_logits(model, windows)
    tok = tokenizer_from_gguf(g)
    if not is_rows(val):
        return _Tuned(metrics, _text_samples(model, tok, cfg.evaluate), logits, tok, [], choice)
    examples = read_instruct_jsonl(Path(packed_dir) / "val.jsonl")[: len(cfg.evaluate.prompts)]
    fmt = Formatter(tok, g.metadata, cfg.data)
    prompts = [fmt.encode(ex)[0] for ex in examples]
    samples = []
    for ex, ids in zip(examples, prompts):
        sample = {"prompt": ex.messages[-1]["content"], "reference": ex.response}
        sample["tuned"] = _answer(model, tok, ids, cfg.evaluate.max_new_tokens)
        samples.append(sample)
    return _Tuned(metrics, samples, logits, tok, prompts)


def _base(donor: Path, val: Packed, tuned: _Tuned, cfg: PipelineConfig, dev: torch.device) -> dict[str, float]:
    """The base's (`donor`'s) held-out response NLL beside the tuned one, and its greedy answers
    added to the tuned model's samples."""
    base, g = load_gguf(donor)
    g.release_pages()
    base.to(dev)
    base_loss = response_nll(base, val, cfg.train.batch_size, dev)
    for sample, ids in zip(tuned.samples, tuned.prompts):
        sample["base"] = _answer(base, tuned.tok, ids, cfg.evaluate.max_new_tokens)
    return {
        "base_val_loss": base_loss,
        "base_val_ppl": math.exp(base_loss),
        "val_loss_improvement": base_loss - tuned.metrics["val_loss"],
    }


def _answer(model: nn.Module, tok: GGUFTokenizer, ids: list[int], max_new_tokens: int) -> str:
    """A greedy chat answer, up to the end of the assistant's turn."""
    return tok.decode(generate_ids(model, ids, max_new_tokens, stop_ids=default_stop_ids(tok, chat=True)))


def check_quant_types(types: list[str]) -> None:
    """K-quants are written by llama.cpp's quantizer: without llama-cpp-python, one named line."""
    missing = [t for t in types if t in K_QUANTS]
    if missing and not llamacpp_installed():
        raise ConfigError(
            problem(
                "config key evaluate.quant_types",
                f"llama-cpp-python installed for {', '.join(missing)} (llama.cpp's quantizer writes K-quants)",
                "no llama_cpp module",
                "`make llamacpp`, or list only q8_0/q5_1/q5_0/q4_1/q4_0",
            )
        )


def release_memory() -> None:
    """Hand freed memory back to the OS: collect cycles, then (glibc) return the heap's free pages,
    which a freed model's many mid-sized tensors otherwise keep in RSS."""
    gc.collect()
    trim_freed_memory()


def _val_metrics(
    model: nn.Module, val: np.ndarray | Packed, cfg: PipelineConfig, dev: torch.device, train_dir: Path, gguf: Path
) -> tuple[dict[str, float], np.ndarray | None]:
    """The val loss, checked against the train stage's for the weights it kept (to 1e-3 for an f32
    export, or one at the type train.qat trained to), and on running text the greedy choices over its windows."""
    seq_len, batch = cfg.train.seq_len, cfg.train.batch_size
    choice = None
    if is_rows(val):
        val_loss = validation_loss(model, val, seq_len, batch, dev)
    else:
        val_loss, choice = scored_windows(model, val, seq_len, batch, dev)
    metrics = {"val_loss": val_loss, "val_ppl": math.exp(val_loss)}
    state = read_train_state(train_dir)
    if state is None:
        return metrics, choice
    trained, diff = state.val_loss, abs(val_loss - state.val_loss)
    metrics.update(trained_val_loss=trained, val_loss_abs_diff=diff)
    if state.kept_step is not None:
        metrics["kept_step"] = float(state.kept_step)
    if cfg.export.dtype in ("f32", cfg.train.qat) and diff > F32_TOLERANCE:  # QAT: it trained on these weights
        raise PipelineError(
            f"{gguf}: expected val loss {trained:.6f} (train stage) within {F32_TOLERANCE}, "
            f"found {val_loss:.6f}; fix: the export does not reproduce the trained model, re-run export"
        )
    return metrics, choice


def draft_metrics(choice: np.ndarray | None, teach_dir: Path | None) -> dict[str, float]:
    """This model as its donor's draft: agreement with the donor's greedy choices over the val
    windows (recorded by the teach stage) and the mean accepted run for draft lengths 1..8."""
    donor = None if choice is None or teach_dir is None else read_val_choice(teach_dir)
    if donor is None or donor.shape != choice.shape:
        return {}
    m = draft_acceptance(donor, choice)
    return {k: v for k, v in m.items() if not k.startswith("draft_tokens_per_call")}


def reference_metrics(
    val_loss: float, packed_dir: Path, teach_dir: Path | None, seq_len: int, val_sha256: str | None = None
) -> dict[str, float]:
    """`val_bpb` (nats per token -> bits per UTF-8 byte of the val text, by the split's token/byte
    ratio) when pack counted bytes; `donor_val_loss`, `donor_val_bpb` and `gap_to_donor` when the
    teach stage measured the donor on this val split at this seq_len (`val_sha256`: the val file's, if known)."""
    meta = load_meta(packed_dir)
    bits = meta.bits_per_token("val")
    out = {} if bits is None else {"val_bpb": val_loss * bits}
    if teach_dir is None or not (Path(teach_dir) / TEACH_META).is_file():
        return out
    teach = read_teach_meta(teach_dir)
    same_split = teach.val_sha256 == (val_sha256 or sha256_file(data_files(packed_dir)[2]))
    if teach.donor_val_loss is None or teach.seq_len != seq_len or not same_split:
        return out
    out.update(donor_val_loss=teach.donor_val_loss, gap_to_donor=val_loss - teach.donor_val_loss)
    if bits is not None:
        out["donor_val_bpb"] = teach.donor_val_loss * bits
    return out


def gap_closed(metrics: dict[str, float], baseline: float) -> dict[str, float]:
    """The fraction of the baseline-to-donor gap this student closes, (baseline - val) / (baseline - donor),
    when a baseline val loss (e.g. a from-scratch run of this shape) is given and above the donor's."""
    donor = metrics.get("donor_val_loss")
    if not baseline or donor is None or baseline <= donor:
        return {}
    return {"gap_closed": (baseline - metrics["val_loss"]) / (baseline - donor)}


def _text_samples(model: nn.Module, tok: GGUFTokenizer, ecfg: EvaluateConfig) -> list[dict[str, str]]:
    stops = tuple(i for i in (tok.eos_id,) if i is not None)
    samples = []
    for prompt in ecfg.prompts:
        ids = tok.encode(prompt)
        if tok.add_bos and tok.bos_id is not None:
            ids = [tok.bos_id, *ids]
        greedy = generate_ids(model, ids, ecfg.max_new_tokens, stop_ids=stops)
        sampled = generate_ids(model, ids, ecfg.max_new_tokens, ecfg.temperature, ecfg.top_k, ecfg.seed, stops)
        samples.append({"prompt": prompt, "greedy": tok.decode(greedy), "sampled": tok.decode(sampled)})
    return samples
