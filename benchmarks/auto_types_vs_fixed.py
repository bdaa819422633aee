"""What `export.dtype=auto:<MB>` buys: the types chosen by measurement against the fixed types of the same
file size, side by side on one trained model.

    python benchmarks/auto_types_vs_fixed.py [--types q4_k_m,q4_0] [--windows 4] [--out FILE] [-- extra -S overrides]

For each fixed type, one `dvc exp run` exports it (export, evaluate and report re-run; training is cached),
then one exports `auto:<that file's size in MB>`. The val loss is evaluate's, of the exported file read back
over every val window; llama.cpp scores the same file over the first `--windows` parity windows beside our
score of them (with llama-cpp-python installed).
"""

from __future__ import annotations

import argparse
import math
import os
from pathlib import Path

import torch
import yaml
from harness import ROOT, exp_run, read_metrics, write_results  # first: this checkout's library on sys.path
from qat_imatrix import window_losses

from pipeline.data.packed import load_split
from pipeline.evaluate.parity import parity_windows
from pipeline.gguf.quantize import llamacpp_installed

EXPORT = ROOT / "models/export/model.gguf"


def run(name: str, overrides: list[str], windows: list[list[int]]) -> dict[str, float]:
    """One experiment: evaluate's val loss, the file's size, both readers' loss on the parity windows."""
    wall = exp_run(["-n", name], overrides)
    row = {"val_loss": read_metrics("evaluate")["val_loss"], "wall_seconds": wall}
    row["mb"] = EXPORT.stat().st_size / 1e6
    if windows and llamacpp_installed():
        row["ours_window_loss"], row["llamacpp_window_loss"] = window_losses(EXPORT, windows)
    return row


def figures(base: float, rows: dict[str, dict[str, float]]) -> dict[str, str]:
    """The named figures docs/export.md quotes: per export its size, val loss, rise over f32 and the
    4-window losses; per auto: budget, its share of the fixed type's rise (`auto:34.97` -> `auto_34_97`)."""
    out, fixed = {}, None
    for name, r in rows.items():
        slug = name.replace(":", "_").replace(".", "_")
        out.update({f"{slug}_mb": f"{r['mb']:.2f}", f"{slug}_val_loss": f"{r['val_loss']:.4f}"})
        out[f"{slug}_rise"] = "0" if name == "f32" else f"{r['val_loss'] - base:+.4f}"
        if "ours_window_loss" in r:
            out[f"{slug}_4w"], out[f"{slug}_4w_1"] = f"{r['ours_window_loss']:.4f}", f"{r['llamacpp_window_loss']:.4f}"
        if name.startswith("auto:") and fixed is not None:
            out[f"{slug}_share"] = f"{(r['val_loss'] - base) / (fixed - base):.0%}"
        fixed = r["val_loss"] if name != "f32" and not name.startswith("auto:") else fixed
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--types", default="q4_k_m,q4_0")
    ap.add_argument("--windows", type=int, default=4)
    ap.add_argument("--out", type=Path)
    ap.add_argument("extra", nargs="*", help="more -S overrides for every run")
    args = ap.parse_args()
    load_before = os.getloadavg()[0]
    torch.set_num_threads(2)
    seq_len = yaml.safe_load((ROOT / "params.yaml").read_text())["train"]["seq_len"]
    windows = parity_windows(load_split(ROOT / "data/packed", "val"), seq_len, args.windows)
    rows = {"f32": run("at-f32", ["export.dtype=f32", *args.extra], [])}
    base = rows["f32"]["val_loss"]
    for dtype in args.types.split(","):
        rows[dtype] = run(f"at-{dtype}", [f"export.dtype={dtype}", *args.extra], windows)
        budget = math.floor(rows[dtype]["mb"] * 100) / 100  # the fixed type's size, rounded down
        rows[f"auto:{budget}"] = run(f"at-auto-{dtype}", [f"export.dtype=auto:{budget}", *args.extra], windows)
    print(f"\nf32 export val loss {base:.4f}\n")
    print("| export.dtype | MB | val loss | rise over f32 | 4 windows: ours / llama.cpp |")
    print("|---|---|---|---|---|")
    for name, r in rows.items():
        both = f"{r['ours_window_loss']:.4f} / {r['llamacpp_window_loss']:.4f}" if "ours_window_loss" in r else ""
        print(f"| {name} | {r['mb']:.2f} | {r['val_loss']:.4f} | {r['val_loss'] - base:+.4f} | {both} |")
    if args.out:
        write_results(args.out, figures(base, rows), {"f32_val_loss": base, "rows": rows}, load_before)


if __name__ == "__main__":
    main()
