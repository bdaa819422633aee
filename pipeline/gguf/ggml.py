"""ggml's own quantizer and dequantizer, through ctypes on the libggml-base llama-cpp-python ships.

llama.cpp's `llama_model_quantize` only quantizes whole files, and takes an importance matrix only
as a pointer to a C++ map. The row quantizers under it (`ggml_quantize_chunk`) take the matrix's
column weights as a plain float array, and each row's blocks depend on that row alone: so calling
them per tensor gives exactly the bytes llama-quantize writes (tested), with or without an imatrix,
and `dequantize(quantize(w))` is exactly the weight a K-quant file holds (what QAT trains on).
The library is located as llama_cpp locates it, without importing llama_cpp (that loads libllama).
"""

from __future__ import annotations

import ctypes
import importlib.util
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from functools import lru_cache
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType

from pipeline.errors import GGUFError, problem
from pipeline.gguf.quantize import llamacpp_quantize, require_llamacpp
from pipeline.gguf.reader import GGUFFile

_TO_FLOAT = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.POINTER(ctypes.c_float), ctypes.c_int64)


class _TypeTraits(ctypes.Structure):
    """struct ggml_type_traits (ggml.h, ggml 0.25): the fields up to the row dequantizer."""

    _fields_ = [
        ("type_name", ctypes.c_char_p),
        ("blck_size", ctypes.c_int64),
        ("blck_size_interleave", ctypes.c_int64),
        ("type_size", ctypes.c_size_t),
        ("is_quantized", ctypes.c_bool),
        ("to_float", ctypes.c_void_p),
        ("from_float_ref", ctypes.c_void_p),
    ]


def _lib_name() -> str:
    if sys.platform == "darwin":
        return "libggml-base.dylib"
    return "ggml-base.dll" if sys.platform == "win32" else "libggml-base.so"


@lru_cache(maxsize=1)
def library() -> ctypes.CDLL:
    """libggml-base from llama_cpp/lib (llama-cpp-python's wheel), with the prototypes we call."""
    require_llamacpp("a K-quant", key="export.dtype")
    spec = importlib.util.find_spec("llama_cpp")
    roots = list(spec.submodule_search_locations or []) if spec else []
    path = next((Path(r) / "lib" / _lib_name() for r in roots if (Path(r) / "lib" / _lib_name()).exists()), None)
    if path is None:
        raise GGUFError(
            problem("llama_cpp/lib", f"{_lib_name()} (llama-cpp-python's ggml)", "absent", "`make llamacpp`")
        )
    lib = ctypes.CDLL(str(path))
    i64, size_t, ptr = ctypes.c_int64, ctypes.c_size_t, ctypes.c_void_p
    lib.ggml_quantize_chunk.argtypes = [ctypes.c_int, ptr, ptr, i64, i64, i64, ptr]
    lib.ggml_quantize_chunk.restype = size_t
    lib.ggml_row_size.argtypes = [ctypes.c_int, i64]
    lib.ggml_row_size.restype = size_t
    lib.ggml_quantize_requires_imatrix.argtypes = [ctypes.c_int]
    lib.ggml_quantize_requires_imatrix.restype = ctypes.c_bool
    lib.ggml_get_type_traits.argtypes = [ctypes.c_int]
    lib.ggml_get_type_traits.restype = ctypes.POINTER(_TypeTraits)
    return lib


def row_size(qtype: GGMLQuantizationType, n_per_row: int) -> int:
    """Bytes of one row of `n_per_row` values stored as `qtype`."""
    return int(library().ggml_row_size(int(qtype), n_per_row))


def requires_imatrix(qtype: GGMLQuantizationType) -> bool:
    """Whether ggml refuses to quantize `qtype` without an importance matrix (the low i-quants)."""
    return bool(library().ggml_quantize_requires_imatrix(int(qtype)))


def _check(arr: np.ndarray, qtype: GGMLQuantizationType, imatrix: np.ndarray | None) -> None:
    block = int(library().ggml_get_type_traits(int(qtype)).contents.blck_size)
    n = arr.shape[-1]
    if arr.ndim != 2 or n % block:
        raise GGUFError(
            problem(
                "tensor", f"a matrix whose rows split into {qtype.name} blocks of {block}", arr.shape, "keep it F16/F32"
            )
        )
    if imatrix is not None and imatrix.shape != (n,):
        raise GGUFError(problem("imatrix entry", f"{n} column weights", imatrix.shape, "collect it on this model"))
    if imatrix is None and requires_imatrix(qtype):
        raise GGUFError(problem("imatrix", f"one for {qtype.name}", "none", "set export.imatrix"))


def quantize(
    arr: np.ndarray, qtype: GGMLQuantizationType, imatrix: np.ndarray | None = None, threads: int = 1
) -> np.ndarray:
    """`arr` (rows, n_per_row) as `qtype` blocks, ggml's bytes (rows, row_size) as llama-quantize writes
    them; `imatrix`: per-column importance (llama.cpp's imatrix entry of this tensor), or None."""
    src = np.ascontiguousarray(arr, dtype=np.float32)
    weights = None if imatrix is None else np.ascontiguousarray(imatrix, dtype=np.float32)
    _check(src, qtype, weights)
    rows, n = src.shape
    out = np.empty((rows, row_size(qtype, n)), dtype=np.uint8)
    wptr = None if weights is None else weights.ctypes.data
    lib = library()

    def chunk(start: int, count: int) -> None:  # rows are independent: threads split them
        lib.ggml_quantize_chunk(int(qtype), src.ctypes.data, out.ctypes.data, start * n, count, n, wptr)

    step = max(1, -(-rows // max(1, threads)))
    with ThreadPoolExecutor(max(1, threads)) as pool:  # ctypes releases the GIL during each call
        list(pool.map(lambda s: chunk(s, min(step, rows - s)), range(0, rows, step)))
    return out


def dequantize(data: np.ndarray, qtype: GGMLQuantizationType, shape: tuple[int, ...]) -> np.ndarray:
    """The float32 values of `data` (`qtype` blocks) by ggml's own row dequantizer, in `shape`."""
    traits = library().ggml_get_type_traits(int(qtype)).contents
    if not traits.to_float:
        raise GGUFError(problem("ggml type", "one ggml can dequantize", qtype.name, "use a K-quant or legacy type"))
    raw = np.ascontiguousarray(data, dtype=np.uint8)
    out = np.empty(int(np.prod(shape)), dtype=np.float32)
    _TO_FLOAT(traits.to_float)(raw.ctypes.data, out.ctypes.data_as(ctypes.POINTER(ctypes.c_float)), out.size)
    return out.reshape(shape)


def round_trip(
    arr: np.ndarray, qtype: GGMLQuantizationType, imatrix: np.ndarray | None = None, threads: int = 1
) -> np.ndarray:
    """dequantize(quantize(arr)): the values a file of `qtype` holds for `arr`."""
    return dequantize(quantize(arr, qtype, imatrix, threads), qtype, arr.shape)


def tensor_types(src: Path, dtype: str, threads: int = 1) -> dict[str, str]:
    """The ggml type (name) llama.cpp's quantizer gives each tensor of `src` (an f32 GGUF) under the
    mix `dtype`: its own policy (llama_tensor_get_type), read back from the file it writes."""
    with tempfile.TemporaryDirectory(dir=Path(src).parent, prefix=".types-") as tmp:
        g = GGUFFile(llamacpp_quantize(src, Path(tmp) / "q.gguf", dtype, threads))
        return {name: g.tensor_info(name).ggml_type for name in g.tensor_names()}
