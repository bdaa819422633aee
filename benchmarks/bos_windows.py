"""Why windows begin with BOS where the donor's tokenizer adds one: the donor's val loss both ways.

    python benchmarks/bos_windows.py [--workspace .] [--windows 56] [--out FILE]

Run after `dvc repro` of a donor whose tokenizer adds BOS (`-S donor=gemma3-270m`) in `--workspace`.
The donor (fp32) scores the same consecutive val windows of 128 tokens twice: as cut from the text, and
with each window's first token replaced by BOS (what the stages do, `pipeline.data.packed.TokenSplit`).
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import harness
import numpy as np
import torch
import yaml

from pipeline.data.packed import load_meta, load_split
from pipeline.donor.load import load_donor
from pipeline.donor.locate import resolve_gguf_path


@torch.no_grad()
def mean_nll(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, batch: int = 8) -> float:
    total = 0.0
    for i in range(0, len(x), batch):
        logits = model(x[i : i + batch]).float()
        nll = torch.nn.functional.cross_entropy(logits.flatten(0, 1), y[i : i + batch].flatten(), reduction="sum")
        total += float(nll)
    return total / y.numel()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workspace", type=Path, default=harness.ROOT)
    ap.add_argument("--windows", type=int, default=56)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    load = os.getloadavg()[0]
    val = load_split(args.workspace / "data/packed", "val")
    if val.bos is None:
        raise SystemExit("this workspace's donor adds no BOS: nothing to compare")
    n = min(args.windows, (len(val) - 1) // 128)
    tokens = torch.from_numpy(np.asarray(val[: n * 128 + 1], dtype=np.int64))
    x, y = tokens[:-1].view(n, 128).clone(), tokens[1:].view(n, 128)
    spec = yaml.safe_load((args.workspace / "params.yaml").read_text())["donor"]["path"]
    model = load_donor(resolve_gguf_path(spec), load_meta(args.workspace / "data/packed").vocab_size)
    rows = {"mid_text": mean_nll(model, x, y)}
    x[:, 0] = val.bos
    rows["bos_first"] = mean_nll(model, x, y)
    print(f"{n} windows of 128: {rows['mid_text']:.4f} nats/token as cut, {rows['bos_first']:.4f} with BOS first")
    if args.out:
        figures = {name: f"{value:.2f} nats" for name, value in rows.items()}
        harness.write_results(args.out, figures, {**rows, "windows": n}, load)


if __name__ == "__main__":
    main()
