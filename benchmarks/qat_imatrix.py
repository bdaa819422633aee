"""What an importance matrix and QAT each buy a 4-bit export: post-training quantization, the corpus
imatrix alone, QAT alone and both, against the f32 export of the same run, per type.

    python benchmarks/qat_imatrix.py [--types q4_k_m,q4_0] [--tokens 65536] [--windows 4] [--out FILE]
        [--variants ptq,imatrix,qat,qat+imatrix] [--prefix qi]
        [-- extra dvc exp run -S overrides, e.g. data=text data.path=corpus.txt, or preset=lora]

Each row is one `dvc exp run -n qi-<type>-<variant>` of the project's config (real stages, metrics
and MLflow runs; the imatrix-only and PTQ rows re-run only export, evaluate and report). The val loss
is evaluate's, of the exported file read back by our reader over every val window; llama.cpp scores
the same file over the first `--windows` parity windows beside our score of them. Needs
llama-cpp-python (ggml's quantizer; `make llamacpp`).
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch
import yaml
from harness import ROOT, exp_run, read_metrics, write_results  # first: this checkout's library on sys.path

from pipeline.data.packed import load_split
from pipeline.evaluate.parity import iter_llamacpp_scores, parity_windows
from pipeline.evaluate.quantized import window_loss
from pipeline.models.registry import load_gguf

OFF = {"export.imatrix": "0", "train.qat": "''", "train.qat_imatrix": "0"}  # each run sets all three
VARIANTS = {
    "ptq": {},
    "imatrix": {"export.imatrix": "{tokens}"},
    "qat": {"train.qat": "{dtype}"},
    "qat+imatrix": {"train.qat": "{dtype}", "train.qat_imatrix": "{tokens}"},
}


def window_losses(gguf: Path, windows: list[list[int]]) -> tuple[float, float]:
    """(ours, llama.cpp's) mean NLL of `gguf` over the same parity windows."""
    model, g = load_gguf(gguf)
    g.release_pages()
    with torch.no_grad():
        ours = [model(torch.tensor([ids]))[0].float() for ids in windows]
    theirs = [torch.from_numpy(s) for s in iter_llamacpp_scores(gguf, windows)]
    return window_loss(ours, windows), window_loss(theirs, windows)


def run(name: str, overrides: list[str], windows: list[list[int]]) -> dict[str, float]:
    """One experiment; evaluate's val loss and both readers' loss on the parity windows."""
    wall = exp_run(["-n", name], overrides)
    row = {"val_loss": read_metrics("evaluate")["val_loss"], "wall_seconds": wall}
    if windows:
        row["ours_window_loss"], row["llamacpp_window_loss"] = window_losses(ROOT / "models/export/model.gguf", windows)
    return row


def figures(base: float, rows: dict[str, dict[str, float]]) -> dict[str, str]:
    """The named figures docs/export.md quotes: the f32 export's val loss, and per `<type>/<variant>` row
    (`q4_k_m/qat+imatrix` -> `q4_k_m_qat_imatrix`) its val loss, rise, share of PTQ's rise, 4-window
    losses and seconds."""
    out = {"f32_val_loss": f"{base:.4f}"}
    for name, r in rows.items():
        if name == "f32":
            continue
        slug = name.replace("/", "_").replace("+", "_")
        out.update({f"{slug}_val_loss": f"{r['val_loss']:.4f}", f"{slug}_rise": f"{r['rise']:+.4f}"})
        out.update({f"{slug}_share": f"{r['share_of_ptq']:.0%}", f"{slug}_run_s": f"{r['wall_seconds']:.0f}"})
        if "ours_window_loss" in r:
            out[f"{slug}_ours_4w"] = f"{r['ours_window_loss']:.4f}"
            out[f"{slug}_llamacpp_4w"] = f"{r['llamacpp_window_loss']:.4f}"
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--types", default="q4_k_m,q4_0")
    ap.add_argument("--tokens", type=int, default=65536)
    ap.add_argument("--windows", type=int, default=4)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--variants", default=",".join(VARIANTS), help="some of " + ",".join(VARIANTS))
    ap.add_argument("--prefix", default="qi", help="experiment names' prefix (one per preset run from one commit)")
    ap.add_argument("extra", nargs="*", help="more -S overrides for every run")
    args = ap.parse_args()
    load_before = os.getloadavg()[0]
    torch.set_num_threads(2)
    seq_len = yaml.safe_load((ROOT / "params.yaml").read_text())["train"]["seq_len"]
    rows: dict[str, dict[str, float]] = {}
    off = [f"{k}={v}" for k, v in OFF.items()]
    rows["f32"] = run(f"{args.prefix}-f32", ["export.dtype=f32", *off, *args.extra], [])
    # --windows 0: no parity windows (instruct data, as the fine-tune presets pack, has no running-text split)
    windows = parity_windows(load_split(ROOT / "data/packed", "val"), seq_len, args.windows) if args.windows else []
    base = rows["f32"]["val_loss"]
    for dtype in args.types.split(","):
        for variant, keys in VARIANTS.items():
            if variant not in args.variants.split(","):
                continue
            overrides = [f"{k}={v.format(dtype=dtype, tokens=args.tokens)}" for k, v in {**OFF, **keys}.items()]
            row = run(
                f"{args.prefix}-{dtype}-{variant.replace('+', '-')}",
                [f"export.dtype={dtype}", *overrides, *args.extra],
                windows,
            )
            row["rise"] = row["val_loss"] - base
            ptq = rows.get(f"{dtype}/ptq", {}).get("rise")
            row["share_of_ptq"] = row["rise"] / ptq if variant != "ptq" and ptq else 1.0
            rows[f"{dtype}/{variant}"] = row
            share = f"{row['share_of_ptq']:.0%} of PTQ's"
            line = f"{dtype:7s} {variant:12s} val {row['val_loss']:.4f} (+{row['rise']:.4f}, {share})"
            if "llamacpp_window_loss" in row:
                line += f"  windows: ours {row['ours_window_loss']:.4f} llama.cpp {row['llamacpp_window_loss']:.4f}"
            print(f"{line}  {row['wall_seconds']:.0f} s", flush=True)
    print(f"f32 export: val {base:.4f}")
    if args.out:
        data = {"f32_val_loss": base, "tokens": args.tokens, "rows": rows}
        write_results(args.out, figures(base, rows), data, load_before)


if __name__ == "__main__":
    main()
