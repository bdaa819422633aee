"""Where a student's loss gap to its donor sits: per-token loss of both on the val split, by token
frequency in the train split, by position in the window, and by whether the target already occurs
earlier in the window (what copying from context, the donor's induction heads, can predict).

    python benchmarks/gap_anatomy.py [--model models/train] [--packed data/packed] [--donor smollm2]

Run from the project root after a `dvc repro` (or `dvc exp run`). Both models read evaluate's exact
windows (consecutive, `--seq-len` tokens, fp32); the table gives each bucket's share of the val
tokens, both mean losses and the bucket's share of the whole gap (its tokens x its gap / all).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import harness  # noqa: F401 (first: this checkout's library on sys.path)
import numpy as np
import torch

from pipeline.data.packed import load_meta, load_split
from pipeline.donor.load import load_donor
from pipeline.donor.locate import resolve_gguf_path
from pipeline.modeldir import load_model_dir


@torch.no_grad()
def token_losses(model: torch.nn.Module, tokens: np.ndarray, seq_len: int, batch: int = 16) -> np.ndarray:
    """(windows, seq_len) next-token NLL over consecutive windows of seq_len + 1 tokens."""
    n = (len(tokens) - 1) // seq_len
    x = torch.from_numpy(np.asarray(tokens[: n * seq_len + 1], dtype=np.int64))
    rows = [(x[i * seq_len : (i + 1) * seq_len], x[i * seq_len + 1 : (i + 1) * seq_len + 1]) for i in range(n)]
    out = []
    for i in range(0, n, batch):
        xs, ys = (torch.stack(t) for t in zip(*rows[i : i + batch]))
        logits = model(xs).float()
        out.append(torch.nn.functional.cross_entropy(logits.transpose(1, 2), ys, reduction="none").numpy())
    return np.concatenate(out)


def buckets(name: str, masks: dict[str, np.ndarray], student: np.ndarray, donor: np.ndarray) -> list[str]:
    total_gap = (student - donor).sum()
    lines = [f"| {name} | share of tokens | student | donor | gap | share of the gap |", "|---|---|---|---|---|---|"]
    for label, m in masks.items():
        if m.any():
            s, d = student[m].mean(), donor[m].mean()
            share = (student[m] - donor[m]).sum() / total_gap
            lines.append(f"| {label} | {m.mean():.0%} | {s:.3f} | {d:.3f} | {s - d:+.3f} | {share:.0%} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=Path("models/train"))
    parser.add_argument("--packed", type=Path, default=Path("data/packed"))
    parser.add_argument("--donor", default="smollm2")
    parser.add_argument("--seq-len", type=int, default=128)
    args = parser.parse_args()
    torch.set_grad_enabled(False)
    meta = load_meta(args.packed)
    train, val = load_split(args.packed, "train"), load_split(args.packed, "val")
    counts = np.bincount(np.asarray(train, dtype=np.int64), minlength=meta.vocab_size)
    student = token_losses(load_model_dir(args.model).float(), val, args.seq_len)
    donor = token_losses(load_donor(resolve_gguf_path(args.donor), meta.vocab_size), val, args.seq_len)
    n = student.size
    targets = np.asarray(val[1 : n + 1], dtype=np.int64).reshape(student.shape)
    freq = counts[targets]
    pos = np.broadcast_to(np.arange(args.seq_len), student.shape)
    print(
        f"val tokens {n}: student {student.mean():.4f}, donor {donor.mean():.4f}, "
        f"gap {student.mean() - donor.mean():+.4f}\n"
    )
    by_freq = {
        "seen > 1000x in train": freq > 1000,
        "101-1000x": (freq > 100) & (freq <= 1000),
        "11-100x": (freq > 10) & (freq <= 100),
        "1-10x": (freq >= 1) & (freq <= 10),
        "never in train": freq == 0,
    }
    by_pos = {"position 0-7": pos < 8, "8-31": (pos >= 8) & (pos < 32), "32-127": pos >= 32}
    print("\n".join(buckets("target token", by_freq, student, donor)) + "\n")
    print("\n".join(buckets("position", by_pos, student, donor)) + "\n")
    seen = earlier_in_window(np.asarray(val[: n + 1], dtype=np.int64), args.seq_len)
    by_copy = {"target seen earlier in the window (copyable)": seen, "not seen earlier": ~seen}
    print("\n".join(buckets("copying", by_copy, student, donor)))


def earlier_in_window(tokens: np.ndarray, seq_len: int) -> np.ndarray:
    """(windows, seq_len): whether each position's target already occurs among its window's inputs up to
    it, i.e. whether copying from the context could predict it (what induction heads do)."""
    n = (len(tokens) - 1) // seq_len
    x, y = tokens[: n * seq_len].reshape(n, seq_len), tokens[1 : n * seq_len + 1].reshape(n, seq_len)
    upto = np.tri(seq_len, dtype=bool)  # [i, j]: input j is at or before position i
    return ((y[:, :, None] == x[:, None, :]) & upto).any(-1)


if __name__ == "__main__":
    main()
