"""Writing GGUF files: the one writer every export (models, adapters, quantized bases) goes through."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType, GGUFWriter, quants

from pipeline.errors import GGUFError, problem
from pipeline.gguf.quantize import K_QUANTS, llamacpp_quantize, require_llamacpp
from pipeline.gguf.reader import TypedValue
from pipeline.io.files import atomic_file

# export dtype -> the ggml tensor type gguf-py writes for matrices, and llama.cpp's `general.file_type`
# (enum llama_ftype). K-quants are llama.cpp's own mixes: pipeline.gguf.quantize writes them.
TENSOR_TYPES = {"f32": "F32", "f16": "F16", "bf16": "BF16", "q8_0": "Q8_0"}
TENSOR_TYPES |= {"q4_0": "Q4_0", "q4_1": "Q4_1", "q5_0": "Q5_0", "q5_1": "Q5_1"}
FILE_TYPES = {"f32": 0, "f16": 1, "q4_0": 2, "q4_1": 3, "q8_0": 7, "q5_0": 8, "q5_1": 9, "bf16": 32}
FILE_TYPES |= {"q4_k_m": 15, "q5_k_m": 17, "q6_k": 18}
# below 8 bits the token table (which is also the head when tied) and the head stay Q8_0, as llama.cpp
# keeps them at a higher type than the rest (it uses Q6_K, which gguf-py cannot write)
LOW_BIT = ("q4_0", "q4_1", "q5_0", "q5_1")
HEAD_TENSORS = ("token_embd.weight", "output.weight")


def encode_tensor(arr: np.ndarray, dtype: str, ggml_type: str | None = None, tensor: str = ""):
    """`arr` as stored for an export of `dtype`: (data for GGUFWriter.add_tensor, its ggml type).

    As llama.cpp's convert_hf_to_gguf does: 1-D tensors (norm weights, rope factors) stay F32,
    and a matrix whose rows do not split into whole quant blocks (32) falls back to F16. Below
    8 bits the token table and head (`tensor` in HEAD_TENSORS) are Q8_0.
    `ggml_type` (a gguf-py type name such as Q4_0, Q4_1, Q5_0) overrides `dtype` for all matrices.
    """
    arr = np.ascontiguousarray(arr, dtype=np.float32)
    qtype = tensor_type(arr.shape, dtype, tensor, ggml_type)
    return quants.quantize(arr, qtype), qtype


def tensor_type(
    shape: tuple[int, ...], dtype: str, tensor: str = "", ggml_type: str | None = None
) -> GGMLQuantizationType:
    """The ggml type an export of `dtype` stores a tensor of `shape` as (the rules of `encode_tensor`)."""
    name = ggml_type or ("Q8_0" if dtype in LOW_BIT and tensor in HEAD_TENSORS else TENSOR_TYPES[dtype])
    qtype = GGMLQuantizationType[name] if len(shape) >= 2 else GGMLQuantizationType.F32
    if shape and shape[-1] % GGML_QUANT_SIZES[qtype][0]:  # rows that do not split into whole blocks
        return GGMLQuantizationType.F16
    return qtype


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
        add_metadata(writer, metadata)
        for name, arr in tensors.items():
            data, qtype = encode_tensor(arr, dtype, ggml_type, name)
            writer.add_tensor(name, data, raw_dtype=qtype)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
    return Path(path)


def add_metadata(writer: GGUFWriter, metadata: dict[str, Any]) -> None:
    """Each key as a plain value (typed by gguf-py's rules) or a `TypedValue` (its own types kept)."""
    for key, value in metadata.items():
        if isinstance(value, TypedValue):
            sub = None if value.sub_type is None else GGUFValueType(value.sub_type)
            writer.add_key_value(key, value.value, GGUFValueType(value.vtype), sub)
        else:
            writer.add_key_value(key, value, _value_type(value), _array_type(value))


def check_export_dtype(dtype: str) -> None:
    """A named error for a type no export writes. Callers check before building the `llama.*` keys
    (whose `general.file_type` lookup otherwise raised a bare KeyError) and before loading a model."""
    if dtype not in TENSOR_TYPES and dtype not in K_QUANTS:
        choices = ", ".join([*TENSOR_TYPES, *K_QUANTS])
        raise GGUFError(problem("export.dtype", f"one of {choices}", repr(dtype), "pick a supported type"))


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
    keys, the donor's tokenizer, in that order. `dtype` types the matrices: a TENSOR_TYPES key, or a
    K-quant (K_QUANTS), which llama.cpp's own quantizer writes from an f32 file."""
    check_export_dtype(dtype)
    metadata: dict[str, Any] = {"general.type": "model", **provenance, **arch_meta, **tokenizer_meta}
    if dtype in K_QUANTS:
        require_llamacpp(dtype)  # before the f32 file is written
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=Path(path).parent, prefix=".f32-") as tmp:
            f32 = write_gguf(Path(tmp) / "f32.gguf", arch, {**metadata, "general.file_type": 0}, tensors, "f32")
            return llamacpp_quantize(f32, path, dtype)
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
