"""What a large vocabulary's softmax costs a training step, side by side in one process.

    python benchmarks/vocab_cost.py [--workspace .] [--steps 6] [--rounds 3] [--out FILE]

Run after `dvc repro` of a large-vocabulary donor in `--workspace` (e.g. `-S donor=gemma3-270m`: a
262,144-token head). It loads the realized student (models/init), the packed train split and the teach
cache, and times the default step (bf16 autocast, the distillation loss, AdamW over what trains) with
training's softmax over:

- full:      every row of the head (train.vocab=full);
- corpus:    the ids the splits and the teacher use (train.vocab=corpus, train.vocab_negatives=0);
- corpus_8k: those and 8,192 others sampled per step, standing for the rest (the default for >65,536).

The contenders take turns on the same batches (`--rounds` rounds of `--steps` steps each, after one
warm-up step), each from the same weights; the median step and its ratio to `full` are printed.
What each does to the loss is the train stage's business: docs/donor.md gives both runs' val losses.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import time
from pathlib import Path

import harness
import numpy as np
import torch

from pipeline.data.packed import load_split
from pipeline.data.teacher_cache import TeacherCache
from pipeline.modeldir import load_model_dir
from pipeline.models.ops.head_rows import HeadVocab, corpus_vocabulary

CONTENDERS = {"full": None, "corpus": 0, "corpus_8k": 8192}


def batches(ws: Path, n: int, seq_len: int = 128, batch: int = 8, seed: int = 0) -> list[tuple]:
    """`n` batches of windows of the train split with their cached teacher targets (top-32)."""
    train, cache = load_split(ws / "data/packed", "train"), TeacherCache(ws / "data/teach")
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        starts = rng.integers(0, cache.meta.positions - seq_len - 1, size=batch)
        rows = torch.from_numpy(np.stack([np.asarray(train[s : s + seq_len + 1], dtype=np.int64) for s in starts]))
        ids, logp, tail = (torch.from_numpy(np.asarray(a)) for a in cache.gather(starts, seq_len))
        out.append((rows[:, :-1], rows[:, 1:], (ids.long(), logp.float(), tail.float())))
    return out


def step(model: torch.nn.Module, opt: torch.optim.Optimizer, b: tuple) -> float:
    x, y, teacher = b
    t0 = time.perf_counter()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss, _ = model.distill_loss(x, y, teacher, 0.5, 1.0)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workspace", type=Path, default=harness.ROOT)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    load = os.getloadavg()[0]
    ws = args.workspace.resolve()
    base = load_model_dir(ws / "models/init")
    base.tok_embd.weight.requires_grad_(False)  # the default freezes the table (optim.table_lr_scale=0)
    vocab = base.cfg.vocab_size
    used = corpus_vocabulary([load_split(ws / "data/packed", s) for s in ("train", "val")], None, vocab)
    models = {}
    for name, negatives in CONTENDERS.items():
        model = copy.deepcopy(base).train()
        model.head_vocab = None if negatives is None else HeadVocab.of(used, vocab, negatives)
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
        models[name] = (model, opt)
    data = batches(ws, args.steps + 1)
    times: dict[str, list[float]] = {name: [] for name in CONTENDERS}
    for model, opt in models.values():
        step(model, opt, data[0])  # warm-up
    for _ in range(args.rounds):
        for name, (model, opt) in models.items():
            times[name] += [step(model, opt, b) for b in data[1:]]
    median = {name: statistics.median(t) for name, t in times.items()}
    rows = {name: {"median_step_s": m, "vs_full": median["full"] / m} for name, m in median.items()}
    print(f"{vocab:,}-row head, {int(used.sum()):,} ids in use, width {base.cfg.d_model}, {base.cfg.n_layer} layers")
    for name, r in rows.items():
        print(f"{name:>10}: {r['median_step_s'] * 1000:7.0f} ms/step, {r['vs_full']:.2f}x the full softmax's speed")
    if args.out:
        figures = {f"{n}_vs_full": f"{r['vs_full']:.1f}x" for n, r in rows.items() if n != "full"}
        figures |= {f"{n}_ms": f"{r['median_step_s'] * 1000:.0f} ms" for n, r in rows.items()}
        harness.write_results(args.out, figures, rows, load, ids_in_use=int(used.sum()), vocab=vocab)


if __name__ == "__main__":
    main()
