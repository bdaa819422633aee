"""Whether a model copies from its context as its donor does: the loss on a sequence's second showing.

    python benchmarks/copy_probe.py [MODEL_DIR ...] [--packed data/packed] [--donor smollm2] [--out FILE]

Run from the project root after a `dvc repro` (or `dvc exp run`); each MODEL_DIR (default: models/init and
models/train) and the donor read the same two probes, 48 tokens each shown twice:

- random: tokens drawn from the train split, so the repeat can only be predicted by copying;
- text: consecutive windows of the val split, so the first showing is the model's ordinary loss.

It prints each probe's loss on the first and on the second showing and, per model, the strongest
induction head of each layer (`pipeline.donor.circuits.copy_scores`). On perl-doc the donor's loss on
the random repeat is 0.718 nats and the default student's 5.877: it copies far worse, which is where its
gap on code and documentation sits (benchmarks/results/copy_circuit_2026-12-01.md).
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import harness  # noqa: F401 (first: this checkout's library on sys.path)
import numpy as np
import torch
from harness import write_results

from pipeline.data.packed import load_meta, load_split
from pipeline.donor.circuits import copy_scores, probe_sequences
from pipeline.donor.load import load_donor
from pipeline.donor.locate import resolve_gguf_path
from pipeline.modeldir import load_model_dir

LENGTH, SEQUENCES = 48, 32


def probes(packed: Path) -> dict[str, torch.Tensor]:
    train = torch.from_numpy(np.asarray(load_split(packed, "train"), dtype=np.int64))
    val = np.asarray(load_split(packed, "val"), dtype=np.int64)
    starts = np.random.default_rng(0).integers(0, len(val) - LENGTH, size=SEQUENCES)
    text = torch.from_numpy(np.stack([val[s : s + LENGTH] for s in starts]))
    return {"random": probe_sequences(train.view(1, -1), SEQUENCES, LENGTH), "text": torch.cat([text, text], 1)}


@torch.no_grad()
def showings(model: torch.nn.Module, ids: torch.Tensor) -> tuple[float, float]:
    """Mean next-token loss over the first showing and over the second (its first token excluded)."""
    nll = torch.nn.functional.cross_entropy(model(ids[:, :-1]).float().transpose(1, 2), ids[:, 1:], reduction="none")
    return float(nll[:, : LENGTH - 1].mean()), float(nll[:, LENGTH:].mean())


def measure(name: str, model: torch.nn.Module, sets: dict[str, torch.Tensor]) -> dict:
    row: dict = {"model": name}
    for probe, ids in sets.items():
        row[f"{probe}_first"], row[f"{probe}_repeat"] = showings(model, ids)
    induction, previous = copy_scores(model, sets["random"][:, :LENGTH])
    row["induction_by_layer"] = [round(float(v), 3) for v in induction.max(1)]
    row["previous_by_layer"] = [round(float(v), 3) for v in previous.max(1)]
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="*", type=Path, default=[Path("models/init"), Path("models/train")])
    parser.add_argument("--packed", type=Path, default=Path("data/packed"))
    parser.add_argument("--donor", default="smollm2")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    load_before = os.getloadavg()[0]
    sets = probes(args.packed)
    vocab = load_meta(args.packed).vocab_size
    rows = [measure(str(d), load_model_dir(d).float().eval(), sets) for d in args.models]
    rows.append(measure("donor", load_donor(resolve_gguf_path(args.donor), vocab).eval(), sets))
    print("| model | random: first | random: repeat | text: first | text: repeat | strongest induction head (layer) |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        best = int(np.argmax(r["induction_by_layer"]))
        print(
            f"| {r['model']} | {r['random_first']:.3f} | {r['random_repeat']:.3f} | {r['text_first']:.3f} "
            f"| {r['text_repeat']:.3f} | {r['induction_by_layer'][best]:.2f} ({best}) |"
        )
    if args.out:
        shown = ("random_first", "random_repeat", "text_first", "text_repeat")
        figures = {f"{Path(r['model']).name}_{k}": f"{r[k]:.3f}" for r in rows for k in shown}
        write_results(args.out, figures, {"rows": rows}, load_before)


if __name__ == "__main__":
    main()
