"""train_throughput.py's side-by-side run on named shapes: each contender alone on the device, one after
another (on a GPU they would not all fit comfortably together, and each one's peak memory is then its
own), with the same step as the CPU comparison: forward + loss under bf16 autocast where the device has bf16
instructions (what train.precision=auto runs; fp32 on an AVX2-only CPU), backward, grad-norm clip 1.0,
fused AdamW (`make_optimizer`), zero_grad.

Contenders: `ours-default` (what a run on CUDA does by default, train.compile=auto and train.cuda_graph=auto:
the blocks compiled, `compile_blocks`, and forward, backward and clip replayed as one CUDA graph; CUDA only),
`ours` (`Llama.loss` eager; on CUDA with the Triton kernels of `models.ops.fused`), `ours-plain` (the same with
them off, i.e. train.fused_kernels=false; CUDA only), `ours-compile` (the compiled blocks without the CUDA
graph: train.compile=true, train.cuda_graph=false), `ours-graph` (the eager step as one CUDA graph:
train.compile=false, train.cuda_graph=true; CUDA only), `hf` (transformers `LlamaForCausalLM`, sdpa
attention, its own loss), `hf-compile` (`torch.compile` of that model), `hf-liger` (Liger kernels patched into
transformers' llama before the model is built; skipped when `liger_kernel` is not installed).
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass

import torch
from gpu_common import (  # this folder is on sys.path when run as a script
    Shape,
    clock,
    device_name,
    guarded,
    hf_llama,
    memory_label,
    peak_mib,
    release,
    train_flops_per_token,
)

from pipeline.config import OptimConfig
from pipeline.models.devices import resolve_precision
from pipeline.models.llama import Llama
from pipeline.models.ops.fused import use_fused_kernels
from pipeline.models.transformer import init_weights
from pipeline.training.graphed import GraphedStep
from pipeline.training.optim import gradient_norm, make_optimizer
from pipeline.training.queued import nonfinite
from pipeline.training.runtime import autocast, compile_blocks

CONTENDERS = ("ours-default", "ours", "ours-plain", "ours-compile", "ours-graph", "hf", "hf-compile", "hf-liger")


@dataclass
class Figures:
    """One contender's measurement on one shape."""

    name: str
    step_s: list[float]
    peak_mib: float
    loss: float
    build_s: float
    warm_s: float

    @property
    def median_s(self) -> float:
        return statistics.median(self.step_s)


def step_precision(device: str | torch.device) -> str:
    """What every contender's step runs in here: train.precision=auto's choice for this device."""
    return resolve_precision("auto", torch.device(device))


def step_fn(model: torch.nn.Module, loss_of: Callable[[], torch.Tensor], device: str = "cpu") -> Callable[[], float]:
    """The one training step every contender runs, on CPU and on a GPU alike."""
    opt = make_optimizer(model, OptimConfig(lr=1e-3, weight_decay=0.1))
    cast = step_precision(device)

    def step() -> float:
        with autocast(torch.device(device), cast):
            loss = loss_of()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss.detach())

    return step


def graphed_step_fn(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, device: torch.device):
    """`step_fn`'s step as train.cuda_graph=true runs it: forward, backward and the clip captured once as
    the loop's `GraphedStep` (static x, y on the device), fused AdamW after each replay."""
    opt = make_optimizer(model, OptimConfig(lr=1e-3, weight_decay=0.1))
    params = [p for p in model.parameters() if p.requires_grad]

    def forward_backward(batches: list[tuple[torch.Tensor, ...]]) -> tuple[torch.Tensor, ...]:
        ((xs, ys),) = batches
        with autocast(device, "bf16", cache=False):
            loss = model.loss(xs, ys)
        loss.backward()
        norm = gradient_norm(params, 1.0)
        return loss.detach(), norm, nonfinite(loss, norm)

    graph = GraphedStep(forward_backward, [(x, y)], params, device)

    def step() -> float:
        loss, _, opt.found_inf = graph([(x, y)])
        opt.step()
        return float(loss)

    return step


@contextmanager
def liger_patched() -> Iterator[None]:
    """Liger's kernels in transformers' llama while the block runs, restored after: the patch replaces
    module- and class-level names (RMSNorm, MLP, RoPE, the causal-LM forward with its fused linear
    cross-entropy), which would otherwise leak into the later `hf` contenders of this process."""
    from liger_kernel.transformers import apply_liger_kernel_to_llama
    from transformers.models.llama import modeling_llama

    mod = modeling_llama
    classes = [v for v in vars(mod).values() if isinstance(v, type) and v.__module__ == mod.__name__]
    saved = dict(vars(mod)), {c: dict(vars(c)) for c in classes}
    apply_liger_kernel_to_llama(
        rope=True, rms_norm=True, swiglu=True, cross_entropy=False, fused_linear_cross_entropy=True
    )
    try:
        yield
    finally:
        names, attrs = saved
        for k in set(vars(modeling_llama)) - set(names):
            delattr(modeling_llama, k)
        for k, v in names.items():
            if vars(modeling_llama).get(k) is not v:
                setattr(modeling_llama, k, v)
        for c, before in attrs.items():
            for k, v in before.items():
                if k not in ("__dict__", "__weakref__", "__doc__") and vars(c).get(k) is not v:
                    setattr(c, k, v)


def build(name: str, shape: Shape, x: torch.Tensor, y: torch.Tensor, device: torch.device) -> Callable[[], float]:
    """The contender's model on `device` (same seed for all) and its step."""
    torch.manual_seed(0)
    if name.startswith("ours"):
        model = Llama(shape.config())
        init_weights(model, 0.02, 0)
        model.to(device).train()
        use_fused_kernels(model, name != "ours-plain")
        if name in ("ours-compile", "ours-default"):
            compile_blocks(model)
        if name in ("ours-graph", "ours-default"):
            return graphed_step_fn(model, x, y, device)
        labels = y.cpu()  # on the host, as the train loop keeps them (the model finds the counted rows there)
        return step_fn(model, lambda: model.loss(x, labels), device.type)
    model = hf_llama(shape).to(device).train()
    run = torch.compile(model) if name == "hf-compile" else model
    return step_fn(model, lambda: run(input_ids=x, labels=x).loss, device.type)


def measure(name: str, shape: Shape, args: argparse.Namespace, device: torch.device) -> Figures:
    """Build, `args.warmup` untimed steps (compilation happens there), `args.steps` timed steps."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, shape.vocab, (shape.batch, shape.seq + 1), generator=g).to(device)
    x, y = ids[:, :-1].contiguous(), ids[:, 1:].contiguous()
    with liger_patched() if name == "hf-liger" else nullcontext():
        t0 = clock(device)
        step = build(name, shape, x, y, device)
        t1 = clock(device)
        for _ in range(args.warmup):
            step()
        t2 = clock(device)
        times, loss = [], float("nan")
        for _ in range(args.steps):
            start = clock(device)
            loss = step()
            times.append(clock(device) - start)
    return Figures(name, times, peak_mib(device), loss, t1 - t0, t2 - t1)


def line(f: Figures, tokens: int, fpt: float, peak_flops: float) -> str:
    rate = tokens / f.median_s
    return (
        f"  {f.name:16s} {f.median_s * 1e3:8.1f} ms/step {rate:10.0f} tok/s  MFU {rate * fpt / peak_flops:6.1%}  "
        f"{f.peak_mib:8.0f} MiB  build {f.build_s:5.1f}s  warm-up {f.warm_s:6.1f}s  loss {f.loss:.3f}"
    )


def run_shape(shape: Shape, names: list[str], args: argparse.Namespace, device: torch.device, peak: float) -> dict:
    """Every contender on one shape, printed as it finishes; then the ratios to the fastest transformers one."""
    tokens, fpt = shape.batch * shape.seq, train_flops_per_token(shape)
    print(f"\n{shape.describe()} = {tokens} tokens/step, {fpt / 1e6:.1f} MFLOP/token", flush=True)
    print(f"  {'':16s} {'':>15} {'':>16}  {'':>10}  {memory_label(device)}")
    done: dict[str, Figures] = {}
    for name in names:
        if name == "hf-liger" and importlib.util.find_spec("liger_kernel") is None:
            print(f"  {name:16s} skipped: liger_kernel not installed", flush=True)
            continue
        if name in ("ours-graph", "ours-plain", "ours-default") and device.type != "cuda":
            print(f"  {name:16s} skipped: a CUDA-only path", flush=True)
            continue
        release(device, compiled=True)
        f = guarded(name, lambda name=name: measure(name, shape, args, device))
        release(device, compiled=True)
        if isinstance(f, Figures):
            done[name] = f
            print(line(f, tokens, fpt, peak), flush=True)
    ref = min((f for n, f in done.items() if n.startswith("hf")), key=lambda f: f.median_s, default=None)
    if ref is not None:
        for f in done.values():
            if f is ref:
                continue
            print(
                f"  ratio {f.name}/{ref.name}: speed {ref.median_s / f.median_s:.2f}x, "
                f"memory {f.peak_mib / ref.peak_mib:.2f}x"
            )
    return done


def table_head(names: list[str]) -> str:
    return "| shape, batch x seq | " + " | ".join(names) + " |\n" + "|---" * (len(names) + 1) + "|"


def table_row(s: Shape, done: dict[str, Figures], names: list[str], peak: float) -> str:
    """One shape's Markdown row for the README: tok/s (MFU, peak GiB) per contender."""
    tokens, fpt = s.batch * s.seq, train_flops_per_token(s)
    cells = []
    for n in names:
        f = done.get(n)
        rate = tokens / f.median_s if f else 0.0
        cells.append(f"{rate:,.0f} ({rate * fpt / peak:.0%}, {f.peak_mib / 1024:.1f} GiB)" if f else "-")
    return f"| {s.name}, {s.batch} x {s.seq} | " + " | ".join(cells) + " |"


def run_all(shapes: list[Shape], args: argparse.Namespace, device: torch.device, peak: float, argv: str) -> None:
    names = args.contenders.split(",")
    unknown = [n for n in names if n not in CONTENDERS]
    if unknown:
        raise SystemExit(f"unknown contender(s) {', '.join(unknown)}; known: {', '.join(CONTENDERS)}")
    print(f"device: {device_name(device)}; MFU against {peak / 1e12:.1f} TFLOP/s")
    print(f"command: {argv}")
    print(f"{args.warmup} warm-up steps, then the median of {args.steps} timed steps")
    print(f"each step: {step_precision(device)} forward + loss, backward, clip 1.0, fused AdamW, zero_grad")
    rows = []
    start = time.perf_counter()
    for shape in shapes:
        rows.append(table_row(shape, run_shape(shape, names, args, device, peak), names, peak))
        print(f"  table row: {rows[-1]}", flush=True)  # kept if a later shape runs past a timeout
    print(f"\ntok/s (MFU, peak memory) on {device_name(device)}:\n{table_head(names)}\n" + "\n".join(rows))
    print(f"\ntotal {time.perf_counter() - start:.0f} s")
