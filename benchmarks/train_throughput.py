"""Training throughput: our train step vs a transformers `LlamaForCausalLM` train step, side by side.

    python benchmarks/train_throughput.py [--vocab 49152 8192] [--steps 3] [--rounds 3] [--warmup 2]
                                          [--compile off|on|both] [--malloc default|keep|both]
                                          [--threads N] [--batch 8] [--seq 256] [--out FILE]

Both models have the same shape (d_model 256, 4 layers, 4 heads, ffn 688, tied embeddings; seq
256, batch 8 by default), both steps are the same loop: forward + loss (bf16 autocast where the CPU
has bf16 instructions, else fp32: train.precision=auto's choice), backward, grad-norm clip at 1.0,
fused AdamW (our `make_optimizer`, weight decay on matrices), zero_grad.
Ours calls `Llama.loss` (chunked linear cross-entropy); theirs `model(input_ids, labels=...)`
(transformers' own loss, sdpa attention); with `--compile` also ours with `torch.compile`d blocks
(`train.compile=true`). After `--warmup` steps each (compilation happens there), rounds alternate
the contenders (the machine is shared, so the median over rounds of each round's median step is
reported). MFU = model FLOPs per token (6 x matmul parameters incl. the head, plus 6 x layers x
seq x d_model for causal attention) x tokens/s over the matmul peak (in the step's dtype) measured
here on square and head-shaped matmuls. Peak RSS is the process's high-water mark (VmHWM, reset before each
timed segment after a malloc_trim) while that contender's steps run; both models live in the one
process, so both numbers include both models' weights (the `+` figure is the rise over the
segment's start).

The allocator matters as much as the kernels here: glibc hands out every allocation above 32 MB
as fresh pages and returns them on free, so a step pays page faults for each large tensor (the
transformers step's fp32 logits are 400 MB). Our train loop on CPU tells glibc to keep freed
memory (`keep_freed_memory`). `--malloc both` (default) measures every contender first with glibc's
defaults (what a plain transformers loop gets), then with freed memory kept (both get it: it is
one process).

On a GPU (issue 19; one H100, bf16), every contender alone on the device, one after another, on named
shapes (135m, tiny, tiny-default, small: see `gpu_common.named_shapes`), with MFU against
`--peak-tflops` and peak CUDA memory per contender (`train_contenders.py`; `--contenders` picks from
ours, ours-compile, ours-graph (CUDA only), hf, hf-compile, hf-liger: all by default):

    python benchmarks/train_throughput.py --device cuda --shapes 135m,tiny,tiny-default,small

The same run on this CPU at toy size (proves the code paths; the figures mean nothing):

    python benchmarks/train_throughput.py --device cpu --shapes smoke --steps 2 --warmup 1
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from gpu_common import H100_BF16_TFLOPS, Shape, hf_llama, pick_shapes  # this folder is on sys.path when run as a script
from harness import write_results
from train_contenders import CONTENDERS, run_all, step_fn, step_precision

from pipeline.models.llama import Llama
from pipeline.models.transformer import init_weights
from pipeline.training.runtime import compile_blocks, keep_freed_memory

D_MODEL, N_LAYER, N_HEAD, D_FF = 256, 4, 4, 688
MEASURED = {  # the README's Measured row (benchmarks/results_table.py)
    "topic": "train step, CPU",
    "order": 3,
    "headline": "{default_49152_ours_vs_transformers} transformers ({default_49152_ours_tok_s} vs "
    "{default_49152_transformers_tok_s} tok/s, glibc defaults)",
    "table": "docs/training.md#cpu-throughput-against-transformers",
}


def rss_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def reset_peak_rss() -> int:
    """Return freed memory to the OS, reset the high-water mark; the current RSS (KiB)."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass
    return rss_kib("VmRSS")


def step_dtype() -> torch.dtype:
    """The CPU steps' matmul dtype (`step_precision`): the MFU denominator's."""
    return torch.bfloat16 if step_precision("cpu") == "bf16" else torch.float32


def matmul_peak(dtype: torch.dtype, repeats: int = 5) -> float:
    """Best FLOP/s of square and head-shaped matmuls in `dtype` on this machine's threads."""
    shapes = [(2048, 2048, 2048), (4096, 4096, 4096), (2048, 256, 8192), (2048, 8192, 256)]
    best = 0.0
    for m, k, n in shapes:
        a, b = torch.randn(m, k, dtype=dtype), torch.randn(k, n, dtype=dtype)
        a @ b
        for _ in range(repeats):
            t = time.perf_counter()
            a @ b
            best = max(best, 2 * m * k * n / (time.perf_counter() - t))
    return best


def flops_per_token(vocab: int, seq: int) -> float:
    block = 4 * D_MODEL * D_MODEL + 3 * D_MODEL * D_FF
    return 6 * (N_LAYER * block + vocab * D_MODEL) + 6 * N_LAYER * seq * D_MODEL


def cpu_shape(vocab: int, x: torch.Tensor) -> Shape:
    """The CPU comparison's shape (d_model 256, 4 layers, 4 heads, ffn 688) at `x`'s batch x seq."""
    return Shape("cpu", vocab, D_MODEL, N_LAYER, N_HEAD, N_HEAD, D_FF, x.shape[0], x.shape[1])


def ours(vocab: int, x: torch.Tensor, y: torch.Tensor, compile_: bool) -> Callable[[], float]:
    model = Llama(cpu_shape(vocab, x).config())
    init_weights(model, 0.02, 0)
    model.train()
    if compile_:
        compile_blocks(model)
    return step_fn(model, lambda: model.loss(x, y))


def theirs(vocab: int, x: torch.Tensor) -> Callable[[], float]:
    model = hf_llama(cpu_shape(vocab, x))
    model.train()
    return step_fn(model, lambda: model(input_ids=x, labels=x).loss)


def timed(step: Callable[[], float], n: int) -> tuple[float, float]:
    """(median seconds per step, last loss)."""
    times, loss = [], float("nan")
    for _ in range(n):
        t = time.perf_counter()
        loss = step()
        times.append(time.perf_counter() - t)
    return statistics.median(times), loss


def run(vocab: int, args: argparse.Namespace, peak: float) -> dict:
    """One vocabulary's contenders, alternated over the rounds; printed, and returned as a row."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (args.batch, args.seq + 1), generator=g)
    x, y = ids[:, :-1].contiguous(), ids[:, 1:].contiguous()
    contenders = {}
    if args.compile in ("off", "both"):
        contenders["ours"] = ours(vocab, x, y, False)
    if args.compile in ("on", "both"):
        contenders["ours compiled"] = ours(vocab, x, y, True)
    contenders["transformers"] = theirs(vocab, x)
    warm = {}
    for name, step in contenders.items():
        t = time.perf_counter()
        for _ in range(args.warmup):
            step()
        warm[name] = time.perf_counter() - t
    times: dict[str, list[float]] = {k: [] for k in contenders}
    peaks: dict[str, int] = dict.fromkeys(contenders, 0)
    rises: dict[str, int] = dict.fromkeys(contenders, 0)
    losses: dict[str, float] = {}
    for _ in range(args.rounds):
        for name, step in contenders.items():
            start = reset_peak_rss()
            dt, losses[name] = timed(step, args.steps)
            times[name].append(dt)
            hwm = rss_kib("VmHWM")
            peaks[name] = max(peaks[name], hwm)
            rises[name] = max(rises[name], hwm - start)
    tokens = args.batch * args.seq
    fpt = flops_per_token(vocab, args.seq)
    print(f"\nvocab {vocab}: batch {args.batch} x seq {args.seq} = {tokens} tokens/step, {fpt / 1e6:.1f} MFLOP/token")
    rate = {}
    for name in contenders:
        dt = statistics.median(times[name])
        rate[name] = tokens / dt
        print(
            f"  {name:14s} {dt * 1e3:8.0f} ms/step  {rate[name]:8.0f} tok/s  MFU {rate[name] * fpt / peak:6.1%}  "
            f"peak RSS {peaks[name] / 1024:6.0f} MiB (+{rises[name] / 1024:.0f})  warm-up {warm[name]:.1f}s  "
            f"loss {losses[name]:.3f}  rounds {', '.join(f'{t * 1e3:.0f}' for t in times[name])} ms"
        )
    for name in contenders:
        if name != "transformers":
            print(f"  ratio {name}/transformers: {rate[name] / rate['transformers']:.2f}x")
    mfu = {name: rate[name] * fpt / peak for name in contenders}
    return {"vocab": vocab, "tok_s": rate, "mfu": mfu, "peak_rss_rise_mib": {k: v / 1024 for k, v in rises.items()}}


def figures(rows: list[dict]) -> dict[str, str]:
    """The named figures the docs quote, per allocator policy and vocabulary: tok/s, ratio, MFU, RSS rise."""
    out = {}
    for row in rows:
        key = f"{row['policy']}_{row['vocab']}"
        rate = row["tok_s"]
        for name, value in rate.items():
            slug = name.replace(" ", "_")
            out[f"{key}_{slug}_tok_s"] = f"{value:.0f}"
            out[f"{key}_{slug}_mfu"] = f"{row['mfu'][name]:.0%}"
            out[f"{key}_{slug}_rss_rise"] = f"+{row['peak_rss_rise_mib'][name]:.0f} MiB"
            if name != "transformers":
                out[f"{key}_{slug}_vs_transformers"] = f"{value / rate['transformers']:.2f}x"
    return out


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--vocab", type=int, nargs="+", default=[49152, 8192])
    p.add_argument("--batch", type=int, help="default 8 (CPU comparison); with --shapes, each shape's own")
    p.add_argument("--seq", type=int, help="default 256 (CPU comparison); with --shapes, each shape's own")
    p.add_argument("--steps", type=int, help="timed steps per round (default 3; with --shapes 10)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--warmup", type=int, help="untimed steps first (default 2; with --shapes 3)")
    p.add_argument("--compile", choices=["off", "on", "both"], default="both", help="torch.compile our blocks")
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--malloc", choices=["default", "keep", "both"], default="both", help="glibc allocator policy")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="cuda: the contenders on named shapes")
    p.add_argument("--shapes", help="named shapes, comma-separated (default with cuda: 135m,tiny,tiny-default,small)")
    p.add_argument("--contenders", default=",".join(CONTENDERS), help="with --shapes or cuda")
    p.add_argument("--peak-tflops", type=float, help=f"MFU denominator (cuda default {H100_BF16_TFLOPS:.0f})")
    p.add_argument("--out", help="CPU comparison: write the results file here (benchmarks/results/train_cpu.json)")
    args = p.parse_args()
    if args.device == "cuda" and not args.shapes:
        args.shapes = "135m,tiny,tiny-default,small"
    sequential = bool(args.shapes)
    if not sequential:
        args.batch, args.seq = args.batch or 8, args.seq or 256
    args.steps = args.steps or (10 if sequential else 3)
    args.warmup = args.warmup if args.warmup is not None else (3 if sequential else 2)
    return args


def main() -> None:
    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.shapes:  # the contenders one after another on named shapes (train_contenders.py)
        device = torch.device(args.device)
        if args.peak_tflops:
            peak = args.peak_tflops * 1e12
        else:
            peak = H100_BF16_TFLOPS * 1e12 if device.type == "cuda" else matmul_peak(step_dtype())
        run_all(pick_shapes(args.shapes, args.batch, args.seq), args, device, peak, " ".join(["python", *sys.argv]))
        return
    load_before, rows = os.getloadavg()[0], []
    peak = matmul_peak(step_dtype())
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, CPU capability "
        f"{torch.backends.cpu.get_cpu_capability()}; each step in {step_precision('cpu')}; measured "
        f"{step_precision('cpu')} matmul peak {peak / 1e9:.0f} GFLOP/s; "
        f"load average {os.getloadavg()[0]:.1f}"
    )
    policies = ["default", "keep"] if args.malloc == "both" else [args.malloc]
    for policy in policies:
        if policy == "keep" and not keep_freed_memory():
            print("\n(no glibc: cannot keep freed memory)")
            break
        print(f"\n=== malloc: {'glibc defaults' if policy == 'default' else 'freed memory kept (as our train loop)'}")
        rows += [{"policy": policy, **run(vocab, args, peak)} for vocab in args.vocab]
    print(f"\nload average at the end {os.getloadavg()[0]:.1f} (other processes share this machine)")
    if args.out:
        peak_key = f"{step_precision('cpu')}_matmul_peak_gflops"
        data = {peak_key: peak / 1e9, "rows": rows, "threads": torch.get_num_threads()}
        named = figures(rows)
        row = MEASURED if "default_49152_ours_tok_s" in named else None  # the README's row needs the default run
        write_results(args.out, named, data, load_before, **({"measured": row} if row else {}))


if __name__ == "__main__":
    main()
