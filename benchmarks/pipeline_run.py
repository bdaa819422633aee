"""One whole pipeline run, cold, with what it measured and how long each stage took.

    python benchmarks/pipeline_run.py NAME [-S key=value ...] --out benchmarks/results/pipeline_NAME.json

Run from the project root after `make setup`. It runs `dvc exp run --force -n NAME -S ...` (every stage
re-runs: the wall time is a cold run's, pack to report) and records the wall time, each stage's (from
DVC's own output), and the headline metrics the stages wrote: the val loss of the export and the
donor's on the same windows (text), a fine-tune's held-out loss before and after, the llama.cpp parity
check, the train stage's seconds and steps. `NAME=default` with no override is `make repro`'s pipeline.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from harness import read_metrics, refuse_warm_checkpoints, timed_exp_run, write_results

from stages._malloc import malloc_env

KEYS = {  # (stage, metric) -> the figure's name
    ("evaluate", "val_loss"): "val_loss",
    ("evaluate", "donor_val_loss"): "donor_val_loss",
    ("evaluate", "base_val_loss"): "base_val_loss",
    ("evaluate", "llamacpp_top1_agreement"): "llamacpp_top1",
    ("train", "steps"): "steps",
    ("train", "seconds"): "train_seconds",
    ("train", "initial_val_loss"): "initial_val_loss",
}


def figures(record: dict) -> dict[str, str]:
    """The named figures the docs quote: wall time, each stage's, and the headline metrics."""
    wall = record["wall_seconds"]
    out = {"wall": f"{int(wall // 60)} min {int(wall % 60)} s", "wall_s": f"{wall:.0f} s"}
    out |= {f"{stage}_s": f"{s:.0f} s" for stage, s in record["stages"].items()}
    for name, value in record["metrics"].items():
        if name in ("steps",):
            out[name] = f"{value:.0f}"
        elif name == "llamacpp_top1":
            out[name] = f"{value:.1%}"
        elif name == "train_seconds":
            out[name] = f"{value:.0f} s"
        else:
            out[name] = f"{value:.4f}"
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("name", help="the experiment's name (default: make repro's pipeline, with no override)")
    ap.add_argument("-S", dest="overrides", action="append", default=[], help="one override (key=value)")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    refuse_warm_checkpoints()
    load = os.getloadavg()[0]
    wall, stages = timed_exp_run(["--force", "-n", args.name], args.overrides)
    metrics = {}
    for (stage, key), name in KEYS.items():
        value = read_metrics(stage).get(key)
        if value is not None:
            metrics[name] = value
    record = {"overrides": args.overrides, "wall_seconds": wall, "stages": stages, "metrics": metrics}
    print(f"{args.name}: {wall:.0f} s; " + ", ".join(f"{k} {v:.0f} s" for k, v in stages.items()))
    print(", ".join(f"{k} {v:.4g}" for k, v in metrics.items()))
    write_results(args.out, figures(record), record, load, child_env=malloc_env())  # train restarts under it


if __name__ == "__main__":
    main()
