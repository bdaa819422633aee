"""Deterministic GGUF fuzzing: seeded mutations of a tiny whole-model GGUF (`write_tiny_gguf(model=True)`)
and what our readers make of each. Every case must end in one named `PipelineError` line or load and
run; a traceback, a multi-line message or a slow case is a finding.

The test (tests/test_robust.py) runs the cases in-process; `python -m tests.gguf_fuzz [N] [SEED]`
runs each in a forked child with a time and memory limit and prints the figures, so a reader that
hangs or allocates without bound is counted instead of taking the machine down.
"""

from __future__ import annotations

import json
import os
import random
import resource
import select
import signal
import struct
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from pipeline.donor.load import read_donor_embeddings
from pipeline.errors import GGUFError, PipelineError
from pipeline.finetune.model import load_base
from pipeline.gguf.reader import GGUFFile
from pipeline.models.registry import load_gguf
from pipeline.tokenizer.chat_template import render_messages
from pipeline.tokenizer.gguf_tokenizer import tokenizer_from_gguf
from tests.conftest import write_tiny_gguf

STRING, ARRAY = 8, 9
U32, I32, F32, BOOL, U64, I64, F64 = 4, 5, 6, 7, 10, 11, 12
HUGE = (2**64 - 1, 2**63, 2**62, 2**40, 2**32, 2**31 - 1, 10**9)
BAD_UTF8 = (b"\xff", b"\xc3\x28", b"\xed\xa0\x80", b"\xf4\x90\x80\x80", b"\xe2\x82", b"\x80")


# ----- a tiny independent GGUF codec, so a mutation can forge any structure


def scalar(vtype: int, x: object) -> bytes:
    fmt = {0: "B", 1: "b", 2: "H", 3: "h", U32: "I", I32: "i", F32: "f", BOOL: "?", U64: "Q", I64: "q", F64: "d"}
    return struct.pack("<" + fmt[vtype], x)


def string(b: bytes) -> bytes:
    return struct.pack("<Q", len(b)) + b


def value(vtype: int, x: object) -> bytes:
    """A typed value as a key's payload: type id, then the value."""
    return struct.pack("<I", vtype) + (string(x) if vtype == STRING else scalar(vtype, x))  # type: ignore[arg-type]


def array(sub: int, items: list[bytes]) -> bytes:
    """An array payload (type id 9) of already-encoded items of type `sub`."""
    return struct.pack("<IIQ", ARRAY, sub, len(items)) + b"".join(items)


def nested(depth: int) -> bytes:
    """Arrays of arrays `depth` deep, one element each, an empty u32 array innermost."""
    return struct.pack("<I", ARRAY) + struct.pack("<IQ", ARRAY, 1) * (depth - 1) + struct.pack("<IQ", U32, 0)


@dataclass
class Layout:
    """A GGUF as editable parts: keys with their encoded payloads, tensor records, the data section."""

    kvs: list[tuple[bytes, bytes]]
    tensors: list[tuple[bytes, list[int], int, int]]
    data: bytes
    counts: tuple[int, int] | None = None  # forged (n_tensors, n_kv)
    u64s: list[int] = field(default_factory=list)  # where the last encode put its length/count/dim fields

    def encode(self) -> bytes:
        n_t, n_kv = self.counts or (len(self.tensors), len(self.kvs))
        out, self.u64s = bytearray(b"GGUF" + struct.pack("<IQQ", 3, n_t, n_kv)), [8, 16]
        for key, payload in self.kvs:
            self.u64s.append(len(out))  # the key's length
            out += string(key)
            vtype = struct.unpack_from("<I", payload)[0] if len(payload) >= 4 else -1
            if vtype == STRING or (vtype == ARRAY and len(payload) >= 16):
                self.u64s.append(len(out) + (4 if vtype == STRING else 8))  # string length, array count
            if vtype == ARRAY and payload[4:8] == struct.pack("<I", STRING) and len(payload) >= 24:
                self.u64s.append(len(out) + 16)  # the first element's length
            out += payload
        for name, dims, ttype, offset in self.tensors:
            self.u64s.append(len(out))  # the name's length
            out += string(name) + struct.pack("<I", len(dims))
            self.u64s += [len(out) + 8 * i for i in range(len(dims))] + [len(out) + 8 * len(dims) + 4]
            out += b"".join(struct.pack("<Q", d) for d in dims) + struct.pack("<IQ", ttype, offset)
        out += bytes(-len(out) % 32)
        return bytes(out + self.data)

    def set(self, key: bytes, payload: bytes) -> None:
        self.kvs = [(k, payload if k == key else p) for k, p in self.kvs]
        if key not in dict(self.kvs):
            self.kvs.append((key, payload))


def parse(data: bytes) -> Layout:
    """The parts of a well-formed little-endian GGUF (only ever the valid base file)."""
    pos = 24
    n_t, n_kv = struct.unpack_from("<QQ", data, 8)

    def skip(vtype: int) -> None:
        nonlocal pos
        if vtype == STRING:
            pos += 8 + struct.unpack_from("<Q", data, pos)[0]
        elif vtype == ARRAY:
            sub, count = struct.unpack_from("<IQ", data, pos)
            pos += 12
            for _ in range(count):
                skip(sub)
        else:
            pos += len(scalar(vtype, 0))

    kvs, tensors = [], []
    for _ in range(n_kv):
        klen = struct.unpack_from("<Q", data, pos)[0]
        key, start = data[pos + 8 : pos + 8 + klen], pos + 8 + klen
        pos = start + 4
        skip(struct.unpack_from("<I", data, start)[0])
        kvs.append((key, data[start:pos]))
    for _ in range(n_t):
        nlen = struct.unpack_from("<Q", data, pos)[0]
        name, pos = data[pos + 8 : pos + 8 + nlen], pos + 8 + nlen
        n_dims = struct.unpack_from("<I", data, pos)[0]
        dims = list(struct.unpack_from(f"<{n_dims}Q", data, pos + 4))
        ttype, offset = struct.unpack_from("<IQ", data, pos + 4 + 8 * n_dims)
        pos += 4 + 8 * n_dims + 12
        tensors.append((name, dims, ttype, offset))
    return Layout(kvs, tensors, data[pos + (-pos % 32) :])


# ----- mutations: each takes the case's rng and a fresh Layout of the base file


def _flip(rng: random.Random, lay: Layout) -> bytes:
    raw = bytearray(lay.encode())
    header = len(raw) - len(lay.data)
    for _ in range(rng.randint(1, 6)):
        pos = rng.randrange(header if rng.random() < 0.85 else len(raw))
        raw[pos] ^= 1 << rng.randrange(8)
    return bytes(raw)


def _truncate(rng: random.Random, lay: Layout) -> bytes:
    raw = lay.encode()
    return raw[: rng.randrange(len(raw))]


def _huge(rng: random.Random, lay: Layout) -> bytes:
    raw = bytearray(lay.encode())
    struct.pack_into("<Q", raw, rng.choice(lay.u64s), rng.choice(HUGE))
    return bytes(raw)


def _utf8(rng: random.Random, lay: Layout) -> bytes:
    bad = rng.choice(BAD_UTF8)
    i = rng.randrange(len(lay.kvs))
    key, payload = lay.kvs[i]
    where = rng.choice(("key", "value", "tensor"))
    if where == "key":
        lay.kvs[i] = (key[:3] + bad + key[3:], payload)
    elif where == "tensor":
        j = rng.randrange(len(lay.tensors))
        name, *rest = lay.tensors[j]
        lay.tensors[j] = (name + bad, *rest)  # type: ignore[assignment]
    elif rng.random() < 0.5:
        lay.set(b"tokenizer.ggml.tokens", array(STRING, [string(b"a" + bad), *(string(b"t%d" % n) for n in range(63))]))
    else:
        lay.set(
            rng.choice((b"general.architecture", b"tokenizer.ggml.model", b"tokenizer.chat_template")),
            value(STRING, b"ll" + bad),
        )
    return lay.encode()


def _random_payload(rng: random.Random) -> bytes:
    kind = rng.randrange(9)
    if kind == 0:
        return value(rng.choice((U32, I32, U64, I64)), rng.choice((0, 1, 2**31 - 1)))
    if kind == 1:
        return value(I64, rng.choice((-1, -(2**63), 2**63 - 1)))
    if kind == 2:
        return value(rng.choice((F32, F64)), rng.choice((float("nan"), float("inf"), -0.0, 1e30, -3.5)))
    if kind == 3:
        return value(BOOL, rng.random() < 0.5)
    if kind == 4:
        return value(STRING, rng.choice((b"", b"llama", b"12", b"x" * 300)))
    if kind == 5:
        return array(U32, [scalar(U32, n) for n in range(rng.randint(0, 5))])
    if kind == 6:
        return array(STRING, [string(b"s%d" % n) for n in range(rng.randint(0, 5))])
    if kind == 7:
        return array(F32, [scalar(F32, 0.5)] * rng.randint(1, 64))
    return nested(rng.randint(2, 6))


def _retype(rng: random.Random, lay: Layout) -> bytes:
    keys = [k for k, _ in lay.kvs if not k.startswith(b"general.")] + [b"general.architecture", b"general.alignment"]
    lay.set(rng.choice(keys), _random_payload(rng))
    return lay.encode()


LLAMA_INTS = (b"embedding_length", b"block_count", b"context_length", b"feed_forward_length", b"attention.head_count")
LLAMA_INTS += (b"attention.head_count_kv", b"rope.dimension_count", b"vocab_size", b"expert_count")


def _extreme(rng: random.Random, lay: Layout) -> bytes:
    key = b"llama." + rng.choice(LLAMA_INTS)
    vtype, n = rng.choice(((U32, 2**32 - 1), (U32, 0), (I32, -1), (U64, 2**63), (U64, 2**64 - 1), (I64, -(2**62))))
    n = rng.choice((n, n, 2**31, 2**40, 3, 7, 32)) if vtype in (U64, I64) and n > 0 else n
    lay.set(key, value(vtype, n))
    return lay.encode()


def _nest(rng: random.Random, lay: Layout) -> bytes:
    depth = rng.choice((2, 8, 64, 1000, 20_000, 100_000))
    lay.set(rng.choice((b"general.tags", b"tokenizer.ggml.tokens", b"llama.block_count")), nested(depth))
    return lay.encode()


def _shapes(rng: random.Random, lay: Layout) -> bytes:
    if rng.random() < 0.5:
        key = rng.choice((b"embedding_length", b"feed_forward_length", b"attention.head_count", b"block_count"))
        lay.set(b"llama." + key, value(U32, rng.choice((1, 2, 4, 8, 12, 32, 64))))
        return lay.encode()
    j = rng.randrange(len(lay.tensors))
    name, dims, ttype, offset = lay.tensors[j]
    dims = rng.choice((dims[::-1], [*dims, 1], dims[:1], [d * 2 for d in dims], [], [0, *dims[1:]], [1] * 5))
    lay.tensors[j] = (name, dims, ttype, offset)
    return lay.encode()


def _tokenizer(rng: random.Random, lay: Layout) -> bytes:
    ints = array(U32, [scalar(U32, n) for n in range(64)])
    choices = {
        b"tokenizer.ggml.tokens": (ints, array(STRING, [string(b"a")] * 64), array(STRING, [string(b"t")] * 3)),
        b"tokenizer.ggml.token_type": (array(STRING, [string(b"1")] * 64), array(I32, [scalar(I32, -7)] * 64)),
        b"tokenizer.ggml.merges": (ints, array(STRING, [string(b"a")] * 5), value(STRING, b"a b")),
        b"tokenizer.ggml.scores": (array(STRING, [string(b"x")] * 64), value(F32, 1.0)),
        b"tokenizer.ggml.bos_token_id": (value(I32, -1), value(U32, 64), value(STRING, b"0"), value(F32, 0.0)),
        b"tokenizer.ggml.model": (value(STRING, b"llama"), value(U32, 1), value(STRING, b"bert")),
        b"tokenizer.ggml.add_bos_token": (value(STRING, b"yes"), ints),
    }
    key = rng.choice(list(choices))
    lay.set(key, rng.choice(choices[key]))
    return lay.encode()


CHAT_BOMBS = (
    b"{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}",
    b"{{ 'x' * 10**9 }}",
    b"{% for i in range(10**9) %}x{% endfor %}",
    b"{{ ('x' * 100000) * 100000 }}",
    b"{% for m in messages %}{{ m.content | upper }}{% endfor %}",
)


def _structure(rng: random.Random, lay: Layout) -> bytes:
    kind = rng.randrange(5)
    if kind == 0:
        lay.counts = (len(lay.tensors) + rng.choice((-1, 1, 1000)), len(lay.kvs) + rng.choice((-1, 1, 10**6)))
    elif kind == 1:
        lay.kvs.append(lay.kvs[rng.randrange(len(lay.kvs))])
    elif kind == 2:
        lay.tensors.append(lay.tensors[rng.randrange(len(lay.tensors))])
    elif kind == 3:
        lay.set(b"general.alignment", rng.choice((value(U32, 0), value(U32, 3), value(U32, 2**31), value(U64, 32))))
    else:
        lay.set(b"tokenizer.chat_template", value(STRING, rng.choice(CHAT_BOMBS)))
    return lay.encode()


def _bulk(rng: random.Random, lay: Layout) -> bytes:
    """Sizes a reader must refuse or take in one pass: counts that would loop or allocate for ever."""
    kind = rng.randrange(4)
    if kind == 0:
        lay.set(b"general.tags", array(0, [b"\0"] * 10**6))  # a megabyte of u8 elements, really there
    elif kind == 1:
        lay.set(b"general.tags", array(STRING, [string(b"")] * 10**5))
    else:
        key = b"llama.block_count" if kind == 2 else rng.choice((b"llama.context_length", b"llama.feed_forward_length"))
        vtype, n = rng.choice(((U32, 2**32 - 1), (U32, 10**6), (U64, 2**40), (I64, 2**62)))
        lay.set(key, value(vtype, n))
    return lay.encode()


MUTATIONS: dict[str, Callable[[random.Random, Layout], bytes]] = {
    "flip": _flip,
    "truncate": _truncate,
    "huge": _huge,
    "utf8": _utf8,
    "retype": _retype,
    "extreme": _extreme,
    "nest": _nest,
    "shapes": _shapes,
    "tokenizer": _tokenizer,
    "structure": _structure,
    "bulk": _bulk,
}


def base_file(directory: Path) -> bytes:
    return write_tiny_gguf(directory / "base.gguf", model=True).read_bytes()


def cases(base: bytes, n: int = 200, seed: int = 0) -> list[tuple[str, bytes]]:
    """`n` mutated files, the same for the same seed: (mutation name, bytes), mutations in turn."""
    kinds = list(MUTATIONS)
    out = []
    for i in range(n):
        rng = random.Random(seed * 100_003 + i)
        kind = kinds[i % len(kinds)]
        out.append((f"{i}:{kind}", MUTATIONS[kind](rng, parse(base))))
    return out


# ----- what the readers make of a file


def _forward(path: Path) -> None:
    model, _ = load_gguf(path)
    t = max(1, min(4, model.cfg.context_length, model.cfg.vocab_size))
    with torch.no_grad():
        model(torch.arange(t)[None] % model.cfg.vocab_size)


def _tokenize(path: Path) -> None:
    g = GGUFFile(path)
    tok = tokenizer_from_gguf(g)
    tok.decode(tok.encode("the cat sat on the mat<|im_end|>"))
    template = g.metadata.get("tokenizer.chat_template")
    if template is not None:
        render_messages(tok, template, [{"role": "user", "content": "hi"}], True)


STEPS: dict[str, Callable[[Path], object]] = {
    "open": GGUFFile,
    "load+forward": _forward,
    "qlora": lambda p: load_base(p, "qlora"),
    "tokenizer+chat": _tokenize,
    "donor": read_donor_embeddings,
}


def classify(path: Path) -> tuple[str, str]:
    """('loaded' | 'named' | 'unnamed' | 'crash', detail): the worst outcome over every reader step."""
    worst, detail = "loaded", ""
    for step, run in STEPS.items():
        try:
            run(path)
        except PipelineError as e:
            msg = str(e)
            ok = msg.isprintable() and (str(path) in msg or not isinstance(e, GGUFError))
            if not ok:
                return "unnamed", f"{step}: {type(e).__name__}: {msg[:160]}"
            if worst == "loaded":
                worst, detail = "named", f"{step}: {type(e).__name__}: {msg[:160]}"
            if step == "open":
                break
        except Exception as e:  # noqa: BLE001 - every other exception is the finding
            return "crash", f"{step}: {type(e).__name__}: {' '.join(str(e).split())[:160]}"
    return worst, detail


def classify_isolated(data: bytes, directory: Path, timeout: float, memory_gib: float = 3.0) -> tuple[str, str]:
    """`classify` in a forked child with a wall-clock and address-space limit: a hang or a runaway
    allocation is counted ('hang', or a MemoryError crash), never suffered."""
    path = directory / "case.gguf"
    path.write_bytes(data)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child
        os.close(r)
        limit = int(_vm_bytes() + memory_gib * 2**30)
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
        try:
            result = classify(path)
        except BaseException as e:  # noqa: BLE001 - RecursionError, MemoryError... still a crash
            result = ("crash", f"{type(e).__name__}: {str(e)[:160]}")
        os.write(w, json.dumps(result).encode())
        os._exit(0)
    os.close(w)
    ready, _, _ = select.select([r], [], [], timeout)
    if not ready:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        os.close(r)
        return "hang", f"no result in {timeout:.0f} s"
    chunks = []
    while chunk := os.read(r, 65536):
        chunks.append(chunk)
    os.close(r)
    _, status = os.waitpid(pid, 0)
    if not chunks:
        return "crash", f"child died (status {status})"
    category, detail = json.loads(b"".join(chunks))
    return category, detail


def _vm_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmSize:"):
            return int(line.split()[1]) * 1024
    return 0


def main(n: int = 200, seed: int = 0, timeout: float = 10.0) -> None:
    """Print the figures: outcomes per category, and every non-named, non-loaded case."""
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        found: Counter[str] = Counter()
        start = time.perf_counter()
        for name, data in cases(base_file(Path(tmp)), n, seed):
            category, detail = classify_isolated(data, Path(tmp), timeout)
            found[category] += 1
            if category not in ("loaded", "named"):
                print(f"{name}: {category}: {detail}")
        print(f"{n} cases (seed {seed}) in {time.perf_counter() - start:.1f} s: {dict(found)}")


if __name__ == "__main__":
    main(*(int(a) for a in sys.argv[1:3]))
