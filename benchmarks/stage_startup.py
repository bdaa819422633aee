"""A train stage's start-up: the restart under tcmalloc against no restart, in one or more checkouts.

    python benchmarks/stage_startup.py [--tree DIR ...] [--rounds 7] --out benchmarks/results/X.json

Each round runs `python -m stages.train --help` (its imports, Hydra's compose, the help) in every
tree twice, side by side: as a stage runs (restarted once under the fast allocator where the machine
has one) and with `PIPELINE_MALLOC=system` (no restart: the floor). The restart's cost is the first's
median minus the second's. `--tree` adds another checkout (e.g. a `git worktree` of an older commit)
run with the same interpreter; the default is this one.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from harness import allocator, commit, write_results

from stages._malloc import malloc_env

ROOT = Path(__file__).resolve().parent.parent


def launch_seconds(tree: Path, env: dict[str, str]) -> float:
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "stages.train", "--help"], cwd=tree, env=env, check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - start


def measure(trees: list[Path], rounds: int) -> dict[str, dict[str, list[float]]]:
    """Per tree, each round's seconds as a stage starts and with no restart, in turn."""
    base = {k: v for k, v in os.environ.items() if k not in ("PIPELINE_MALLOC", "LD_PRELOAD")}
    envs = {"restart": base, "no_restart": {**base, "PIPELINE_MALLOC": "system"}}
    out = {str(t): {name: [] for name in envs} for t in trees}
    for t in trees:  # warm the page cache and the .pyc files once
        launch_seconds(t, envs["no_restart"])
    for _ in range(rounds):
        for t in trees:
            for name, env in envs.items():
                out[str(t)][name].append(launch_seconds(t, {**env, "PYTHONPATH": str(t)}))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tree", type=Path, action="append", default=[], help="another checkout to time as well")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    load = os.getloadavg()[0]
    trees = [ROOT, *(t.resolve() for t in args.tree)]
    data = measure(trees, args.rounds)
    figures = {}
    for i, t in enumerate(trees):
        tag = "this" if i == 0 else f"tree{i}"
        med = {name: statistics.median(v) for name, v in data[str(t)].items()}
        figures |= {f"{tag}_restart_s": f"{med['restart']:.2f} s", f"{tag}_no_restart_s": f"{med['no_restart']:.2f} s",
                    f"{tag}_restart_cost_s": f"{med['restart'] - med['no_restart']:.2f} s"}
        print(f"{t}: {med['restart']:.2f} s as a stage starts, {med['no_restart']:.2f} s without the restart")
    trees_run = {str(t): {"commit": commit(t)} for t in trees}
    write_results(args.out, figures, data, load, trees=trees_run, fast_allocator=allocator(malloc_env()))


if __name__ == "__main__":
    main()
