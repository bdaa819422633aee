"""Writing GGUF files: the one writer every export (models, adapters, quantized bases) goes through."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType, GGUFValueType, GGUFWriter, quants

from pipeline.errors import GGUFError, problem
from pipeline.files import atomic_file
from pipeline.gguf.reader import TypedValue

# export dtype -> ggml tensor type name and llama.cpp's `general.file_type` (enum llama_ftype)
TENSOR_TYPES = {"f32": "F32", "f16": "F16", "bf16": "BF16", "q8_0": "Q8_0"}
FILE_TYPES = {"f32": 0, "f16": 1, "q8_0": 7, "bf16": 32}  # ALL_F32, MOSTLY_F16, MOSTLY_Q8_0, MOSTLY_BF16


def encode_tensor(arr: np.ndarray, dtype: str, ggml_type: str | None = None):
    """`arr` as stored for an export of `dtype`: (data for GGUFWriter.add_tensor, its ggml type).

    As llama.cpp's convert_hf_to_gguf does: 1-D tensors (norm weights, rope factors) stay F32,
    and a matrix whose rows do not split into whole quant blocks (q8_0: 32) falls back to F16.
    `ggml_type` (a gguf-py type name such as Q4_0, Q4_1, Q5_0) overrides `dtype` for matrices.
    """
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
    if dtype not in TENSOR_TYPES:
        raise GGUFError(problem("export dtype", f"one of {', '.join(TENSOR_TYPES)}", repr(dtype), "pick one of them"))
    if ggml_type is not None and ggml_type not in GGMLQuantizationType.__members__:
        raise GGUFError(problem("ggml_type", "a gguf-py quantization type name", repr(ggml_type), "use e.g. Q4_0"))

    with atomic_file(path) as tmp:
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
    return Path(path)


def write_model_gguf(
    path: str | os.PathLike[str],
    arch: str,
    arch_meta: dict[str, Any],
    tensors: dict[str, np.ndarray],
    tokenizer_meta: dict[str, Any],
    provenance: dict[str, Any],
    dtype: str,
) -> Path:
    """What every architecture's export shares: `general.type=model`, provenance, the architecture's
    keys, the donor's tokenizer, in that order. `dtype` (f32, f16, bf16, q8_0) types the matrices."""
    if dtype not in TENSOR_TYPES:
        raise GGUFError(
            problem("export.dtype", f"one of {', '.join(TENSOR_TYPES)}", repr(dtype), "pick a supported type")
        )
    metadata: dict[str, Any] = {"general.type": "model", **provenance, **arch_meta, **tokenizer_meta}
    return write_gguf(path, arch, metadata, tensors, dtype=dtype)


def _value_type(value: Any):
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
