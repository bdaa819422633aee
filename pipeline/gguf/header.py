"""A bounds-checked pass over a GGUF header, before gguf-py maps anything.

gguf-py trusts the header: a forged length or a truncated file becomes a numpy traceback or a huge
allocation. This pass reads every declared key and tensor record with bounds checks and checks
that each tensor's shape and type fit its data region and the file, so a bad file is a one-line
`GGUFError` naming the path.
"""

from __future__ import annotations

import math
import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from pipeline.errors import GGUFError, problem

GGUF_MAGIC = b"GGUF"


def count_tensors(path: str | os.PathLike[str]) -> int:
    """How many tensors a GGUF declares, from a checked header scan (no metadata decoding, any architecture)."""
    path = Path(path)
    return len(scan_header(path, path.stat().st_size)[0])


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


def scan_header(path: Path, size: int) -> tuple[list[_HeaderTensor], int]:
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


def check_tensor_extents(path: Path, size: int, tensors: list[_HeaderTensor], alignment: int) -> None:
    """Every tensor's declared shape and type must fit its data region and the file, before any read.

    A tensor's region runs from its offset to the next tensor's (tensors are stored back to back,
    padded to the alignment): more bytes than that means a wrong shape or type, and a region past
    the end of the file means a truncated file or a forged header.
    """
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
