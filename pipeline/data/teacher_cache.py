"""The teacher-cache format (`data/teach/`): the one module that writes and reads it.

`meta.json` says what the cache was made from (sha256 of the packed `train.bin`, the corpus and
tokenizer fingerprints of the packed meta, the donor's sha256 from `data/inputs/donor.json`), how
(top_k, context, vocab) and the donor's fp32 val loss. When a cache is kept (`mode: cached`),
every position p of the train token stream has a row: the donor's top-k next-token ids after
tokens[..p] (`ids.npy`, uint16 when the vocab fits, else int32), their full-softmax log-probs
(`logprobs.npy`, float16, descending) and the log of the mass of every other token (`tail.npy`,
float32). They are `.npy` files read back as read-only memmaps: batches gather their rows.
When the train split is larger than `train.distill.cache_tokens`, the cache covers evenly spread
spans of it (`spans`), whose tokens are kept beside it (`tokens.npy`): training draws its
distillation windows from them (`pipeline.training.batches.MixedSampler`). With `source: donor` the
cached text is not the corpus but the donor's own greedy continuations of prompts taken from it
(`pipeline.distill.continuations`): `tokens.npy` holds them end to end, `sequence` tokens each, and
`spans` the prompts' places in the train split. Beside the donor's
val loss, its greedy choice over the same val windows (`val_choice.npy`, int32, windows x seq_len)
is what a student is scored against as the donor's draft model.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from pipeline.errors import DataError, problem
from pipeline.io.files import write_json

META_FILE = "meta.json"
IDS_FILE = "ids.npy"
LOGPROBS_FILE = "logprobs.npy"
TAIL_FILE = "tail.npy"
TOKENS_FILE = "tokens.npy"
VAL_CHOICE_FILE = "val_choice.npy"  # the donor's greedy choice at every position of the val windows
FIX = "run: dvc repro teach"


@dataclass
class TeachMeta:
    """What `data/teach` holds and what it was made from."""

    mode: str  # off (distillation off: nothing cached) | cached (the arrays are there) | online (no arrays)
    top_k: int
    context: int
    seq_len: int  # train.seq_len: the context every cached position has at least, and the donor val loss's
    vocab_size: int
    positions: int  # rows of the arrays: the train split's tokens, or its spans' (0 when nothing is cached)
    train_sha256: str
    corpus_sha256: str
    tokenizer_fingerprint: str
    donor_sha256: str
    donor_name: str
    donor_val_loss: float | None = None  # fp32, over the val split's windows of seq_len (evaluate's)
    donor_val_tokens: int = 0
    val_sha256: str = ""  # the val split the donor val loss is of
    precision: str = "bf16"  # what the donor ran in for the cache
    seconds: float = 0.0
    spans: list[list[int]] = field(default_factory=list)  # [start, end) of the train split cached; [] = all
    source: str = "corpus"  # corpus: the spans' own text | donor: its greedy continuations of the spans (prompts)
    sequence: int = 0  # source=donor: each continuation's length (train.seq_len + 1), laid end to end
    vocab_rows: int = 0  # > 0: the top-k is over these many ids the splits use (train.vocab=corpus); 0: all

    @property
    def cached(self) -> bool:
        return self.mode == "cached"


def ids_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size <= 65535 else np.dtype(np.int32)


def write_meta(out_dir: Path, meta: TeachMeta) -> None:
    write_json(Path(out_dir) / META_FILE, asdict(meta))


def read_meta(teach_dir: Path) -> TeachMeta:
    """The cache's meta, with a named error when the teach stage has not run."""
    path = Path(teach_dir) / META_FILE
    if not path.is_file():
        raise DataError(problem(str(path), "the teach stage's record", "no such file", FIX))
    try:
        return TeachMeta(**json.loads(path.read_text()))
    except (json.JSONDecodeError, TypeError) as e:
        raise DataError(problem(str(path), "a teach meta.json", f"unreadable ({e})", FIX)) from None


def create_arrays(out_dir: Path, positions: int, top_k: int, vocab_size: int) -> tuple[np.memmap, ...]:
    """Writable memmaps (ids, log-probs, tail) of `positions` rows in `out_dir` (a temp dir)."""
    out = Path(out_dir)
    shapes = ((IDS_FILE, ids_dtype(vocab_size), (positions, top_k)), (LOGPROBS_FILE, np.float16, (positions, top_k)))
    arrays = [np.lib.format.open_memmap(out / n, mode="w+", dtype=d, shape=s) for n, d, s in shapes]
    return *arrays, np.lib.format.open_memmap(out / TAIL_FILE, mode="w+", dtype=np.float32, shape=(positions,))


class TeacherCache:
    """The cached targets of a train split, as read-only memmaps (never loaded whole)."""

    def __init__(self, teach_dir: Path):
        self.dir = Path(teach_dir)
        self.meta = read_meta(self.dir)
        if not self.meta.cached:
            raise DataError(
                problem(
                    str(self.dir / META_FILE),
                    "a cache of the donor's top-k (mode cached)",
                    f"mode {self.meta.mode} (made with distillation off or online)",
                    "set train.distill.weight > 0 and train.distill.mode=cached, then " + FIX,
                )
            )
        self.ids, self.logprobs, self.tail = (self._open(n) for n in (IDS_FILE, LOGPROBS_FILE, TAIL_FILE))
        self.tokens = self._open(TOKENS_FILE) if self.meta.spans else None  # the spans' tokens, in order

    def _open(self, name: str) -> np.memmap:
        path = self.dir / name
        try:
            array = np.load(path, mmap_mode="r")
        except (OSError, ValueError) as e:
            raise DataError(problem(str(path), "a teacher-cache array (.npy)", f"unreadable ({e})", FIX)) from None
        if array.shape[0] != self.meta.positions:
            raise DataError(problem(str(path), f"{self.meta.positions} rows", str(array.shape[0]), FIX))
        return array

    def gather(self, starts: np.ndarray, length: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(ids int64, log-probs float32, tail float32) of positions start..start+length-1 for each start:
        (B, length, k), (B, length, k), (B, length)."""
        rows = np.asarray(starts, dtype=np.int64)[:, None] + np.arange(length)
        return (
            self.ids[rows].astype(np.int64),
            self.logprobs[rows].astype(np.float32),
            self.tail[rows].astype(np.float32),
        )


def read_val_choice(teach_dir: Path) -> np.ndarray | None:
    """The donor's greedy choices over the val windows, when the teach stage recorded them."""
    path = Path(teach_dir) / VAL_CHOICE_FILE
    return np.load(path) if path.is_file() else None
