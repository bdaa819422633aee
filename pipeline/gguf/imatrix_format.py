"""Importance matrices in llama.cpp's GGUF imatrix format, and quantizing a GGUF with one through ggml.

An imatrix entry, per matmul weight (its GGUF name, e.g. `blk.0.attn_q.weight`), is the sum over
tokens of each input column's squared activation (`<name>.in_sum2`) and the token count
(`<name>.counts`): what llama.cpp's `llama-imatrix` writes, and what `llama-quantize --imatrix`
reads (it weights each column by in_sum2 / counts, the mean squared input). llama-cpp-python's
`llama_model_quantize` takes an imatrix only as a pointer to a C++ map, so `quantize_gguf` does what
it does per tensor instead: the same per-tensor types (its own policy, `ggml.tensor_types`), each
tensor through `ggml_quantize_chunk` with that entry's column weights, every metadata key kept.
Without an imatrix its tensors are llama_model_quantize's bytes (tested).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType, GGUFValueType, GGUFWriter, quants

from pipeline.errors import GGUFError, problem
from pipeline.gguf import ggml
from pipeline.gguf.quantize import K_QUANTS
from pipeline.gguf.reader import GGUFFile, TypedValue
from pipeline.gguf.writer import FILE_TYPES, add_metadata, tensor_type
from pipeline.io.files import atomic_file

LEGACY = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0")  # block types gguf-py quantizes as ggml does
IMATRIX_TYPES = ("q4_0", "q4_1", "q5_0", "q5_1", *K_QUANTS)  # export types whose quantizer uses column weights
SUM2, COUNTS = ".in_sum2", ".counts"


@dataclass
class Imatrix:
    """Per matmul weight (GGUF name): the per-column sums of squared inputs, and the tokens summed."""

    sums: dict[str, np.ndarray]
    counts: dict[str, int]
    chunk_count: int  # windows of `chunk_size` tokens collected over
    chunk_size: int
    datasets: list[str] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)  # provenance keys (ours), written with the file

    def weights(self) -> dict[str, np.ndarray]:
        """Each entry's column weights as llama-quantize computes them: in_sum2 / counts."""
        return {n: (s / np.float32(self.counts[n])).astype(np.float32) for n, s in self.sums.items()}


def write_imatrix(path: str | os.PathLike[str], imx: Imatrix) -> Path:
    """`imx` as llama-imatrix's GGUF (general.type=imatrix, imatrix.datasets/chunk_count/chunk_size,
    `<name>.in_sum2` (1, n) and `<name>.counts` (1, 1) F32 per entry, sorted by name), atomically."""
    with atomic_file(path) as tmp:
        writer = GGUFWriter(tmp, "imatrix")
        writer.kv_data[0].pop("general.architecture")  # llama-imatrix writes none
        writer.add_type("imatrix")
        writer.add_array("imatrix.datasets", imx.datasets)
        writer.add_uint32("imatrix.chunk_count", imx.chunk_count)
        writer.add_uint32("imatrix.chunk_size", imx.chunk_size)
        add_metadata(writer, imx.extra)
        for name in sorted(imx.sums):
            writer.add_tensor(name + SUM2, np.asarray(imx.sums[name], np.float32).reshape(1, -1))
            writer.add_tensor(name + COUNTS, np.full((1, 1), imx.counts[name], np.float32))
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
    return Path(path)


def read_imatrix(path: str | os.PathLike[str]) -> Imatrix:
    """An imatrix GGUF (ours or llama-imatrix's), through our bounds-checked reader."""
    g = GGUFFile(path)
    if g.metadata.get("general.type") != "imatrix":
        raise GGUFError(problem(str(path), "general.type=imatrix", repr(g.metadata.get("general.type")), "collect one"))
    names = [n.removesuffix(SUM2) for n in g.tensor_names() if n.endswith(SUM2)]
    missing = [n for n in names if not g.has_tensor(n + COUNTS)]
    if not names or missing:
        raise GGUFError(
            problem(str(path), "in_sum2 and counts per entry", f"{len(names)} entries, {missing[:2]}", "recollect it")
        )
    sums = {n: g.tensor(n + SUM2).reshape(-1).copy() for n in names}
    counts = {n: int(round(float(g.tensor(n + COUNTS).reshape(-1)[0]))) for n in names}
    extra = {k: v for k, v in g.metadata.items() if k.startswith("pipeline.")}
    datasets = list(g.metadata.get("imatrix.datasets", []))
    chunks = int(g.metadata.get("imatrix.chunk_count", 0))
    return Imatrix(sums, counts, chunks, int(g.metadata.get("imatrix.chunk_size", 0)), datasets, extra)


def quantize_gguf(
    src: Path,
    dst: str | os.PathLike[str],
    dtype: str,
    imx: Imatrix | None,
    imx_file: str = "",
    types: dict[str, str] | None = None,
    extra: dict[str, Any] | None = None,
) -> Path:
    """`src` (an f32 GGUF) as an export of `dtype` whose quantized tensors use `imx`'s column weights,
    written atomically: llama.cpp's types for the K-quant mixes, our writer's for the legacy types, or
    `types` (tensor name -> ggml type name; the others as `dtype` has them) with `extra` metadata."""
    g = GGUFFile(src)
    types = types or (ggml.tensor_types(src, dtype) if dtype in K_QUANTS else {})
    weights = imx.weights() if imx is not None else {}
    metadata: dict[str, Any] = {k: g.typed_field(k) for k in g.metadata if k != "general.architecture"}
    metadata["general.file_type"] = FILE_TYPES[dtype]
    if imx is not None:  # llama-quantize's own keys (int32, as it writes them), then our provenance
        metadata["quantize.imatrix.file"] = imx_file
        metadata["quantize.imatrix.dataset"] = imx.datasets[-1] if imx.datasets else ""
        metadata["quantize.imatrix.entries_count"] = _i32(len(imx.sums))
        metadata["quantize.imatrix.chunks_count"] = _i32(imx.chunk_count)
        metadata.update(imx.extra)
    metadata.update(extra or {})
    with atomic_file(dst) as tmp:
        writer = GGUFWriter(tmp, g.architecture)
        add_metadata(writer, metadata)
        for name in g.tensor_names():
            arr = g.tensor(name)
            qtype = GGMLQuantizationType[types[name]] if name in types else tensor_type(arr.shape, dtype, name)
            writer.add_tensor(name, _encode(arr, qtype, weights.get(name)), raw_dtype=qtype)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
    return Path(dst)


def _encode(arr: np.ndarray, qtype: GGMLQuantizationType, weights: np.ndarray | None) -> np.ndarray:
    if qtype == GGMLQuantizationType.F32:
        return np.ascontiguousarray(arr, dtype=np.float32)
    if qtype == GGMLQuantizationType.F16:
        return np.ascontiguousarray(arr, dtype=np.float16)
    if weights is None and qtype.name in LEGACY:  # gguf-py writes these bytes too, without llama.cpp's library
        return quants.quantize(np.ascontiguousarray(arr, dtype=np.float32), qtype)
    rows = ggml.quantize(arr.reshape(-1, arr.shape[-1]), qtype, weights, threads=os.cpu_count() or 1)
    return rows.reshape(*arr.shape[:-1], rows.shape[-1])  # bytes per row: gguf-py derives the shape


def _i32(value: int) -> TypedValue:
    return TypedValue(value, int(GGUFValueType.INT32))
