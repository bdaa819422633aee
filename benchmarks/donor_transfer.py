"""What the donor is worth: every way of using it, side by side, through the real DVC stages.

    python benchmarks/donor_transfer.py [--steps 400] [--methods scratch pca subclone ...] [--out FILE]

Run from the project root after `make setup`. Each method is one `dvc exp run -n dt-<method>` in this
workspace (so every stage, its metrics and its MLflow runs are the real ones), all at the same
student shape (model=subclone: 384 wide, 6 layers, ~28M parameters), the same corpus, the same
`train.steps` and therefore about the same training wall clock (the table shows each run's train
seconds and what its extra stages cost: donor calibration, the teach cache):

- scratch:          recipe=from-scratch, random init (optim=adamw, lr 3e-3)
- pca:              recipe=warm-start, the donor's embedding table PCA-projected (optim=adamw)
- distill:          recipe=distill, PCA embeddings + KL to the donor's cached top-k (optim=adamw)
- subclone:         recipe=subclone, every weight cut from the donor (optim=subclone)
- subclone-8L:      the same at 8 layers (31.5M parameters), the bigger student
- subclone-distill: recipe=subclone-distill (the default), both

It prints val loss, bits per byte, the step-0 val loss and the fraction of the scratch-to-donor gap
each closes ((scratch - method) / (scratch - donor), donor = SmolLM2 itself on the same windows,
measured by the teach stage), writes the table as JSON (`--out`), and leaves the workspace at the
last method run (the default, `subclone-distill`, unless `--methods` says otherwise). Loss curves:
`dvc plots diff dt-scratch dt-subclone ...` or the MLflow UI (runs `dt-<method>/train`).
"""

from __future__ import annotations

import argparse
import math
import os
from pathlib import Path

from harness import exp_run, read_metrics, write_results

METHODS: dict[str, tuple[str, ...]] = {
    "scratch": ("recipe=from-scratch", "optim=adamw"),
    "pca": ("recipe=warm-start", "optim=adamw"),
    "distill": ("recipe=distill", "optim=adamw"),
    "subclone": ("recipe=subclone",),
    "subclone-8L": ("recipe=subclone", "model.n_layer=8"),
    "subclone-distill": ("recipe=subclone-distill",),
}


def run_method(name: str, steps: int, extra: list[str]) -> dict[str, float]:
    """One `dvc exp run` of `name`; its metrics read back from the workspace it leaves."""
    wall = exp_run(["-n", f"dt-{name}"], [f"train.steps={steps}", *METHODS[name], *extra])
    metrics = {stage: read_metrics(stage) for stage in ("realize", "train", "teach", "evaluate")}
    ev, tr, rz = metrics["evaluate"], metrics["train"], metrics["realize"]
    return {
        "val_loss": ev["val_loss"],
        "val_bpb": ev.get("val_bpb", float("nan")),
        "donor_val_loss": ev.get("donor_val_loss", float("nan")),
        "step0_val_loss": rz.get("step0_val_loss", float("nan")),
        "parameters": rz.get("parameters", float("nan")),
        "train_seconds": tr["seconds"],
        "kept_step": tr.get("kept_step", float("nan")),
        "teach_seconds": metrics["teach"].get("seconds", 0.0),
        "wall_seconds": wall,
    }


def table(results: dict[str, dict[str, float]]) -> str:
    """A markdown table; the gap closed needs the scratch run and the donor's val loss."""
    scratch = results.get("scratch", {}).get("val_loss")
    donor = next((r["donor_val_loss"] for r in results.values() if r["donor_val_loss"] == r["donor_val_loss"]), None)
    lines = [
        f"donor SmolLM2 val loss on the same windows: {donor:.4f}" if donor else "donor val loss: not measured",
        "",
        "| method | params | step-0 val | val loss | val bpb | gap closed | train s | run wall s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, r in results.items():
        closed = f"{(scratch - r['val_loss']) / (scratch - donor):.0%}" if scratch and donor else "n/a"
        lines.append(
            f"| {name} | {r['parameters'] / 1e6:.1f}M | {r['step0_val_loss']:.3f} | {r['val_loss']:.4f} "
            f"| {r['val_bpb']:.3f} | {closed} | {r['train_seconds']:.0f} | {r['wall_seconds']:.0f} |"
        )
    return "\n".join(lines)


def figures(results: dict[str, dict[str, float]]) -> dict[str, str]:
    """The named figures docs/donor.md quotes, per method (`subclone-8L` -> `subclone_8l`): step-0 val loss
    (none from random weights), val loss, bits per byte, the share of the gap closed, train and run seconds;
    and the donor's val loss."""
    scratch = results.get("scratch", {}).get("val_loss")
    donor = next(r["donor_val_loss"] for r in results.values() if not math.isnan(r["donor_val_loss"]))
    out = {"donor_val_loss": f"{donor:.4f}"}
    for name, r in results.items():
        slug = name.lower().replace("-", "_")
        if not math.isnan(r["step0_val_loss"]):
            out[f"{slug}_step0"] = f"{r['step0_val_loss']:.3f}"
        out.update({f"{slug}_val_loss": f"{r['val_loss']:.4f}", f"{slug}_val_bpb": f"{r['val_bpb']:.3f}"})
        if scratch is not None:
            out[f"{slug}_gap"] = f"{(scratch - r['val_loss']) / (scratch - donor):.0%}"
        out.update({f"{slug}_train_s": f"{r['train_seconds']:.0f}", f"{slug}_run_s": f"{r['wall_seconds']:.0f}"})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    parser.add_argument("-S", dest="extra", action="append", default=[], help="one more override for every run")
    args = parser.parse_args()
    load_before = os.getloadavg()[0]
    results: dict[str, dict[str, float]] = {}
    for name in args.methods:
        results[name] = run_method(name, args.steps, args.extra)
        print(f"{name}: val {results[name]['val_loss']:.4f} in {results[name]['wall_seconds']:.0f} s", flush=True)
    print(table(results))
    if args.out:
        data = {"steps": args.steps, "extra": args.extra, "results": results}
        write_results(args.out, figures(results), data, load_before)


if __name__ == "__main__":
    main()
