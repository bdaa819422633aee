"""The one GGUF header parser: every key, value and tensor record read with bounds and type checks.

gguf-py's reader trusts the header: a forged length becomes a huge allocation or a loop over a
count the file cannot hold, a non-UTF-8 string a `UnicodeDecodeError`, nested arrays a
`RecursionError`. This parser checks every length and count against the bytes left in the file
before it reads (so a short or forged file fails fast), decodes every string as strict UTF-8,
bounds nesting and array sizes, and checks that each tensor's shape and type fit its data region
and the file, so a bad file is one `GGUFError` line naming the path and the key or tensor.
"""

from __future__ import annotations

import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from pipeline.errors import GGUFError, problem

GGUF_MAGIC = b"GGUF"
STRING, ARRAY = 8, 9  # GGUF value type ids (the rest are scalars, below)
# GGUF scalar value type id -> struct format (0-7: u8 i8 u16 i16 u32 i32 f32 bool; 10-12: u64 i64 f64)
SCALAR_FORMATS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_MIN_SIZE = {**{t: struct.calcsize(f) for t, f in SCALAR_FORMATS.items()}, STRING: 8, ARRAY: 12}
MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_DEPTH = 4  # arrays of arrays: real files never nest; this bounds the recursion
MAX_ITEMS = 1 << 22  # elements in one metadata array: a vocabulary has a few hundred thousand
_FIX = "re-download or re-export the file"


class _Bad(Exception):
    """A malformed header: (where inside the file, expected, found), named with the path by the caller."""


class _Truncated(_Bad):
    """A declared length or count that runs past the end of the file."""


@dataclass(frozen=True)
class Field:
    """A metadata value as a plain Python value, with its GGUF value type (and element type for arrays)."""

    value: Any
    vtype: int
    sub_type: int | None = None


@dataclass(frozen=True)
class HeaderTensor:
    """One tensor-info record, exactly as declared (ggml dimension order: innermost first)."""

    name: str
    dims: tuple[int, ...]
    type_id: int
    start: int  # absolute byte offset of the data in the file


@dataclass(frozen=True)
class Header:
    """Everything a GGUF header declares, checked: metadata, tensor records, alignment, byte order."""

    metadata: dict[str, Field]
    tensors: list[HeaderTensor]
    alignment: int
    order: str  # struct byte order of the file: "<" or ">"


class _Cursor:
    """Bounds-checked reads over the file bytes: a length is checked against what is left before use."""

    def __init__(self, buf: memoryview, order: str = "<"):
        self.buf, self.order, self.pos = buf, order, 0

    def left(self) -> int:
        return len(self.buf) - self.pos

    def take(self, n: int, what: str) -> memoryview:
        if n > self.left():
            raise _Truncated(what, f"{n} bytes", f"{self.left()} bytes left in the file (truncated or forged length)")
        out = self.buf[self.pos : self.pos + n]
        self.pos += n
        return out

    def scalar(self, vtype: int, what: str) -> Any:
        raw = self.take(_MIN_SIZE[vtype], what)
        if vtype == 7:  # bool: one byte, 0 or 1
            if raw[0] > 1:
                raise _Bad(what, "a bool (byte 0 or 1)", f"byte {raw[0]}")
            return raw[0] == 1
        return struct.unpack_from(self.order + SCALAR_FORMATS[vtype], raw)[0]

    def count(self, item_size: int, what: str, limit: int) -> int:
        """A u64 count of items of at least `item_size` bytes: at most `limit`, and that many must fit."""
        n = self.scalar(10, what)
        if n > limit:
            raise _Bad(what, f"at most {limit} entries", f"{n}")
        if n * item_size > self.left():
            raise _Truncated(
                what,
                f"{n} entries of at least {item_size} bytes",
                f"{self.left()} bytes left (truncated or forged count)",
            )
        return n

    def string(self, what: str) -> str:
        return self.strings(1, what, single=True)[0]

    def strings(self, n: int, what: str, single: bool = False) -> list[str]:
        """`n` length-prefixed UTF-8 strings back to back: the hot loop of opening a model (its vocabulary)."""
        buf, pos, end, out = self.buf, self.pos, len(self.buf), []
        length = struct.Struct(self.order + "Q").unpack_from
        for i in range(n):
            if pos + 8 > end:
                name = what if single else f"{what}[{i}]"
                raise _Truncated(f"{name} length", "8 bytes", f"{end - pos} bytes left in the file (truncated)")
            size = length(buf, pos)[0]
            pos += 8
            if size > end - pos:
                name = what if single else f"{what}[{i}]"
                raise _Truncated(name, f"{size} bytes", f"{end - pos} bytes left (truncated or forged length)")
            try:
                out.append(str(buf[pos : pos + size], "utf-8"))
            except UnicodeDecodeError as e:
                bad = bytes(buf[pos + max(0, e.start - 8) : pos + e.end + 8])
                name = what if single else f"{what}[{i}]"
                raise _Bad(name, "a UTF-8 string", f"invalid UTF-8 at byte {e.start} ({bad!r})") from None
            pos += size
        self.pos = pos
        return out


def _value(cur: _Cursor, vtype: int, what: str, depth: int = 0) -> Any:
    """One metadata value of type `vtype`; arrays of scalars are read in one numpy pass."""
    if vtype in SCALAR_FORMATS:
        return cur.scalar(vtype, what)
    if vtype == STRING:
        return cur.string(what)
    if vtype != ARRAY:
        raise _Bad(what, "a GGUF value type (0-12)", f"type id {vtype}")
    if depth >= MAX_DEPTH:
        raise _Bad(what, f"arrays nested at most {MAX_DEPTH} deep", "deeper nesting")
    sub = cur.scalar(4, f"{what} element type")
    if sub not in _MIN_SIZE:
        raise _Bad(what, "an array of a GGUF value type (0-12)", f"element type id {sub}")
    n = cur.count(_MIN_SIZE[sub], f"{what} array length", MAX_ITEMS)
    if sub in SCALAR_FORMATS and sub != 7:
        dtype = np.dtype(SCALAR_FORMATS[sub]).newbyteorder(cur.order)
        return np.frombuffer(cur.take(n * dtype.itemsize, what), dtype=dtype).tolist()
    if sub == STRING:
        return cur.strings(n, what)
    return [_value(cur, sub, f"{what}[{i}]", depth + 1) for i in range(n)]


def _field(cur: _Cursor, key: str) -> Field:
    vtype = cur.scalar(4, f"key {key} value type")
    if vtype == ARRAY:
        start = cur.pos
        sub = cur.scalar(4, f"key {key} element type")
        cur.pos = start
        return Field(_value(cur, vtype, f"key {key}"), vtype, sub)
    return Field(_value(cur, vtype, f"key {key}"), vtype)


def _printable(name: str, what: str) -> str:
    """A key or tensor name fit to appear in a one-line message: no control characters."""
    if not name.isprintable():
        raise _Bad(what, "a name without control characters", repr(name[:60]))
    return name


def _metadata(cur: _Cursor, n_kv: int) -> dict[str, Field]:
    metadata: dict[str, Field] = {}
    for i in range(n_kv):
        key = _printable(cur.string(f"key #{i}"), f"key #{i}")
        if key in metadata:
            raise _Bad(f"key {key}", "each key once", "it twice")
        metadata[key] = _field(cur, key)
    align = metadata.get("general.alignment")
    if align is not None and (align.vtype != 4 or align.value == 0 or align.value & (align.value - 1)):
        raise _Bad("key general.alignment", "a uint32 power of two", f"{align.value!r} (type id {align.vtype})")
    return metadata


def _tensor_records(cur: _Cursor, n_tensors: int) -> list[tuple[str, tuple[int, ...], int, int]]:
    declared, seen = [], set()
    for i in range(n_tensors):
        name = _printable(cur.string(f"tensor #{i} name"), f"tensor #{i} name")
        if name in seen:
            raise _Bad(f"tensor {name}", "each tensor name once", "it twice")
        seen.add(name)
        n_dims = cur.scalar(4, f"tensor {name} dimension count")
        if n_dims > MAX_DIMS:
            raise _Bad(f"tensor {name}", f"at most {MAX_DIMS} dimensions", f"{n_dims}")
        dims = tuple(cur.scalar(10, f"tensor {name} dimensions") for _ in range(n_dims))
        if any(d >= 2**63 for d in dims) or math.prod(dims) >= 2**63:
            raise _Bad(f"tensor {name}", "dimensions whose product fits int64", f"shape {list(dims)} (ggml order)")
        declared.append((name, dims, cur.scalar(4, f"tensor {name} type"), cur.scalar(10, f"tensor {name} offset")))
    return declared


def _parse(buf: memoryview) -> Header:
    cur = _Cursor(buf)
    cur.take(4, "magic")  # checked by the caller
    version = cur.scalar(4, "version")
    if version & 0xFFFF == 0:  # written on a big-endian machine
        cur.order = ">"
        version = int.from_bytes(int(version).to_bytes(4, "little"), "big")
    if version not in (2, 3):
        raise _Bad("GGUF version", "2 or 3", f"{version}")
    n_tensors = cur.count(24, "tensor count", 2**32)  # name length, n_dims, type, offset: 24 bytes at least
    n_kv = cur.count(13, "metadata key count", 2**32)  # key length, a 1-byte key, type, a 1-byte value
    metadata = _metadata(cur, n_kv)
    alignment = metadata["general.alignment"].value if "general.alignment" in metadata else 32
    declared = _tensor_records(cur, n_tensors)
    data_start = -(-cur.pos // alignment) * alignment
    tensors = []
    for name, dims, type_id, offset in declared:
        if offset % alignment:
            raise _Bad(f"tensor {name}", f"a data offset that is a multiple of the alignment {alignment}", f"{offset}")
        tensors.append(HeaderTensor(name, dims, type_id, data_start + offset))
    return Header(metadata, tensors, alignment, cur.order)


def parse_header(path: Path, buf: memoryview) -> Header:
    """The checked header of the GGUF whose bytes are `buf`; any fault is one `GGUFError` naming `path`."""
    if bytes(buf[:4]) != GGUF_MAGIC:
        raise GGUFError(
            problem(str(path), "a GGUF file (magic bytes 'GGUF')", f"magic {bytes(buf[:4])!r}", "point at a .gguf file")
        )
    try:
        header = _parse(buf)
    except _Truncated as e:
        where, expected, found = e.args
        raise GGUFError(problem(f"{path} {where}", expected, f"{found}; file is {len(buf)} bytes", _FIX)) from None
    except _Bad as e:
        where, expected, found = e.args
        raise GGUFError(problem(f"{path} {where}", expected, found, _FIX)) from None
    check_tensor_extents(path, len(buf), header.tensors, header.alignment)
    return header


def count_tensors(path: str | os.PathLike[str]) -> int:
    """How many tensors a GGUF declares, from a checked header parse (any architecture)."""
    path = Path(path)
    if path.stat().st_size < 4:
        raise GGUFError(problem(str(path), "a GGUF file", f"{path.stat().st_size} bytes", "point at a .gguf file"))
    data = np.memmap(path, mode="r")
    return len(parse_header(path, memoryview(data)).tensors)


def tensor_bytes(t: HeaderTensor) -> int:
    """The bytes a tensor record's shape and type need (its type must be a known ggml type)."""
    block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(t.type_id)]
    return math.prod(t.dims) // block * type_size


def check_tensor_extents(path: Path, size: int, tensors: list[HeaderTensor], alignment: int) -> None:
    """Every tensor's declared shape and type must fit its data region and the file, before any read.

    A tensor's region runs from its offset to the next tensor's (tensors are stored back to back,
    padded to the alignment): more bytes than that means a wrong shape or type, and a region past
    the end of the file means a truncated file or a forged header.
    """
    sizes = {}
    for t in tensors:
        try:
            qtype = GGMLQuantizationType(t.type_id)
            block, _ = GGML_QUANT_SIZES[qtype]
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
        sizes[t.name] = (tensor_bytes(t), qtype.name)
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
    _check_regions(path, tensors, sizes, alignment)


def _check_regions(path: Path, tensors: list[HeaderTensor], sizes: dict, alignment: int) -> None:
    """Each tensor fills the region up to the next one, give or take the alignment padding."""
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
