"""Pack a corpus into memory-mapped token ids with the donor's own tokenizer.

Layout of the output directory: `train.bin` and `val.bin` (raw little-endian uint16 when the
vocab fits, else uint32) and `meta.json` (vocab size, dtype, tokenizer fingerprint, corpus
sha256, counts). Documents are split, not tokens, so no document leaks from train into val.

`data.source=instruct` packs instruction examples instead (`pipeline.instruct.pack_instruct`):
`train.npz` / `val.npz` rows with response-only labels and segment ids, the examples as
`train.jsonl` / `val.jsonl`, and the same `meta.json` with `format: instruct`.
"""

from __future__ import annotations

import json
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from pipeline.atomic import atomic_dir, write_json
from pipeline.config import DataConfig
from pipeline.corpus import Document, corpus_sha256
from pipeline.errors import DataError, problem
from pipeline.tokenizer import GGUFTokenizer

SPLITS = ("train", "val")


@dataclass
class PackMeta:
    vocab_size: int
    dtype: str
    tokenizer_fingerprint: str
    corpus_sha256: str
    source: str
    bos_id: int | None
    eos_id: int | None
    documents: dict[str, int]
    tokens: dict[str, int]
    distinct_tokens: int
    format: str = "tokens"  # tokens (train.bin/val.bin) | instruct (train.npz/val.npz rows)
    seq_len: int = 0  # instruct: row length
    stats: dict | None = None  # instruct: per-split counts (examples, truncated, rows, label tokens)


def split_documents(docs: list[Document], val_fraction: float, seed: int) -> dict[str, list[Document]]:
    """A seeded shuffle of documents, the first `val_fraction` of them (at least one) to val."""
    order = list(range(len(docs)))
    random.Random(seed).shuffle(order)
    n_val = min(len(docs) - 1, max(1, round(len(docs) * val_fraction)))
    val = sorted(order[:n_val])
    train = sorted(order[n_val:])
    return {"train": [docs[i] for i in train], "val": [docs[i] for i in val]}


def encode_documents(docs: list[Document], tok: GGUFTokenizer, add_bos: bool, add_eos: bool) -> np.ndarray:
    """All documents' ids concatenated, each wrapped in BOS/EOS as configured."""
    dtype = ids_dtype(tok.vocab_size)
    pieces = []
    for ids in tok.encode_batch([d.text for d in docs]):
        if add_bos and tok.bos_id is not None:
            ids = [tok.bos_id, *ids]
        if add_eos and tok.eos_id is not None:
            ids = [*ids, tok.eos_id]
        pieces.append(np.asarray(ids, dtype=dtype))
    return np.concatenate(pieces) if pieces else np.zeros(0, dtype=dtype)


def ids_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size <= 2**16 else np.dtype(np.uint32)


def resolve_add_bos(setting: str, tok: GGUFTokenizer) -> bool:
    """`auto` follows the GGUF's add_bos_token flag, as llama.cpp does."""
    return tok.add_bos if setting == "auto" else setting == "true"


def pack(docs: list[Document], tok: GGUFTokenizer, cfg: DataConfig, out_dir: Path) -> tuple[PackMeta, dict[str, float]]:
    """Tokenize, split and write `out_dir` atomically; returns the meta and the stage metrics."""
    start = time.perf_counter()
    splits = split_documents(docs, cfg.val_fraction, cfg.split_seed)
    add_bos = resolve_add_bos(cfg.add_bos, tok)
    arrays = {name: encode_documents(splits[name], tok, add_bos, cfg.add_eos) for name in SPLITS}
    elapsed = time.perf_counter() - start
    total = sum(a.size for a in arrays.values())
    distinct = int(np.unique(np.concatenate(list(arrays.values()))).size)
    meta = PackMeta(
        vocab_size=tok.vocab_size,
        dtype=ids_dtype(tok.vocab_size).name,
        tokenizer_fingerprint=tok.fingerprint(),
        corpus_sha256=corpus_sha256(docs),
        source=cfg.source,
        bos_id=tok.bos_id if add_bos else None,
        eos_id=tok.eos_id if cfg.add_eos else None,
        documents={name: len(splits[name]) for name in SPLITS},
        tokens={name: int(arrays[name].size) for name in SPLITS},
        distinct_tokens=distinct,
    )
    with atomic_dir(out_dir) as tmp:
        for name in SPLITS:
            arrays[name].astype(arrays[name].dtype.newbyteorder("<")).tofile(tmp / f"{name}.bin")
        write_json(tmp / "meta.json", asdict(meta))
    metrics = {
        "documents": float(len(docs)),
        "documents_train": float(len(splits["train"])),
        "documents_val": float(len(splits["val"])),
        "tokens": float(total),
        "tokens_train": float(arrays["train"].size),
        "tokens_val": float(arrays["val"].size),
        "distinct_tokens": float(distinct),
        "tokens_per_second": total / max(elapsed, 1e-9),
    }
    return meta, metrics


def load_meta(packed_dir: Path) -> PackMeta:
    """The packed data's meta, with a named error when the pack stage has not run."""
    path = Path(packed_dir) / "meta.json"
    if not path.is_file():
        raise DataError(problem(str(path), "packed data from the pack stage", "no such file", "run: dvc repro pack"))
    try:
        return PackMeta(**json.loads(path.read_text()))
    except (json.JSONDecodeError, TypeError) as e:
        raise DataError(problem(str(path), "a pack meta.json", f"unreadable ({e})", "re-run: dvc repro pack")) from None


def data_files(packed_dir: Path) -> list[Path]:
    """The files that identify the packed data (for checkpoint compatibility)."""
    ext = "npz" if load_meta(packed_dir).format == "instruct" else "bin"
    return [Path(packed_dir) / n for n in ("meta.json", f"train.{ext}", f"val.{ext}")]


def load_data(packed_dir: Path, split: str):  # -> np.memmap | pipeline.instruct.Packed
    """One split as the training loop takes it: token ids, or instruct rows."""
    if load_meta(packed_dir).format == "instruct":
        from pipeline.instruct import load_packed

        return load_packed(Path(packed_dir) / f"{split}.npz")
    return load_split(packed_dir, split)


def load_split(packed_dir: Path, split: str) -> np.memmap:
    """One split's ids as a read-only memmap (the whole corpus is never loaded into RAM)."""
    meta = load_meta(packed_dir)
    if meta.format != "tokens":
        raise DataError(
            problem(
                str(packed_dir),
                "running-text token ids (train.bin/val.bin)",
                f"{meta.format} data (data.source={meta.source})",
                "use text data here, or a stage that takes instruct rows",
            )
        )
    path = Path(packed_dir) / f"{split}.bin"
    expected = meta.tokens[split] * np.dtype(meta.dtype).itemsize
    if not path.is_file() or path.stat().st_size != expected:
        found = path.stat().st_size if path.is_file() else "no file"
        raise DataError(problem(str(path), f"{expected} bytes per meta.json", f"{found}", "re-run: dvc repro pack"))
    return np.memmap(path, dtype=np.dtype(meta.dtype).newbyteorder("<"), mode="r")


def run_pack(data: DataConfig, donor_path: Path, out_dir: Path) -> tuple[PackMeta, dict[str, float]]:
    """The pack stage: the donor's tokenizer over the configured corpus, written to `out_dir`."""
    from pipeline.corpus import load_documents
    from pipeline.gguf_io import GGUFFile
    from pipeline.tokenizer import tokenizer_from_gguf

    g = GGUFFile(donor_path)
    tok = tokenizer_from_gguf(g)
    if data.source == "instruct":
        from pipeline.instruct import pack_instruct

        return pack_instruct(data, tok, g.metadata, out_dir)
    return pack(load_documents(data), tok, data, out_dir)
