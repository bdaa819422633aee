"""The realize stage: the initial model directory (models/init).

From scratch or warm-started: random init, then (optionally) the donor's knowledge in the
embeddings. `scratch`: random init only. `pca`: embedding rows are the PCA-projected donor rows,
rescaled to the init std. `lens`: the embedding table stays donor-width (centered donor rows) and a
trainable donor_d x d_model projection starts at the PCA components, so at step 0 `pca` and `lens`
compute the same function.

`subclone`: every weight from the donor (layers, heads, FFN neurons, the residual stream rotated
and sliced; pipeline/init/subclone.py), with the student's val loss before any training step.

A fine-tune (`recipe.init=base`): the base GGUF at donor.path, checked, with seeded adapters.
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch
from torch import nn

from pipeline.config import ModelConfig, RecipeConfig
from pipeline.data.packed import load_data, load_meta, load_split, window_bos
from pipeline.donor.calibrate import CALIBRATION_FILE, Calibration, checked_windows
from pipeline.donor.load import load_llama_donor, read_donor_embeddings, student_config
from pipeline.donor.pca import PCA_FILE, PCAResult
from pipeline.errors import ConfigError, problem
from pipeline.finetune.lora import trainable_summary
from pipeline.finetune.model import build_finetune
from pipeline.init.subclone import Selection, fit_gain, subclone, transfer_report
from pipeline.io.files import atomic_dir
from pipeline.modeldir import FinetuneSpec, save_model_dir
from pipeline.models.llama import Llama
from pipeline.models.ops.head_rows import HeadVocab, corpus_vocabulary, wants_corpus_vocab
from pipeline.models.registry import build_model
from pipeline.models.transformer import count_parameters, init_weights
from pipeline.models.vit import ViT, ViTConfig
from pipeline.models.vit_gguf import f32
from pipeline.training.batches import check_split_fits
from pipeline.training.validation import validation_loss

STEP0_TOKENS = 8192  # realize's step-0 val losses read at most this many val tokens (all of pydoc's 7k)


def realize(
    mcfg: ModelConfig,
    init: str,
    vocab_size: int,
    seed: int,
    lens: PCAResult | None = None,
    donor_table: np.ndarray | None = None,
    donor: Path | None = None,
) -> nn.Module:
    """Build and initialise the model; deterministic from `seed`.

    `lens` (the donor stage's PCA) is needed for `pca` and `lens`; `donor_table` (the donor's
    dequantized embedding rows) for `lens` only; `donor` (the GGUF) for model.arch=donor.
    """
    if init != "scratch" and lens is None:
        raise ConfigError(problem("recipe.init", "donor PCA outputs for init=" + init, "none", "run the donor stage"))
    if init == "lens" and donor_table is None:
        raise ConfigError(problem("recipe.init=lens", "the donor embedding table", "none", "pass the donor table"))
    donor_dim = lens.components.shape[1] if init == "lens" else 0
    if mcfg.arch == "donor" and donor is None:
        raise ConfigError(problem("model.arch=donor", "the donor GGUF (donor.path)", "none", "pass the donor"))
    model = build_model(student_config(mcfg, vocab_size, donor, donor_dim))
    init_weights(model, mcfg.init_std, seed)
    if init == "pca":
        _init_pca(model, lens, mcfg.init_std)
    elif init == "lens":
        _init_lens(model, lens, donor_table, mcfg.init_std)
    return model


def _scale(projected: np.ndarray, std: float) -> float:
    return std / float(projected.std())


def _init_pca(model: nn.Module, lens: PCAResult, std: float) -> None:
    rows, k = lens.projected.shape
    if k < model.cfg.d_model:
        raise ConfigError(
            problem(
                "model.d_model",
                f"at most the {k} PCA components the donor stage made",
                model.cfg.d_model,
                "re-run the donor stage",
            )
        )
    _check_rows(model, rows)
    table = lens.projected[:, : model.cfg.d_model]
    with torch.no_grad():
        model.tok_embd.weight.copy_(torch.from_numpy(table * _scale(table, std)))


def _init_lens(model: nn.Module, lens: PCAResult, donor_table: np.ndarray, std: float) -> None:
    rows, width = lens.projected.shape[0], lens.components.shape[1]
    _check_rows(model, rows)
    table = lens.projected[:, : model.cfg.d_model]
    scale = _scale(table, std)
    # unused components (d_model > k) start at zero: those dims begin as pure residual stream
    proj = np.zeros((model.cfg.d_model, width), dtype=np.float32)
    k = min(model.cfg.d_model, lens.components.shape[0])
    proj[:k] = lens.components[:k]
    with torch.no_grad():
        model.lens.weight.copy_(torch.from_numpy(proj))
        centered = (donor_table - lens.mean) * scale  # full donor rows: the lens may learn all dims
        model.tok_embd.weight.copy_(torch.from_numpy(centered.astype(np.float32)))


def _check_rows(model: nn.Module, rows: int) -> None:
    if rows != model.cfg.vocab_size:
        raise ConfigError(
            problem(
                "donor PCA table", f"{model.cfg.vocab_size} rows (packed vocab)", f"{rows}", "re-run the donor stage"
            )
        )


def run_realize(
    recipe: RecipeConfig,
    mcfg: ModelConfig,
    seed: int,
    donor: Path,
    packed_dir: Path,
    donor_dir: Path,
    out_dir: Path,
    seq_len: int = 128,
    softmax: str = "auto",
) -> dict[str, float]:
    """The realize stage: vocab from the packed data; a fine-tune's base, a subclone of the donor
    (its step-0 val loss at `seq_len`, over the softmax `softmax` (train.vocab) says), or a new model
    initialised from the donor stage's PCA (and, for lens, the donor table); written to `out_dir` atomically."""
    if mcfg.arch == "vit":
        return realize_vit(recipe, mcfg, seed, packed_dir, out_dir)
    vocab = load_meta(packed_dir).vocab_size
    if recipe.finetune:
        return realize_finetune(recipe, donor, vocab, out_dir)
    if recipe.init == "subclone":
        return realize_subclone(recipe, mcfg, seed, donor, packed_dir, donor_dir, out_dir, seq_len, softmax)
    lens = PCAResult.load(donor_dir / PCA_FILE) if recipe.init != "scratch" else None
    table = read_donor_embeddings(donor).table if recipe.init == "lens" else None
    model = realize(mcfg, recipe.init, vocab, seed, lens, table, Path(donor))
    with atomic_dir(out_dir) as tmp:
        save_model_dir(
            tmp, model, realize={"recipe": recipe.name, "init": recipe.init, "seed": seed, "model": asdict(mcfg)}
        )
    return {"parameters": float(count_parameters(model)), "vocab_size": float(vocab)}


def realize_vit(
    recipe: RecipeConfig, mcfg: ModelConfig, seed: int, packed_dir: Path, out_dir: Path
) -> dict[str, float]:
    """A ViT from scratch for the packed images (their size, channels, classes and normalization),
    seeded init (`models.transformer.init_weights`); `model.n_classes` must be the data's class count."""
    meta = load_meta(packed_dir)
    stats = meta.stats or {}
    if meta.format != "images":
        raise ConfigError(
            problem(str(packed_dir), "packed images for model.arch=vit", f"{meta.format} data", "use data=digits")
        )
    if mcfg.n_classes != meta.n_classes:
        raise ConfigError(
            problem(
                "config key model.n_classes",
                f"{meta.n_classes}, the classes in the data ({', '.join(stats.get('classes', []))[:80]})",
                str(mcfg.n_classes),
                f"set model.n_classes={meta.n_classes}",
            )
        )
    cfg = ViTConfig(
        image_size=stats["image_size"],
        patch_size=mcfg.patch_size,
        channels=stats["channels"],
        d_model=mcfg.d_model,
        n_layer=mcfg.n_layer,
        n_head=mcfg.n_head,
        d_ff=mcfg.d_ff,
        n_classes=mcfg.n_classes,
        norm_eps=mcfg.norm_eps,
        dropout=mcfg.dropout,
        class_names=tuple(stats["classes"]),
        pixel_mean=tuple(f32(x) for x in stats["mean"]),  # as the GGUF will hold them
        pixel_std=tuple(f32(x) for x in stats["std"]),
    ).check("config key model", "fix the model.* keys")
    model = ViT(cfg)
    init_weights(model, mcfg.init_std, seed)
    with atomic_dir(out_dir) as tmp:
        save_model_dir(
            tmp, model, realize={"recipe": recipe.name, "init": recipe.init, "seed": seed, "model": asdict(mcfg)}
        )
    return {
        "parameters": float(count_parameters(model)),
        "classes": float(cfg.n_classes),
        "patches": float(cfg.n_patches),
    }


def realize_finetune(recipe: RecipeConfig, base: Path, packed_vocab: int, out_dir: Path) -> dict[str, float]:
    """A fine-tune's realize: load and check the base, attach seeded adapters, write the spec (and
    the initial adapters) atomically. Returns the stage metrics."""
    spec = FinetuneSpec.of(recipe.mode, base, recipe.lora)
    model = build_finetune(spec.base, spec.mode, spec.lora_config())
    if model.cfg.vocab_size != packed_vocab:
        raise ConfigError(
            problem(
                f"base GGUF {spec.base}",
                f"{packed_vocab} tokens (the packed data's vocab)",
                str(model.cfg.vocab_size),
                "pack the data with the base's tokenizer: donor.path is both",
            )
        )
    with atomic_dir(out_dir) as tmp:
        record = {"recipe": recipe.name, "init": "base", "mode": spec.mode, "base": spec.base}
        save_model_dir(tmp, model, spec=spec, realize=record)
    counts = trainable_summary(model)
    return {
        "parameters": float(counts["total_params"]),
        "trainable_parameters": float(counts["trainable_params"]),
        "vocab_size": float(model.cfg.vocab_size),
    }


def load_calibration(donor: Llama, donor_dir: Path) -> Calibration:
    """The donor stage's calibration, checked against the donor it must describe."""
    path = Path(donor_dir) / CALIBRATION_FILE
    if not path.is_file():
        raise ConfigError(
            problem(str(path), "the donor calibration for recipe.init=subclone", "no such file", "run: dvc repro donor")
        )
    calib = Calibration.load(str(path))
    cfg = donor.cfg
    want = (cfg.d_model, cfg.n_layer, cfg.n_head, cfg.d_ff)
    found = (calib.basis.shape[0], *calib.head_energy.shape, calib.neuron_rms.shape[1])
    if found != want:
        raise ConfigError(
            problem(
                str(path), f"(width, layers, heads, d_ff) = {want} of the donor", str(found), "run: dvc repro donor"
            )
        )
    return calib


def realize_subclone(
    recipe: RecipeConfig,
    mcfg: ModelConfig,
    seed: int,
    donor_path: Path,
    packed_dir: Path,
    donor_dir: Path,
    out_dir: Path,
    seq_len: int,
    softmax: str = "auto",
) -> dict[str, float]:
    """Every weight from the donor (pipeline/init/subclone.py), the fp32 val loss before training, and
    `realize.json` saying what the student kept. Returns the stage metrics. A large vocabulary's losses
    (the gain fit's, the val losses) run over the ids the splits use (`train.vocab`), as training's do."""
    val = load_data(packed_dir, "val")
    if isinstance(val, np.ndarray):  # running text: the step-0 val loss needs one window, as train's does
        check_split_fits(len(val), "val", 1, seq_len)
    donor, _ = load_llama_donor(Path(donor_path))
    calib = load_calibration(donor, donor_dir)
    cfg = student_config(mcfg, load_meta(packed_dir).vocab_size, Path(donor_path))
    model, sel = subclone(donor, calib, cfg, recipe.subclone.layers)
    if wants_corpus_vocab(softmax, cfg.vocab_size):
        used = corpus_vocabulary([load_split(packed_dir, "train"), val], None, cfg.vocab_size)
        model.head_vocab = HeadVocab.of(used, cfg.vocab_size, 0)
    report = transfer_report(donor, model, calib, sel)
    val = first_tokens(val, STEP0_TOKENS)  # step-0 figures: a fixed share of a large val split is enough
    report["step0_val_loss_closed_form"] = validation_loss(model, val, seq_len, 8, torch.device("cpu"))
    settings = recipe.subclone
    if settings.head_fit_tokens:
        train, n = load_split(packed_dir, "train"), settings.head_fit_tokens
        ids = checked_windows(train, n, settings.calib_seq_len, cfg.context_length, "student", extra=1)
        report["head_fit_loss_before"], report["head_fit_loss_after"] = fit_gain(model, ids, settings.head_fit_iters)
    report["step0_val_loss"] = validation_loss(model, val, seq_len, 8, torch.device("cpu"))
    model.head_vocab = None
    record = {"recipe": recipe.name, "init": recipe.init, "seed": seed, "model": asdict(mcfg)}
    record["subclone"] = {**report, "seq_len": seq_len, "selection": _selection_record(sel)}
    with atomic_dir(out_dir) as tmp:
        save_model_dir(tmp, model, realize=record)
    return {**report, "vocab_size": float(cfg.vocab_size)}


def first_tokens(val: np.ndarray, n: int) -> np.ndarray:
    """A token split's first `n` + 1 tokens (each window's target included), keeping its BOS (`TokenSplit`)."""
    if not isinstance(val, np.ndarray) or len(val) <= n + 1:
        return val
    head = val[: n + 1].view(type(val))
    head.bos = window_bos(val)
    return head


def _selection_record(sel: Selection) -> dict[str, list]:
    """Which donor layers and heads the student kept (neurons: how many), for realize.json."""
    return {
        "layers": list(sel.layers),
        "q_heads": [list(q) for q in sel.q_heads],
        "kv_heads": [list(kv) for kv in sel.kv_heads],
        "neurons": [len(n) for n in sel.neurons],
    }
