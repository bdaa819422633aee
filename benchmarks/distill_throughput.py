"""Training throughput with and without distillation, through the real loop (`pipeline.training.loop.train`).

    python benchmarks/distill_throughput.py [--steps 12] [--rounds 3] [--modes off cached online]

Run from the project root after `dvc repro teach` with distillation on (it reads models/init,
data/packed, data/teach and the donor GGUF). Each round trains the realized default student for
`--steps` steps per mode, one mode after the other (the machine is shared, so modes alternate and
the median over rounds of each round's median step is reported): `off` is plain cross-entropy,
`cached` gathers the teach cache's top-k for each window, `online` runs the donor on every batch.
Tokens/s counts the student's training tokens (batch x seq_len per step).
"""

from __future__ import annotations

import argparse
import statistics
from dataclasses import replace

from harness import ROOT  # first: this checkout's library on sys.path

from pipeline.config import DistillConfig, OptimConfig, TrainConfig
from pipeline.data.packed import load_split
from pipeline.donor.locate import resolve_gguf_path
from pipeline.modeldir import load_model_dir
from pipeline.training.loop import TrainJob, train
from pipeline.training.trainer import load_teacher


def step_rate(mode: str, steps: int, teachers: dict) -> float:
    """The median tokens/s of `steps` training steps (the first, warm-up, left out) in `mode`."""
    distill = DistillConfig() if mode == "off" else DistillConfig(weight=0.5, mode=mode)
    tcfg = TrainConfig(steps=steps, eval_every=10**6, log_every=1, checkpoint_every=0, max_epochs=0)
    tcfg = replace(tcfg, distill=distill)
    packed = ROOT / "data" / "packed"
    if mode not in teachers:
        teachers[mode] = load_teacher(tcfg, ROOT / "data" / "teach", resolve_gguf_path("smollm2"), 49152)
    model = load_model_dir(ROOT / "models" / "init")
    val = load_split(packed, "val")[:1000]  # the one validation at the end, kept short
    job = TrainJob(tcfg, OptimConfig(), 0, progress=False)
    result = train(model, load_split(packed, "train"), val, job, teacher=teachers[mode])
    return statistics.median(h["tokens_per_second"] for h in result.history[1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--modes", nargs="+", default=["off", "cached", "online"])
    args = parser.parse_args()
    rates: dict[str, list[float]] = {m: [] for m in args.modes}
    teachers: dict = {}
    for r in range(args.rounds):
        for mode in args.modes:
            rates[mode].append(step_rate(mode, args.steps, teachers))
            print(f"round {r + 1} {mode}: {rates[mode][-1]:.0f} tok/s", flush=True)
    base = statistics.median(rates[args.modes[0]])
    for mode in args.modes:
        rate = statistics.median(rates[mode])
        print(f"{mode:>7}: {rate:7.0f} tok/s  ({rate / base:.2f}x {args.modes[0]})")


if __name__ == "__main__":
    main()
