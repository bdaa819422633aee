"""The donor stage: read a donor GGUF's embedding table and compute the PCA lens onto the new
model's width (`data/donor/pca.safetensors` + `meta.json`)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.numpy import load_file, save_file

from pipeline.donor.load import DonorEmbeddings, read_donor_embeddings
from pipeline.errors import DataError, GGUFError, problem
from pipeline.io.files import atomic_dir
from pipeline.models.names import TOKEN_EMBD as EMBEDDING_TENSOR

PCA_FILE = "pca.safetensors"


@dataclass
class PCAResult:
    """Centered PCA of the donor table: `projected = (table - mean) @ components.T`."""

    components: np.ndarray  # (k, width), orthonormal rows
    mean: np.ndarray  # (width,)
    projected: np.ndarray  # (vocab, k)
    explained_variance_ratio: np.ndarray  # (k,)

    def save(self, path: Path) -> None:
        save_file(
            {
                "components": np.ascontiguousarray(self.components),
                "mean": np.ascontiguousarray(self.mean),
                "projected": np.ascontiguousarray(self.projected),
                "explained_variance_ratio": np.ascontiguousarray(self.explained_variance_ratio),
            },
            str(path),
        )

    @classmethod
    def load(cls, path: Path) -> PCAResult:
        """The donor stage's file, checked: a missing, truncated or garbage file is a named error."""
        try:
            t = load_file(str(path))
        except (OSError, SafetensorError) as e:
            found = "no such file" if isinstance(e, FileNotFoundError) else f"unreadable ({e})"
            raise DataError(problem(str(path), "the donor stage's PCA (safetensors)", found, _REDONOR)) from None
        names = ("components", "mean", "projected", "explained_variance_ratio")
        if sorted(t) != sorted(names):
            raise DataError(problem(str(path), f"the tensors {list(names)}", f"{sorted(t)}", _REDONOR))
        result = cls(*(t[n] for n in names))
        k, width = result.components.shape if result.components.ndim == 2 else (-1, -1)
        want = {"components": (k, width), "mean": (width,), "projected": result.projected.shape[:1] + (k,)}
        for name, shape in {**want, "explained_variance_ratio": (k,)}.items():
            arr = getattr(result, name)
            if k < 0 or arr.shape != shape or arr.dtype != np.float32 or not np.all(np.isfinite(arr)):
                found = f"{name} {arr.dtype} {arr.shape} (components {result.components.shape})"
                raise DataError(problem(str(path), f"finite float32 {name} of shape {shape}", found, _REDONOR))
        return result


_REDONOR = "the donor stage writes it: re-run `dvc repro -f donor`"


def check_vocab(donor: DonorEmbeddings, packed_vocab: int, packed_meta: Path) -> None:
    """The donor's rows must be the packed data's token ids, or the warm start is meaningless."""
    rows = donor.table.shape[0]
    if rows != packed_vocab:
        raise GGUFError(
            problem(
                f"{donor.path} {EMBEDDING_TENSOR}",
                f"{packed_vocab} rows (the vocab of the packed data in {packed_meta})",
                f"{rows} rows",
                "pack the corpus with this donor's tokenizer (dvc repro pack) or use the matching donor",
            )
        )


def check_width(donor: DonorEmbeddings, d_model: int, init: str) -> None:
    """PCA init cannot make more components than the donor has dimensions."""
    if init == "pca" and d_model > donor.width:
        raise GGUFError(
            problem(
                "config key model.d_model",
                f"at most the donor width {donor.width} ({donor.path}) for recipe.init=pca",
                str(d_model),
                "lower model.d_model, or use recipe.init=lens or scratch",
            )
        )


def pca(table: np.ndarray, k: int) -> PCAResult:
    """Top-k principal components of the rows of `table` (centered, SVD in float64 for stability)."""
    x = torch.from_numpy(table).double()
    mean = x.mean(dim=0)
    xc = x - mean
    _, s, vh = torch.linalg.svd(xc, full_matrices=False)
    k = min(k, vh.shape[0])
    var = s.pow(2)
    components = vh[:k]
    return PCAResult(
        components=components.float().numpy(),
        mean=mean.float().numpy(),
        projected=(xc @ components.T).float().numpy(),
        explained_variance_ratio=(var[:k] / var.sum()).float().numpy(),
    )


def run_donor(
    donor_path: Path, packed_vocab: int, packed_meta: Path, d_model: int, init: str, out_dir: Path
) -> tuple[PCAResult, dict[str, float]]:
    """The donor stage: read, check against the packed data and the model width, PCA, save.

    With `init=base` (fine-tuning the donor itself) there is no PCA: only the checks and meta.json.
    """
    donor = read_donor_embeddings(donor_path)
    check_vocab(donor, packed_vocab, packed_meta)
    if init == "base":  # fine-tuning the donor itself: nothing to project, zero components
        result = PCAResult(
            components=np.zeros((0, donor.width), dtype=np.float32),
            mean=np.zeros(donor.width, dtype=np.float32),
            projected=np.zeros((donor.table.shape[0], 0), dtype=np.float32),
            explained_variance_ratio=np.zeros(0, dtype=np.float32),
        )
    else:
        check_width(donor, d_model, init)
        result = pca(donor.table, d_model)
    with atomic_dir(out_dir) as tmp:
        if init != "base":
            result.save(tmp / PCA_FILE)
        info = {
            "path": str(donor.path),
            "architecture": donor.architecture,
            "width": donor.width,
            "vocab": int(donor.table.shape[0]),
            "tensor_type": donor.tensor_type,
            "components": int(result.components.shape[0]),
        }
        (tmp / "meta.json").write_text(json.dumps(info, indent=2) + "\n")
    metrics = {
        "explained_variance_total": float(result.explained_variance_ratio.sum()),
        "donor_width": float(donor.width),
        "components": float(result.components.shape[0]),
    }
    return result, metrics
