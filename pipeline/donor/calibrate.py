"""Donor calibration for `recipe.init=subclone`: what the donor does on real text, measured once.

The donor runs (bf16 autocast where the CPU has bf16 instructions) over a few ten-thousand tokens of
the packed train split while hooks collect, per token:

- the residual stream at every RMSNorm input (before each block's attention and FFN, and the final
  norm), normalised per token as RMSNorm does, so each position's second moment is about direction,
  not scale; their mean gives the basis the student's residual stream is rotated into and sliced
  along (SliceGPT's PCA, shared by all layers as in weight subcloning, so one rotation of the
  embedding table serves every block; outlier coordinates stay axes of their own, see
  `residual_basis`);
- the energy of each position along each basis direction (slicing keeps a known fraction of it,
  which realize uses to undo the 1/sqrt(d) scale change of RMSNorm);
- the block influence of each layer (ShortGPT: 1 - cos(block input, block output));
- the energy each attention head writes into the residual stream (through its `wo` columns);
- the RMS activation of each FFN neuron (the input of `ffn.down`);
- the second moment of the final norm's normalised output, to fit a tied head's norm weight;
- each head's share of attention on the previous token and on an induction target (`circuits`).
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, fields
from pathlib import Path

import numpy as np
import torch
from safetensors.numpy import load_file, save_file

from pipeline.config import ModelConfig, SubcloneConfig
from pipeline.config.checks import check
from pipeline.data.packed import begin_with_bos, load_meta, load_split, window_bos
from pipeline.donor.circuits import copy_scores
from pipeline.donor.load import load_llama_donor, student_config
from pipeline.errors import ConfigError, DataError, GGUFError, problem
from pipeline.io.files import atomic_dir
from pipeline.models.devices import native_bf16
from pipeline.models.llama import Llama
from pipeline.models.transformer import TransformerConfig

CALIBRATION_FILE = "calibration.safetensors"


@dataclass
class Calibration:
    """The donor's measured statistics (float32 arrays); slicing keeps the first columns of `basis`."""

    basis: np.ndarray  # (D, D) orthonormal columns: outlier axes, then principal directions (`residual_basis`)
    variance: np.ndarray  # (D,) mean squared projection of the normalised residual along each (sums to ~D)
    position_energy: np.ndarray  # (2L+1, D) each norm input's energy fraction per basis direction
    final_moment: np.ndarray  # (D, D) E[u u^T] of the final norm's input, normalised (u = x/rms(x))
    layer_influence: np.ndarray  # (L,) 1 - E[cos(x_in, x_out)] per block
    head_energy: np.ndarray  # (L, H) E||head's output through wo||^2 per query head
    neuron_rms: np.ndarray  # (L, F) sqrt(E[act^2]) of each FFN neuron (input of ffn.down)
    tokens: np.ndarray  # (1,) how many tokens were measured
    post_energy: np.ndarray  # (2L, D) post norms' inputs (Gemma 3): energy fraction per basis direction; (0, D) if none
    head_induction: np.ndarray  # (L, H) attention share on the induction target of a repeated sequence (`circuits`)
    head_previous: np.ndarray  # (L, H) attention share on the previous token

    def save(self, path: str) -> None:
        save_file({f.name: np.ascontiguousarray(getattr(self, f.name), np.float32) for f in fields(self)}, path)

    @classmethod
    def load(cls, path: str) -> Calibration:
        t = load_file(path)
        missing = [f.name for f in fields(cls) if f.name not in t]
        if missing:
            expected = "a donor calibration with every statistic"
            raise DataError(problem(path, expected, f"no {', '.join(missing)}", "re-run the donor stage"))
        return cls(**{f.name: t[f.name] for f in fields(cls)})

    def kept_fraction(self, k: int) -> float:
        """The fraction of the residual stream's (normalised) energy the first k directions hold."""
        return float(self.variance[:k].sum() / self.variance.sum())


class _Stats:
    """Running sums over tokens, in float64; filled by the hooks `attach` registers."""

    def __init__(self, model: Llama):
        cfg = model.cfg
        d, n = cfg.d_model, cfg.n_layer
        self.model = model
        self.moments = torch.zeros(2 * n + 1, d, d, dtype=torch.float64)
        self.cos = torch.zeros(n, dtype=torch.float64)
        self.heads = torch.zeros(n, cfg.n_head, dtype=torch.float64)
        self.neurons = torch.zeros(n, cfg.d_ff, dtype=torch.float64)
        self.post = torch.zeros(2 * n if cfg.family.post_norms else 0, d, dtype=torch.float64)
        self.tokens = 0

    def residual(self, position: int, x: torch.Tensor) -> None:
        u = x.detach().float().flatten(0, 1)
        u = u * torch.rsqrt(u.pow(2).mean(-1, keepdim=True) + 1e-12)
        self.moments[position] += (u.T @ u).double()

    def branch(self, position: int, y: torch.Tensor) -> None:
        """A post norm's input, normalised per token: its energy per channel (the basis permutes channels)."""
        u = y.detach().float().flatten(0, 1)
        self.post[position] += (u.pow(2) / u.pow(2).mean(-1, keepdim=True).clamp_min(1e-30)).sum(0).double()

    def block(self, layer: int, x_in: torch.Tensor, x_out: torch.Tensor) -> None:
        cos = torch.nn.functional.cosine_similarity(x_in.float(), x_out.float(), dim=-1)
        self.cos[layer] += cos.double().sum()

    def head_outputs(self, layer: int, y: torch.Tensor) -> None:
        """Per head h: ||y_h @ wo_h^T||^2 summed over tokens, from y's per-head second moment."""
        wo = self.model.blocks[layer].attn.wo.weight.detach().float()  # (D, H*hd)
        hd = self.model.cfg.head_dim
        yh = y.detach().float().flatten(0, 1).unflatten(-1, (-1, hd))  # (N, H, hd)
        moment = torch.einsum("nhi,nhj->hij", yh, yh)  # (H, hd, hd)
        gram = torch.einsum("dhi,dhj->hij", wo.unflatten(-1, (-1, hd)), wo.unflatten(-1, (-1, hd)))
        self.heads[layer] += (moment * gram).sum((-1, -2)).double()

    def ffn_acts(self, layer: int, act: torch.Tensor) -> None:
        self.neurons[layer] += act.detach().float().flatten(0, 1).pow(2).sum(0).double()


def _attach(stats: _Stats) -> list[torch.utils.hooks.RemovableHandle]:
    """Hooks on every block: residual at both norm inputs, block in/out, wo input, down input."""
    model, handles = stats.model, []

    def pre(fn: Callable[[torch.Tensor], None]) -> Callable:
        return lambda _module, args: fn(args[0])

    for i, block in enumerate(model.blocks):
        handles.append(block.attn_norm.register_forward_pre_hook(pre(lambda x, i=i: stats.residual(2 * i, x))))
        handles.append(block.ffn_norm.register_forward_pre_hook(pre(lambda x, i=i: stats.residual(2 * i + 1, x))))
        handles.append(block.register_forward_hook(lambda _m, args, out, i=i: stats.block(i, args[0], out)))
        handles.append(block.attn.wo.register_forward_pre_hook(pre(lambda y, i=i: stats.head_outputs(i, y))))
        handles.append(block.ffn.down.register_forward_pre_hook(pre(lambda a, i=i: stats.ffn_acts(i, a))))
        if hasattr(block, "post_attn_norm"):
            for j, norm in enumerate((block.post_attn_norm, block.post_ffn_norm)):
                handles.append(norm.register_forward_pre_hook(pre(lambda y, p=2 * i + j: stats.branch(p, y))))
    n = model.cfg.n_layer
    handles.append(model.norm.register_forward_pre_hook(pre(lambda x: stats.residual(2 * n, x))))
    return handles


def windows(tokens: np.ndarray, n_tokens: int, seq_len: int) -> torch.Tensor:
    """`n_tokens // seq_len` windows of `seq_len` tokens, evenly spread over the split (deterministic)."""
    n = max(1, n_tokens // seq_len)
    starts = np.linspace(0, len(tokens) - seq_len, n).astype(np.int64)
    rows = np.stack([np.asarray(tokens[s : s + seq_len], dtype=np.int64) for s in starts])
    return torch.from_numpy(begin_with_bos(rows, window_bos(tokens)))


def check_calib_fits(n_train: int, calib_seq_len: int, context_length: int, model: str, extra: int = 0) -> None:
    """A one-line ConfigError unless a window of `calib_seq_len + extra` tokens (realize's head fit: one
    more) fits in the train split's `n_train` tokens and `calib_seq_len` in `model`'s context_length: a
    small corpus or a long recipe.subclone.calib_seq_len is named, not a numpy or model traceback."""
    limit = min(n_train - extra, context_length)  # the model sees calib_seq_len tokens of each window
    if calib_seq_len <= limit:
        return
    fix = f"set recipe.subclone.calib_seq_len={limit}" if limit >= 2 else "pack a larger corpus"
    if 2 <= limit < context_length:
        fix += ", or pack a larger corpus"
    raise ConfigError(
        problem(
            "config key recipe.subclone.calib_seq_len",
            f"at most {limit} (the train split has {n_train} tokens, the {model}'s context_length is "
            f"{context_length}{'; the head fit reads one token more' if extra else ''})",
            str(calib_seq_len),
            fix,
        )
    )


def checked_windows(
    tokens: np.ndarray, n_tokens: int, calib_seq_len: int, context_length: int, model: str, extra: int = 0
) -> torch.Tensor:
    """`windows` of `calib_seq_len + extra` tokens, after `check_calib_fits`."""
    check_calib_fits(len(tokens), calib_seq_len, context_length, model, extra)
    return windows(tokens, n_tokens, calib_seq_len + extra)


@torch.no_grad()
def calibrate(
    model: Llama, ids: torch.Tensor, outlier_factor: float = 20.0, batch_size: int = 8, bf16: bool = True
) -> Calibration:
    """Run `model` over the (n, seq_len) token windows `ids` and reduce what the hooks saw."""
    stats = _Stats(model)
    handles = _attach(stats)
    try:
        for i in range(0, ids.shape[0], batch_size):
            batch = ids[i : i + batch_size]
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                model.hidden(batch)
            stats.tokens += batch.numel()
    finally:
        for h in handles:
            h.remove()
    return _reduce(stats, outlier_factor, copy_scores(model, ids))


def residual_basis(moment: torch.Tensor, outlier_factor: float) -> torch.Tensor:
    """(D, D) orthonormal columns: the outlier coordinates first, as they are, then the PCA of the rest.

    A coordinate holding more than `outlier_factor`/D of the energy (the "massive activations" of
    llama-style models: SmolLM2 has three with half of it) stays an axis of its own. Rotating it
    into the bulk would mix its final-norm gain (often negative) with the others', which no tied
    head can undo; kept as an axis, its gain stays exact. The rest is rotated by its PCA.
    """
    d = moment.shape[0]
    share = moment.diagonal() / moment.diagonal().sum()
    outliers = torch.nonzero(share > outlier_factor / d).flatten()
    outliers = outliers[torch.argsort(share[outliers], descending=True)]
    rest = torch.tensor([i for i in range(d) if i not in set(outliers.tolist())], dtype=torch.long)
    variance, vectors = torch.linalg.eigh(moment[rest][:, rest])
    basis = torch.zeros(d, d, dtype=moment.dtype)
    basis[outliers, torch.arange(len(outliers))] = 1.0
    basis[rest.unsqueeze(1), torch.arange(len(outliers), d)] = vectors[:, torch.argsort(variance, descending=True)]
    return basis


def channel_basis(moment: torch.Tensor) -> torch.Tensor:
    """(D, D) a permutation: the residual's own coordinates, the most energetic first. A block whose branch
    is normalised before the residual add (Gemma 3's post norms) writes each coordinate through its own
    norm weight, which no rotation of the stream commutes with; slicing whole coordinates keeps it exact."""
    order = torch.argsort(moment.diagonal(), descending=True, stable=True)
    basis = torch.zeros_like(moment)
    basis[order, torch.arange(len(order))] = 1.0
    return basis


def _reduce(stats: _Stats, outlier_factor: float, copying: tuple[np.ndarray, np.ndarray]) -> Calibration:
    """Means over tokens, the residual basis of the mean position moment, each position's energy along it."""
    n = float(stats.tokens)
    moments = stats.moments / n  # each (D, D) with trace ~D: positions count equally
    mean = moments.mean(0)
    post = stats.model.cfg.family.post_norms
    basis = channel_basis(mean) if post else residual_basis(mean, outlier_factor)
    variance = (basis.T @ mean @ basis).diagonal().clamp_min(0)
    energy = torch.einsum("pij,ik,jk->pk", moments, basis, basis)
    energy = energy / energy.sum(-1, keepdim=True)
    return Calibration(
        basis=basis.float().numpy(),
        variance=variance.float().numpy(),
        position_energy=energy.float().numpy(),
        final_moment=moments[-1].float().numpy(),
        layer_influence=(1.0 - stats.cos / n).float().numpy(),
        head_energy=(stats.heads / n).float().numpy(),
        neuron_rms=(stats.neurons / n).sqrt().float().numpy(),
        tokens=np.array([n], dtype=np.float32),
        post_energy=((stats.post / n) @ basis.abs() / stats.model.cfg.d_model).float().numpy(),
        head_induction=copying[0],
        head_previous=copying[1],
    )


def check_donor(donor: Llama, path: Path, packed_vocab: int, packed_meta: Path, student: TransformerConfig) -> None:
    """The donor's rows must be the packed token ids, and the student fit inside the donor (every key
    at once, here: realize would otherwise find a mismatch only after calibration and the teach cache)."""
    cfg = donor.cfg
    if cfg.vocab_size != packed_vocab:
        raise GGUFError(
            problem(
                f"{path} token_embd.weight",
                f"{packed_vocab} rows (the vocab of the packed data in {packed_meta})",
                f"{cfg.vocab_size} rows",
                "pack the corpus with this donor's tokenizer (dvc repro pack) or use the matching donor",
            )
        )
    check_student(student, cfg)


def check_student(cfg: TransformerConfig, donor: TransformerConfig) -> None:
    """The student must fit inside the donor: a named error for the first key that does not."""
    check(
        cfg.vocab_size == donor.vocab_size,
        "donor.path",
        f"a donor with the packed data's {cfg.vocab_size} tokens",
        donor.vocab_size,
        "pack the corpus with this donor's tokenizer (dvc repro pack)",
    )
    check(
        cfg.arch == donor.arch,
        "model.arch",
        f"the donor's {donor.arch} for recipe.init=subclone",
        cfg.arch,
        "set model.arch=donor",
    )
    for key in ("d_model", "n_layer", "d_ff"):
        found, limit = getattr(cfg, key), getattr(donor, key)
        also = f" (0 takes donor.student's cut: or set donor.student.deep.n_layer<={limit})" if key == "n_layer" else ""
        check(found <= limit, f"model.{key}", f"at most the donor's {limit}", found, f"set model.{key}<={limit}{also}")
    hd = donor.head_dim
    check(
        cfg.head_dim == hd,
        "model.n_head",
        f"model.d_model/model.n_head = the donor's head size {hd}",
        f"{cfg.d_model}/{cfg.n_head} = {cfg.head_dim}",
        f"set model.n_head={cfg.d_model // hd}" if cfg.d_model % hd == 0 else f"use a model.d_model divisible by {hd}",
    )
    _check_groups(cfg, donor)
    for key in ("rope_theta", "norm_eps"):
        found, want = getattr(cfg, key), getattr(donor, key)
        check(
            math.isclose(found, want, rel_tol=1e-5),
            f"model.{key}",
            f"the donor's {want:g}",
            found,
            f"set model.{key}={want:g}",
        )


def _check_groups(cfg: TransformerConfig, donor: TransformerConfig) -> None:
    """Each student kv group must be query heads of one donor kv group (see `select_heads`)."""
    r, s = donor.n_head // donor.n_kv_head, cfg.n_head // cfg.n_kv_head
    groups = donor.n_kv_head * (r // s)
    expected = f"n_head/n_kv_head at most the donor's group size {r}"
    if s <= r:
        expected += f", and n_kv_head at most the {groups} groups of {s} query heads it offers"
    check(
        s <= r and cfg.n_kv_head <= groups,
        "model.n_kv_head",
        expected,
        f"{cfg.n_kv_head} (groups of {s})",
        f"set model.n_kv_head to a divisor of model.n_head={cfg.n_head} of at least {-(-cfg.n_head // r)}",
    )


def run_calibration(
    donor_path: Path, packed_dir: Path, mcfg: ModelConfig, settings: SubcloneConfig, out_dir: Path
) -> tuple[Calibration, dict[str, float]]:
    """The donor stage for `recipe.init=subclone`: load, check the student of shape `mcfg` fits, calibrate
    on the train split, save `calibration.safetensors` + `meta.json` atomically. Returns the calibration
    and the metrics."""
    donor, gguf = load_llama_donor(Path(donor_path))
    vocab = load_meta(packed_dir).vocab_size
    student = student_config(mcfg, vocab, Path(donor_path))
    check_donor(donor, Path(donor_path), vocab, Path(packed_dir) / "meta.json", student)
    d_model = student.d_model
    train = load_split(packed_dir, "train")
    ids = checked_windows(train, settings.calib_tokens, settings.calib_seq_len, donor.cfg.context_length, "donor")
    if settings.head_fit_tokens:  # realize's head fit: fail here, not one stage later
        check_calib_fits(len(train), settings.calib_seq_len, student.context_length, "student", extra=1)
    start = time.perf_counter()
    calib = calibrate(donor, ids, settings.outlier_factor, bf16=native_bf16(torch.device("cpu")))
    seconds = time.perf_counter() - start
    outliers = int((calib.basis.max(0) > 1 - 1e-6).sum())
    cfg = donor.cfg
    info = {
        "path": str(donor_path),
        "architecture": gguf.architecture,
        "width": cfg.d_model,
        "vocab": cfg.vocab_size,
        "layers": cfg.n_layer,
        "heads": cfg.n_head,
        "kv_heads": cfg.n_kv_head,
        "d_ff": cfg.d_ff,
        "calibration_tokens": int(calib.tokens[0]),
        "outlier_axes": outliers,
    }
    with atomic_dir(out_dir) as tmp:
        calib.save(str(tmp / CALIBRATION_FILE))
        (tmp / "meta.json").write_text(json.dumps(info, indent=2) + "\n")
    metrics = {
        "explained_variance_total": calib.kept_fraction(d_model),
        "donor_width": float(cfg.d_model),
        "components": float(d_model),
        "calibration_tokens": float(calib.tokens[0]),
        "calibration_tokens_per_second": float(calib.tokens[0]) / seconds,
        "outlier_axes": float(outliers),
        "max_layer_influence": float(calib.layer_influence.max()),
        "min_layer_influence": float(calib.layer_influence.min()),
    }
    return calib, metrics
