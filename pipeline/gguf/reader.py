"""Reading GGUF files: a validated, memory-mapped view of a GGUF.

Opening parses the header with `pipeline.gguf.header` (every length, count, string and tensor
extent checked before use), so a bad file raises a one-line `GGUFError` naming the path instead of
a numpy traceback, and no tensor whose declared size exceeds the file is ever mapped or allocated.
Values a loader uses are read through the typed getters (`int_key`, `float_key`, `str_key`), which
name the key, the type and range expected and what the file holds.
"""

from __future__ import annotations

import math
import mmap
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType, quants
from gguf.quants import quant_shape_to_byte_shape

from pipeline.errors import GGUFError, problem
from pipeline.gguf.header import Field, HeaderTensor, parse_header, tensor_bytes

MAX_INT = 2**31 - 1  # hyperparameters are int32 in llama.cpp; a larger size is a forged or corrupt key
_TYPED = {  # ggml types read as numpy arrays of their own dtype (the rest as raw bytes, dequantized)
    GGMLQuantizationType.F16: np.float16,
    GGMLQuantizationType.F32: np.float32,
    GGMLQuantizationType.F64: np.float64,
    GGMLQuantizationType.I8: np.int8,
    GGMLQuantizationType.I16: np.int16,
    GGMLQuantizationType.I32: np.int32,
    GGMLQuantizationType.I64: np.int64,
}
_FIX = "the file is corrupt or was not written for this loader; re-export it"


TypedValue = Field  # a metadata value and its GGUF value type (and element type for arrays)


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
        self._data = _map(self.path)
        header = parse_header(self.path, memoryview(self._data))
        self._fields = header.metadata
        self._order = header.order
        self.metadata: dict[str, Any] = {k: f.value for k, f in self._fields.items() if not k.startswith("GGUF.")}
        self._tensors: dict[str, HeaderTensor] = {t.name: t for t in header.tensors}

    def release_pages(self) -> None:
        """Drop this process's resident pages of the file once a loader has copied the tensors out:
        they stay in the OS page cache and a later read faults them back in, but until then an fp32
        model loaded from an f32 file is counted twice in RSS (its tensors and the mapped file)."""
        mapped = getattr(self._data, "_mmap", None)  # np.memmap's mmap.mmap (None for an empty map)
        if mapped is not None and hasattr(mmap, "MADV_DONTNEED"):
            mapped.madvise(mmap.MADV_DONTNEED)

    @property
    def architecture(self) -> str:
        return self.str_key("general.architecture")

    def require(self, key: str) -> Any:
        """A metadata value that must be present."""
        if key not in self.metadata:
            raise GGUFError(problem(str(self.path), f"metadata key {key}", "it is missing", "use a complete GGUF"))
        return self.metadata[key]

    def arch_key(self, suffix: str) -> Any:
        """`{general.architecture}.{suffix}`, required."""
        return self.require(f"{self.architecture}.{suffix}")

    def int_key(self, key: str, default: int | None = None, low: int = 1, high: int = MAX_INT) -> int:
        """An integer key in [low, high] (required unless a default is given): a list, a string, a
        float or an out-of-range count is a named error, never a `TypeError` deep in a loader."""
        value = self.require(key) if default is None else self.metadata.get(key, default)
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
            raise self._bad(key, f"one integer in [{low}, {high}]", value)
        return value

    def float_key(self, key: str, default: float | None = None, positive: bool = True) -> float:
        """A finite number (positive unless told otherwise), required unless a default is given."""
        value = self.require(key) if default is None else self.metadata.get(key, default)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise self._bad(key, "one finite number", value)
        if positive and value <= 0:
            raise self._bad(key, "a positive number", value)
        return float(value)

    def str_key(self, key: str, default: str | None = None) -> str:
        """A string key, required unless a default is given."""
        value = self.require(key) if default is None else self.metadata.get(key, default)
        if not isinstance(value, str):
            raise self._bad(key, "a string", value)
        return value

    def _bad(self, key: str, expected: str, value: Any) -> GGUFError:
        found = f"{type(value).__name__} {value!r}"
        return GGUFError(problem(f"{self.path} {key}", expected, found[:80], _FIX))

    def typed_field(self, key: str) -> TypedValue:
        """A metadata value with its GGUF value type, so it can be copied into another file."""
        return self._fields[key]

    def tensor_names(self) -> list[str]:
        return list(self._tensors)

    def has_tensor(self, name: str) -> bool:
        return name in self._tensors

    def tensor_info(self, name: str) -> TensorInfo:
        t = self._get(name)
        return TensorInfo(name, tuple(reversed(t.dims)), GGMLQuantizationType(t.type_id).name, tensor_bytes(t))

    def _view(self, t: HeaderTensor) -> tuple[np.ndarray, GGMLQuantizationType, tuple[int, ...]]:
        """The tensor's data as gguf-py lays it out (typed array, or bytes shaped per block), its type, shape."""
        qtype, shape = GGMLQuantizationType(t.type_id), tuple(reversed(t.dims))
        raw = self._data[t.start : t.start + tensor_bytes(t)]
        if qtype in _TYPED:
            return raw.view(np.dtype(_TYPED[qtype]).newbyteorder(self._order)).reshape(shape), qtype, shape
        return raw.reshape(quant_shape_to_byte_shape(shape, qtype)), qtype, shape

    def tensor(self, name: str) -> np.ndarray:
        """The tensor as float32 in numpy order, dequantized from any type gguf-py knows."""
        data, qtype, shape = self._view(self._get(name))
        try:
            if qtype in (GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.F64):
                arr = np.asarray(data, dtype=np.float32)
            else:
                arr = quants.dequantize(np.asarray(data), qtype)
        except (NotImplementedError, ValueError) as e:
            raise GGUFError(
                problem(
                    f"{self.path} tensor {name}",
                    "a tensor type gguf-py can dequantize",
                    f"{qtype.name} ({e})",
                    "re-export the model with a supported type (f32, f16, bf16, q8_0, q4_k ...)",
                )
            ) from None
        return np.array(arr.reshape(shape), dtype=np.float32, order="C")  # a writable copy, off the mmap

    def _get(self, name: str) -> HeaderTensor:
        if name not in self._tensors:
            raise GGUFError(
                problem(str(self.path), f"a tensor named {name}", "no such tensor", "use a GGUF that has it")
            )
        return self._tensors[name]

    def raw_tensor(self, name: str) -> tuple[np.ndarray, str, tuple[int, ...]]:
        """The tensor's stored bytes (flat uint8, a read-only view of the mmap), ggml type name and numpy-order shape.

        For keeping quantized blocks as they are (QLoRA) instead of dequantizing them.
        """
        data, qtype, shape = self._view(self._get(name))
        return np.asarray(data).reshape(-1).view(np.uint8), qtype.name, shape


def _map(path: Path) -> np.memmap:
    """The file's bytes, memory-mapped read-only, after checks that name a missing or empty file."""
    if not path.exists():
        raise GGUFError(problem(str(path), "an existing GGUF file", "no such file", "check the path"))
    if not path.is_file():
        raise GGUFError(problem(str(path), "a GGUF file", "a directory or special file", "check the path"))
    size = path.stat().st_size
    if size < 4:
        raise GGUFError(
            problem(str(path), "a GGUF file (magic bytes 'GGUF')", f"{size} bytes", "point at a .gguf file")
        )
    return np.memmap(path, mode="r")
