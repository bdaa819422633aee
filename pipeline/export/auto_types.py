"""`export.dtype=auto:<MB>`: each matrix's GGUF type chosen by measurement, within a file-size budget.

A fixed mix (Q4_K_M) spends its bits by llama.cpp's rule of thumb for large models; a small model's
matrices differ in how much each type costs it. So each matrix is quantized alone to each type its rows
allow (Q8_0, Q6_K, Q5_K, Q5_0, Q4_K, Q4_0; the K-quants need rows of 256 and llama-cpp-python's ggml),
and the model's KL from the f32 model is measured on a few train windows. The types that fit the budget
with the least summed KL are then found exactly (a knapsack; the KLs of separate matrices are taken as
additive: on the default student their sum was within 3% of the joint KL). The chosen types are written
by `quantize_gguf` (with the importance matrix when export.imatrix is on), logged, and kept in the file's
metadata (`pipeline.auto.*`).
"""

from __future__ import annotations

import logging
import math
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quants
from torch import nn

from pipeline.data.packed import load_split
from pipeline.errors import ConfigError, problem
from pipeline.gguf import ggml
from pipeline.gguf.imatrix_format import Imatrix, quantize_gguf
from pipeline.gguf.quantize import llamacpp_installed
from pipeline.gguf.reader import GGUFFile
from pipeline.models.registry import export_gguf, load_gguf

log = logging.getLogger(__name__)
PREFIX = "auto:"
LADDER = ("Q8_0", "Q6_K", "Q5_K", "Q5_0", "Q4_K", "Q4_0")  # 8.5, 6.6, 5.5, 5.5, 4.5, 4.5 bits per weight
K_TYPES = ("Q6_K", "Q5_K", "Q4_K")
WINDOWS = 4  # train windows the KL is measured on


def budget_mb(dtype: str) -> float | None:
    """The budget of `auto:<MB>` in MB (nan when malformed), or None for any other dtype."""
    if not dtype.startswith(PREFIX):
        return None
    try:
        return float(dtype[len(PREFIX) :])
    except ValueError:
        return math.nan


@dataclass(frozen=True)
class Step:
    """One type a matrix may take: its bytes in the file and the KL it alone adds."""

    qtype: str
    nbytes: int
    kl: float


def tensor_bytes(shape: tuple[int, ...], qtype: str) -> int:
    block, size = GGML_QUANT_SIZES[GGMLQuantizationType[qtype]]
    return int(np.prod(shape[:-1])) * (shape[-1] // block) * size


def ladder(cols: int) -> list[str]:
    """The types a matrix with rows of `cols` can take here, highest first."""
    k_ok = cols % 256 == 0 and llamacpp_installed()
    return [
        t for t in LADDER if cols % GGML_QUANT_SIZES[GGMLQuantizationType[t]][0] == 0 and (k_ok or t not in K_TYPES)
    ]


def round_trip(arr: np.ndarray, qtype: str) -> np.ndarray:
    """The values a file of `qtype` holds for `arr` (gguf-py for the legacy types, ggml for the K-quants)."""
    q = GGMLQuantizationType[qtype]
    if qtype in K_TYPES:
        return ggml.round_trip(arr.reshape(-1, arr.shape[-1]), q).reshape(arr.shape)
    return quants.dequantize(quants.quantize(arr, q), q).reshape(arr.shape)


def _kl(model: nn.Module, windows: torch.Tensor, ref: torch.Tensor) -> float:
    """Mean KL(f32 || model) per position over `windows`, `ref` being the f32 model's log-probs."""
    with torch.no_grad():
        logp = torch.log_softmax(model(windows).float(), dim=-1)
    return max(float((ref.exp() * (ref - logp)).sum(-1).mean()), 0.0)  # >= 0 up to fp32 rounding


def measure(model: nn.Module, matrices: dict[str, nn.Parameter], windows: torch.Tensor) -> dict[str, list[Step]]:
    """Each matrix's ladder of (type, bytes, KL when it alone takes that type), on `model` (the f32 file's)."""
    with torch.no_grad():
        ref = torch.log_softmax(model(windows).float(), dim=-1)
    steps: dict[str, list[Step]] = {}
    for name, param in matrices.items():
        kept = param.detach().clone()
        arr = kept.numpy()
        steps[name] = []
        for qtype in ladder(arr.shape[-1]):
            with torch.no_grad():
                param.copy_(torch.from_numpy(round_trip(arr, qtype)))
            steps[name].append(Step(qtype, tensor_bytes(arr.shape, qtype), _kl(model, windows, ref)))
        with torch.no_grad():
            param.copy_(kept)
    return steps


def choose(steps: dict[str, list[Step]], budget: int, cells: int = 20000) -> dict[str, Step]:
    """Every matrix's type: the least summed KL whose bytes fit `budget` (a multiple-choice knapsack, solved
    exactly by dynamic programming over the budget in `cells` units; each type's bytes rounded up to whole
    units, so the choice always fits). Greedy walks, by KL per byte or at a common price per byte, fail at a
    large matrix: the token table (a fifth of the file) moved down at once and left 7 MB unused, 0.025 nats of
    KL where the knapsack finds 0.014 on the default student. The bytes the rounding leaves then buy back the
    upgrades that remove the most KL per byte (`_fill`)."""
    names = list(steps)
    unit = max(1, budget // cells)
    n = budget // unit
    best = np.zeros(n + 1)  # least KL of the matrices so far within b units
    picks = np.zeros((len(names), n + 1), dtype=np.int8)
    for i, name in enumerate(names):
        new = np.full(n + 1, np.inf)
        for j, step in enumerate(steps[name]):
            u = -(-step.nbytes // unit)
            if u > n:
                continue
            cand = np.full(n + 1, np.inf)
            cand[u:] = best[: n + 1 - u] + step.kl
            better = cand < new
            new[better], picks[i][better] = cand[better], j
        best = new
    if not np.isfinite(best[n]):  # nothing fits: the smallest of each (the caller refuses such budgets)
        return {name: min(steps[name], key=lambda s: s.nbytes) for name in names}
    at, b = {}, n
    for i in range(len(names) - 1, -1, -1):
        step = steps[names[i]][picks[i][b]]
        at[names[i]] = step
        b -= -(-step.nbytes // unit)
    return _fill(steps, at, budget)


def _fill(steps: dict[str, list[Step]], at: dict[str, Step], budget: int) -> dict[str, Step]:
    """Upgrades that fit the bytes left, the most KL removed per byte added first, until none fits."""
    while True:
        room = budget - sum(s.nbytes for s in at.values())
        best: tuple[float, str, Step] | None = None
        for name, ladder in steps.items():
            for step in ladder:
                added, gain = step.nbytes - at[name].nbytes, at[name].kl - step.kl
                if 0 < added <= room and gain > 0 and (best is None or gain / added > best[0]):
                    best = (gain / added, name, step)
        if best is None:
            return at
        at[best[1]] = best[2]


FILE_TYPES = {"Q8_0": 7, "Q6_K": 18, "Q5_K": 17, "Q5_0": 8, "Q4_K": 15, "Q4_0": 2}  # llama_ftype of a mostly-X file


def matrices_of(model: nn.Module, g: GGUFFile) -> dict[str, nn.Parameter]:
    """The file's quantizable matrices (2-D, rows of whole Q8_0 blocks) -> the parameter of `model` (loaded
    from that file) that holds exactly its values."""
    params = list(model.parameters())
    out: dict[str, nn.Parameter] = {}
    for name in g.tensor_names():
        arr = g.tensor(name)
        if arr.ndim != 2 or arr.shape[-1] % 32:
            continue
        values = torch.from_numpy(np.ascontiguousarray(arr))
        match = next((p for p in params if p.shape == values.shape and torch.equal(p.detach(), values)), None)
        if match is not None and all(match is not q for q in out.values()):
            out[name] = match
    return out


def calibration_windows(packed_dir: Path, seq_len: int) -> torch.Tensor:
    """The first `WINDOWS` windows of `seq_len` tokens of the train split."""
    ids = load_split(packed_dir, "train")
    n = min(WINDOWS, len(ids) // seq_len)
    if n < 1:
        found = f"a train split of {len(ids)} tokens"
        raise ConfigError(
            problem(
                "config key export.dtype", f"auto: >= train.seq_len={seq_len} train tokens", found, "pack more text"
            )
        )
    return torch.from_numpy(np.asarray(ids[: n * seq_len], dtype=np.int64).reshape(n, seq_len))


def export_auto(
    model: nn.Module,
    out_path: Path,
    tok_meta: dict[str, Any],
    keys: dict[str, Any],
    dtype: str,
    windows: torch.Tensor,
    imx: Imatrix | None = None,
    imx_file: str = "",
) -> tuple[Path, dict[str, float]]:
    """`model` at `dtype` = auto:<MB> at `out_path`; the chosen types' counts, bytes and summed KL as metrics."""
    mb = budget_mb(dtype)
    with tempfile.TemporaryDirectory(dir=out_path.parent, prefix=".f32-") as tmp:
        f32 = export_gguf(model, Path(tmp) / "f32.gguf", tok_meta, keys, "f32")
        g = GGUFFile(f32)
        fmodel = load_gguf(f32)[0].eval()
        matrices = matrices_of(fmodel, g)
        steps = measure(fmodel, matrices, windows)
        fixed = f32.stat().st_size - sum(4 * p.numel() for p in matrices.values())
        floor = fixed + sum(min(s.nbytes for s in ladder) for ladder in steps.values())
        if mb is None or not mb * 1e6 >= floor:
            raise ConfigError(
                problem(
                    "config key export.dtype",
                    f"auto:<MB> of at least {math.ceil(floor / 1e6 * 10) / 10} (every matrix at its smallest type)",
                    dtype,
                    f"set export.dtype=auto:{math.ceil(floor / 1e6)} or more, or a fixed type such as q4_0",
                )
            )
        chosen = choose(steps, int(mb * 1e6) - fixed)
        counts = {t: sum(s.qtype == t for s in chosen.values()) for t in LADDER}
        majority = max(counts, key=lambda t: sum(s.nbytes for s in chosen.values() if s.qtype == t))
        extra = {"general.file_type": FILE_TYPES[majority], "pipeline.auto.budget_mb": float(mb)}
        extra["pipeline.auto.kl"] = float(sum(s.kl for s in chosen.values()))
        types = {name: s.qtype for name, s in chosen.items()}
        path = quantize_gguf(f32, out_path, "f32", imx, imx_file, types=types, extra=extra)
    used = ", ".join(f"{n} {t}" for t, n in counts.items() if n)
    log.info(
        f"export.dtype={dtype}: {used}; {path.stat().st_size / 1e6:.2f} MB, summed KL {extra['pipeline.auto.kl']:.4f}"
    )
    metrics = {f"auto_{t.lower()}": float(n) for t, n in counts.items()}
    return path, {**metrics, "auto_kl": extra["pipeline.auto.kl"]}
