"""Which donor layers a subclone keeps, chosen by loss: greedy removal from the whole donor, each round
dropping the layer whose absence raises the loss least on train windows (the perplexity criterion of
Shortened LLaMA, arXiv 2402.02834), against the default `importance` rule, both scored at step 0.

    python benchmarks/layer_search.py [--keep N] [--tokens 1024] [--donor smollm2]

Run from the project root after `dvc repro realize` (or `dvc exp run ... realize`) on the corpus: it
reads data/packed, data/donor and models/init/realize.json. It prints the removal path, both layer
sets' step-0 val loss (realize's: cut, gain fitted, the first 8,192 val tokens) and the override that
trains the searched set (`recipe.subclone.layers='...'`); the trained result is a `dvc exp run` away.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import harness  # noqa: F401 (first: this checkout's library on sys.path)
import numpy as np
import torch

from pipeline.config import ModelConfig, RecipeConfig, SubcloneConfig
from pipeline.data.packed import load_split, window_bos
from pipeline.donor.load import load_llama_donor
from pipeline.donor.locate import resolve_gguf_path
from pipeline.init.realize import realize_subclone
from pipeline.models.llama import Llama
from pipeline.training.validation import evaluate_loss

CPU = torch.device("cpu")


@torch.no_grad()
def greedy_removal(donor: Llama, tokens: np.ndarray, keep: int) -> list[int]:
    """Donor layers left after removing, one at a time, the one whose absence costs the least loss."""
    blocks, kept = list(donor.blocks), list(range(len(donor.blocks)))

    def loss_without(drop: int) -> float:
        donor.blocks = torch.nn.ModuleList([blocks[i] for i in kept if i != drop])
        return evaluate_loss(donor, tokens, 128, 8, CPU)

    start = time.perf_counter()
    while len(kept) > keep:
        loss, drop = min((loss_without(c), c) for c in kept)
        kept.remove(drop)
        print(f"{len(kept):2d} layers: without {drop:2d}, loss {loss:.4f} ({time.perf_counter() - start:.0f} s)")
    donor.blocks = torch.nn.ModuleList(blocks)
    return kept


def step0_val(root: Path, donor_path: Path, rule: str, keep: int) -> tuple[list[int], float]:
    """Realize's own step-0 val loss (the cut, its gain fit) for the `keep` layers `rule` picks."""
    record = json.loads((root / "models/init/realize.json").read_text())
    recipe = RecipeConfig(name="subclone", init="subclone", subclone=SubcloneConfig(layers=rule))
    mcfg = ModelConfig(**{**record["model"], "n_layer": keep})
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "init"
        seq_len = record["subclone"]["seq_len"]
        report = realize_subclone(recipe, mcfg, 0, donor_path, root / "data/packed", root / "data/donor", out, seq_len)
        layers = json.loads((out / "realize.json").read_text())["subclone"]["selection"]["layers"]
    return layers, report["step0_val_loss"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keep", type=int, default=0, help="layers to keep (default: the realized model's)")
    parser.add_argument("--tokens", type=int, default=1024, help="train tokens each candidate is scored on")
    parser.add_argument("--donor", default="smollm2")
    args = parser.parse_args()
    root, donor_path = Path.cwd(), resolve_gguf_path(args.donor)
    keep = args.keep or json.loads((root / "models/init/realize.json").read_text())["model"]["n_layer"]
    donor, _ = load_llama_donor(donor_path)
    donor.eval()
    train = load_split(root / "data/packed", "train")
    middle = len(train) // 2  # away from the windows the calibration and the gain fit read
    tokens = train[middle : middle + args.tokens + 1].view(type(train))
    tokens.bos = window_bos(train)
    searched = greedy_removal(donor, tokens, keep)
    listed = ",".join(map(str, searched))
    for rule in ("importance", listed):
        layers, loss = step0_val(root, donor_path, rule, keep)
        print(f"{rule if rule == 'importance' else 'searched'}: layers {layers}, step-0 val loss {loss:.4f}")
    print(f"train it: dvc exp run -S model.n_layer={keep} -S \"recipe.subclone.layers='{listed}'\"")


if __name__ == "__main__":
    main()
