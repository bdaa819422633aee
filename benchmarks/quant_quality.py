"""What each export type costs the trained model: size on disk against val loss and KL from the export.

    python benchmarks/quant_quality.py [--gguf models/export/model.gguf] [--types q8_0,q6_k,q5_k_m,q4_k_m,q4_0]
        [--windows 4] [--out FILE]

Run from the project root after `dvc repro` (it reads the packed val split and the f32 export). It is
evaluate's own measurement (`evaluate.quant_types`, `pipeline/evaluate/quantized.py`) run outside
DVC, so the workspace's metrics stay those of the committed pipeline: each type is written as
`export.dtype` would write it, read back by our reader and scored over every val window of
`train.seq_len` (from params.yaml), and, with llama-cpp-python, scored by llama.cpp over the first
`--windows` of them beside our score of the same file there.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch
import yaml
from harness import ROOT, write_results  # first: this checkout's library on sys.path

from pipeline.data.packed import load_split
from pipeline.evaluate.parity import parity_windows
from pipeline.evaluate.quantized import quant_metrics


def figures(result: dict) -> dict[str, str]:
    """The named figures docs/export.md quotes: per type its size, val loss, rise over f32, KL and the
    4-window losses by our reader and llama.cpp (the f32 export's val loss is any row's less its rise)."""
    m = result["metrics"]
    types = sorted({k[len("quant_") :].rsplit("_val_loss_rise", 1)[0] for k in m if k.endswith("_val_loss_rise")})
    t0 = f"quant_{types[0]}_"
    f32 = m[t0 + "val_loss"] - m[t0 + "val_loss_rise"]
    out = {"f32_mb": f"{result['export_mb']:.1f}", "f32_val_loss": f"{f32:.4f}", "f32_rise": "0", "f32_kl": "0"}
    for t in types:
        k = f"quant_{t}_"
        out.update({f"{t}_mb": f"{m[k + 'mb']:.1f}", f"{t}_val_loss": f"{m[k + 'val_loss']:.4f}"})
        out.update({f"{t}_rise": f"{m[k + 'val_loss_rise']:+.4f}", f"{t}_kl": f"{m[k + 'kl']:.2e}"})
        if k + "llamacpp_window_loss" in m:
            out[f"{t}_ours_4w"] = f"{m[k + 'ours_window_loss']:.4f}"
            out[f"{t}_llamacpp_4w"] = f"{m[k + 'llamacpp_window_loss']:.4f}"
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gguf", type=Path, default=ROOT / "models/export/model.gguf")
    ap.add_argument("--packed", type=Path, default=ROOT / "data/packed")
    ap.add_argument("--types", default="q8_0,q6_k,q5_k_m,q4_k_m,q4_0")
    ap.add_argument("--windows", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    load_before = os.getloadavg()[0]
    torch.set_num_threads(args.threads)
    train = yaml.safe_load((ROOT / "params.yaml").read_text())["train"]
    val = load_split(args.packed, "val")
    windows = parity_windows(val, train["seq_len"], args.windows)
    types = args.types.split(",")
    start = time.perf_counter()
    m = quant_metrics(args.gguf, types, val, train["seq_len"], train["batch_size"], torch.device("cpu"), windows)
    result = {"gguf": str(args.gguf), "export_mb": args.gguf.stat().st_size / 1e6, "seconds": 0.0, "metrics": m}
    result["seconds"] = time.perf_counter() - start
    print(f"export: {result['export_mb']:.1f} MB")
    for t in types:
        k = f"quant_{t}_"
        line = f"{t:7s} {m[k + 'mb']:7.1f} MB  val loss +{m[k + 'val_loss_rise']:.4f}  KL {m[k + 'kl']:.2e}"
        if k + "llamacpp_window_loss" in m:
            line += f"  windows: ours {m[k + 'ours_window_loss']:.4f} llama.cpp {m[k + 'llamacpp_window_loss']:.4f}"
        print(line)
    if args.out:
        write_results(args.out, figures(result), result, load_before)


if __name__ == "__main__":
    main()
