"""Realize the initial model: random init, then (optionally) the donor's knowledge in the embeddings.

`scratch`: random init only. `pca`: embedding rows are the PCA-projected donor rows, rescaled to
the init std. `lens`: the embedding table stays donor-width (centered donor rows) and a trainable
donor_d x d_model projection starts at the PCA components, so at step 0 `pca` and `lens` compute
the same function.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from pipeline.architectures import build_model, init_model
from pipeline.config import ModelConfig
from pipeline.donor import PCAResult
from pipeline.errors import ConfigError, problem
from pipeline.model import TransformerConfig


def llama_config(mcfg: ModelConfig, vocab_size: int, donor_dim: int = 0) -> TransformerConfig:
    return TransformerConfig(
        vocab_size=vocab_size,
        d_model=mcfg.d_model,
        n_layer=mcfg.n_layer,
        n_head=mcfg.n_head,
        n_kv_head=mcfg.n_kv_head,
        d_ff=mcfg.d_ff,
        context_length=mcfg.context_length,
        rope_theta=mcfg.rope_theta,
        norm_eps=mcfg.norm_eps,
        tie_embeddings=mcfg.tie_embeddings,
        donor_dim=donor_dim,
        arch=mcfg.arch,
    )


def realize(
    mcfg: ModelConfig,
    init: str,
    vocab_size: int,
    seed: int,
    lens: PCAResult | None = None,
    donor_table: np.ndarray | None = None,
) -> nn.Module:
    """Build and initialise the model; deterministic from `seed`.

    `lens` (the donor stage's PCA) is needed for `pca` and `lens`; `donor_table` (the donor's
    dequantized embedding rows) for `lens` only.
    """
    if init != "scratch" and lens is None:
        raise ConfigError(problem("recipe.init", "donor PCA outputs for init=" + init, "none", "run the donor stage"))
    if init == "lens" and donor_table is None:
        raise ConfigError(problem("recipe.init=lens", "the donor embedding table", "none", "pass the donor table"))
    donor_dim = lens.components.shape[1] if init == "lens" else 0
    cfg = llama_config(mcfg, vocab_size, donor_dim)
    model = build_model(cfg)
    init_model(model, mcfg.init_std, seed)
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


def save_model(model: nn.Module, out_dir: Path) -> None:
    """Weights (safetensors) + config (JSON): everything needed to rebuild the module."""
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    save_file(state, str(out_dir / "model.safetensors"))
    (out_dir / "config.json").write_text(model.cfg.to_json() + "\n")


def load_model(model_dir: Path) -> nn.Module:
    """The inverse of `save_model`."""
    model_dir = Path(model_dir)
    for name in ("config.json", "model.safetensors"):
        if not (model_dir / name).is_file():
            raise ConfigError(
                problem(str(model_dir / name), "a saved model file", "no such file", "run the stage that writes it")
            )
    model = build_model(TransformerConfig.load(model_dir / "config.json"))
    model.load_state_dict(load_file(str(model_dir / "model.safetensors")), strict=True)
    return model


def run_realize(
    mcfg: ModelConfig, init: str, seed: int, packed_dir: Path, donor_dir: Path, out_dir: Path
) -> dict[str, float]:
    """The realize stage: vocab from the packed data, donor PCA (and table for lens), save."""
    import json

    from pipeline.atomic import atomic_dir
    from pipeline.donor import read_donor_embeddings
    from pipeline.model import count_parameters
    from pipeline.pack import load_meta

    vocab = load_meta(packed_dir).vocab_size
    lens = PCAResult.load(donor_dir / "pca.safetensors") if init != "scratch" else None
    table = None
    if init == "lens":
        donor_meta = json.loads((donor_dir / "meta.json").read_text())
        table = read_donor_embeddings(Path(donor_meta["path"])).table
    model = realize(mcfg, init, vocab, seed, lens, table)
    with atomic_dir(out_dir) as tmp:
        save_model(model, tmp)
        (tmp / "realize.json").write_text(json.dumps({"init": init, "seed": seed}, indent=2) + "\n")
    return {"parameters": float(count_parameters(model)), "vocab_size": float(vocab)}
