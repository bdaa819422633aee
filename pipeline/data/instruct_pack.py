"""The pack stage for `data.source=instruct`: split the JSONL lines by example, write the splits'
sources beside the packed rows, and pack each split (`pipeline.data.instruct` formats and tokenizes)."""

from __future__ import annotations

import hashlib
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.config import DataConfig
from pipeline.data.instruct import build_instruct, instruct_lines, read_instruct_jsonl
from pipeline.data.packed import SPLITS, Packed, PackMeta, save_rows, write_meta
from pipeline.data.pydoc_qa import write_pydoc_instruct
from pipeline.data.split import split_indices
from pipeline.errors import DataError, problem
from pipeline.io.files import atomic_dir, write_text
from pipeline.tokenizer.gguf_tokenizer import GGUFTokenizer


def split_examples(lines: list[str], val_fraction: float, seed: int) -> dict[str, list[str]]:
    """Example lines of each split (see `pipeline.data.split`), order kept within a split."""
    if len(lines) < 2:
        raise DataError(
            problem("instruct data", "at least 2 examples (one train, one val)", str(len(lines)), "add examples")
        )
    train, val = split_indices(len(lines), val_fraction, seed)
    return {"train": [lines[i] for i in train], "val": [lines[i] for i in val]}


def write_instruct_splits(data: DataConfig, out_dir: Path) -> dict[str, int]:
    """`train.jsonl` / `val.jsonl` in `out_dir`: the pydoc Q/A set (data.path empty, split by topic)
    or the lines of the JSONL at data.path, every line validated first (errors name the line)."""
    if not data.path:
        return write_pydoc_instruct(out_dir, data.val_fraction, data.split_seed, data.max_chars)
    read_instruct_jsonl(data.path)  # a malformed line is an error naming it, before anything is written
    lines = [line for _, line in instruct_lines(Path(data.path))]
    split = split_examples(lines, data.val_fraction, data.split_seed)
    for name, rows in split.items():
        write_text(Path(out_dir) / f"{name}.jsonl", "".join(r + "\n" for r in rows))
    return {"train": len(split["train"]), "val": len(split["val"])}


def pack_instruct(
    data: DataConfig, tokenizer: GGUFTokenizer, metadata: dict[str, Any], out_dir: Path
) -> tuple[PackMeta, dict[str, float]]:
    """The pack stage for instruct data: split, format with the base's chat template (or the plain
    one), truncate, pack, and write `out_dir` atomically."""
    start = time.perf_counter()
    with atomic_dir(out_dir) as tmp:
        write_instruct_splits(data, tmp)
        packed = {n: build_instruct(read_instruct_jsonl(tmp / f"{n}.jsonl"), tokenizer, metadata, data) for n in SPLITS}
        for name, p in packed.items():
            save_rows(p, tmp / f"{name}.npz")
        sha = hashlib.sha256(b"".join((tmp / f"{n}.jsonl").read_bytes() for n in SPLITS)).hexdigest()
        meta = _instruct_meta(tokenizer, packed, sha, data)
        write_meta(tmp, meta)
    metrics: dict[str, float] = {
        "seconds": time.perf_counter() - start,
        "chat_template": float(packed["train"].stats["chat_template"]),
    }
    for name, p in packed.items():
        for key in ("examples", "truncated", "rows", "label_tokens", "prompt_tokens", "response_tokens"):
            metrics[f"{key}_{name}"] = float(p.stats[key])
    metrics["tokens"] = float(sum(p.stats["filled_positions"] for p in packed.values()))
    return meta, metrics


def _instruct_meta(tokenizer: GGUFTokenizer, packed: dict[str, Packed], sha: str, data: DataConfig) -> PackMeta:
    ids = np.concatenate([p.input_ids[p.segment_ids > 0] for p in packed.values()])
    return PackMeta(
        vocab_size=tokenizer.vocab_size,
        dtype="int64",
        tokenizer_fingerprint=tokenizer.fingerprint(),
        corpus_sha256=sha,
        source="instruct",
        bos_id=tokenizer.bos_id,
        eos_id=tokenizer.eos_id,
        documents={n: p.stats["examples"] for n, p in packed.items()},
        tokens={n: p.stats["filled_positions"] for n, p in packed.items()},
        distinct_tokens=int(np.unique(ids).size),
        format="instruct",
        seq_len=data.max_seq_len,
        stats={n: p.stats for n, p in packed.items()},
        data=asdict(data),
    )
