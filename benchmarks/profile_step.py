"""Where a training step's time goes: torch.profiler over our real training loop (`pipeline.training.loop.train`:
queued figures on CUDA, pinned batches, chunked loss, fused AdamW, clip 1.0) on a named `gpu_common` shape.

    PYTHONPATH=. python benchmarks/profile_step.py --device cuda --shape 135m [--compile|--cuda-graph] [--trace t.gz]
    PYTHONPATH=. python benchmarks/profile_step.py --device cpu --shape smoke --steps 2 --warmup 1

A run: `--warmup` steps, `--steps` timed ones without the profiler, `--steps` profiled ones, one more (the loop
validates at its end). A step starts where the loop asks `lr_at` for its learning rate (once, first thing, outside
any profiler range: the loop has no per-step callback). Exactly one profiled step logs: it reads the queued
figures (one wait, by design); no other step may wait. Printed compactly (read from a 12,000-character tail):
step time, tok/s, MFU; host waits per step and where they come from; kernels per step and GPU idle (CUDA); time
by category (CATEGORIES: the first pattern the lower-cased name matches); the top kernels by GPU time (CUDA) or
ops by self CPU time. `--out` (default: $OUT, else a temp folder) gets the summary as JSON.
"""

from __future__ import annotations

import argparse
import bisect
import json
import os
import re
import statistics
import sys
import tempfile
import time
import warnings
from collections import Counter, defaultdict
from contextlib import ExitStack
from pathlib import Path
from typing import Any
from unittest import mock

import numpy as np
import torch

# gpu_common: this folder is on sys.path when run as a script
from gpu_common import H100_BF16_TFLOPS, ROOT, Shape, device_name, pick_shapes, train_flops_per_token
from torch.autograd import DeviceType
from torch.profiler import ProfilerAction, ProfilerActivity

from pipeline.config import OptimConfig, TrainConfig
from pipeline.models.llama import Llama
from pipeline.models.transformer import init_weights
from pipeline.training import loop

# (category, regex on the lower-cased name); the first match wins, else OTHER. CPU: aten ops; CUDA: kernels (cuBLAS
# nvjet/xmma/cutlass gemms, flash/fmha attention, at::native elementwise/reduce kernels, torch.compile's triton_*)
CATEGORIES: tuple[tuple[str, str], ...] = (
    ("optimizer", r"optimizer|adam|foreach|multi_tensor|lpnorm|clip_grad|vector_norm"),
    ("attention", r"flash|fmha|sdpa|scaled_dot_product|attention"),
    ("matmul", r"gemm|aten::(mm|addmm|bmm|matmul|linear)\b|nvjet|xmma|cutlass|cublas|triton_tem|sm\d\d_"),
    ("reduce/softmax/loss", r"softmax|nll|cross_?entropy|logsumexp|reduce|aten::(sum|amax|max)\b|triton_(red|per)"),
    (
        "elementwise+casts",
        r"elementwise|triton_poi|memcpy|memset|copy|cast|index|embedding|aten::_?(mul|add|r?sub|div|to|silu|sigmoid|"
        r"rsqrt|pow|mean|neg|exp|log|fill|zero|cat|clamp|where|gather|scatter|stack|clone|cos|sin|outer|"
        r"arange|isfinite|repeat_interleave|ones|zeros|full)(_|\b)",
    ),
)
OTHER = "other"
HOST = "[host: Python between ops]"  # a ProfilerStep's own self time on CPU
SYNC_CALLS = r"^cu(da)?(Device|Stream|Event|Ctx)Synchronize|^cudaMemcpy(2D)?($|_v)"  # runtime calls that wait
SYNC_WARNING = "called a synchronizing CUDA operation"  # torch.cuda.set_sync_debug_mode("warn")'s
READS = ("aten::_local_scalar_dense", "aten::nonzero", "aten::masked_select", "aten::equal")  # on the host
ANNOTATIONS = ("ProfilerStep", "Optimizer.")  # ranges the profiler may mirror on the GPU's timeline
LAUNCH_CALLS = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchCooperativeKernel", "cudaGraphLaunch")


def category(name: str) -> str:
    return next((c for c, pattern in CATEGORIES if re.search(pattern, name.lower())), OTHER)


class Window:
    """The timed and profiled steps' boundaries (`at_step`): CUDA events (read after the window), else the clock."""

    def __init__(self, device: torch.device, warmup: int, steps: int):
        self.device, self.warmup, self.steps = device, warmup, steps
        self.start = warmup + steps  # the first profiled step
        self.log_step = self.start + steps // 2  # the one profiled step that logs
        self.cuda = device.type == "cuda"
        self.timed: list[Any] = []  # a mark at the start of each timed step and of the first profiled one
        self.marks: list[Any] = []  # ... of each profiled step and of the step after them
        self.warned: list[list[warnings.WarningMessage]] = []  # each profiled step's sync-debug warnings
        self.caught: list[warnings.WarningMessage] = []
        self.seen = 0  # warnings caught before this step
        self.prof: torch.profiler.profile | None = None
        self.stack = ExitStack()
        self.done = False

    def mark(self) -> Any:
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def at_step(self, step: int) -> None:
        if self.warmup <= step <= self.start:
            if step == self.warmup:
                self.sync()
            self.timed.append(self.mark())
        if step == self.start:
            self.begin()
        elif self.start < step <= self.start + self.steps:
            self.marks.append(self.mark())
            self.warned.append([w for w in self.caught[self.seen :] if SYNC_WARNING in str(w.message)])
            self.seen = len(self.caught)
            if step == self.start + self.steps:
                self.end()
            else:
                self.prof.step()

    def begin(self) -> None:
        self.sync()  # nothing queued before the window runs inside it
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
        # a schedule makes the profiler mark each step (ProfilerStep#k); this one records them all
        self.prof = torch.profiler.profile(activities=activities, schedule=lambda _: ProfilerAction.RECORD)
        self.prof.start()
        self.caught = self.stack.enter_context(warnings.catch_warnings(record=True))
        warnings.simplefilter("always")
        if self.cuda:
            torch.cuda.set_sync_debug_mode("warn")
        self.marks.append(self.mark())

    def end(self) -> None:
        self.close_debug()
        self.prof.step()  # the wait below lands in a step of its own, outside the profiled ones
        self.sync()
        self.prof.stop()
        self.done = True

    def close_debug(self) -> None:
        """Sync-debug mode off, warnings caught no more; those that were not about syncs shown as usual."""
        if self.cuda:
            torch.cuda.set_sync_debug_mode(0)
        self.stack.close()
        for w in self.caught:
            if SYNC_WARNING not in str(w.message):
                warnings.showwarning(w.message, w.category, w.filename, w.lineno)

    def close(self) -> None:
        """After the run, also one that failed inside the window."""
        if self.prof is not None and not self.done:
            self.close_debug()
            self.prof.stop()

    def intervals(self, marks: list[Any]) -> list[float]:
        """Milliseconds between consecutive marks."""
        gap = (lambda a, b: a.elapsed_time(b)) if self.cuda else (lambda a, b: (b - a) * 1e3)
        return [gap(a, b) for a, b in zip(marks, marks[1:])]


def run_loop(args: argparse.Namespace, shape: Shape, window: Window) -> loop.TrainResult:
    """`loop.train` on random tokens of `shape` for the window's steps and one more; its `lr_at` marks each step."""
    torch.manual_seed(0)
    model = Llama(shape.config())
    init_weights(model, 0.02, 0)
    data = np.random.default_rng(0).integers(0, shape.vocab, size=4 * shape.batch * (shape.seq + 1))
    total = window.start + window.steps + 1
    batch = dict(steps=total, batch_size=shape.batch, seq_len=shape.seq, precision=args.precision)
    run = dict(device=args.device, compile=args.compile, cuda_graph=args.cuda_graph, keep_best=False)
    run["fused_kernels"] = not args.plain
    # validation only at the last step (after the window); exactly one log step inside the window
    cadence = dict(eval_every=total, log_every=window.log_step + 1, max_epochs=0.0, checkpoint_every=0)
    tcfg = TrainConfig(**batch, **run, **cadence, resume="never")
    real = loop.lr_at

    def lr_at(step: int, optim: OptimConfig, total_steps: int) -> float:
        window.at_step(step)
        return real(step, optim, total_steps)

    with mock.patch.object(loop, "lr_at", lr_at):
        try:
            optim = OptimConfig(table_lr_scale=0.0 if args.frozen_table else 1.0)
            job = loop.TrainJob(tcfg, optim, 0, progress=False)
            result = loop.train(model, data, data[: shape.seq + 1], job, hooks=loop.Hooks())
        finally:
            window.close()
    return result


def is_device_work(e: Any) -> bool:
    """A kernel, memcpy or memset on the GPU (not a range the profiler mirrors there)."""
    return e.device_type == DeviceType.CUDA and not e.is_user_annotation and not e.name.startswith(ANNOTATIONS)


def step_ranges(events: list[Any]) -> list[tuple[float, float]]:
    """(start, end) µs of each ProfilerStep#k on the host, in order: the profiled steps, then the closing one."""
    steps = [e for e in events if e.device_type == DeviceType.CPU and e.name.startswith("ProfilerStep")]
    return sorted((e.time_range.start, e.time_range.end) for e in steps)


def step_of(t: float, ranges: list[tuple[float, float]]) -> int | None:
    """The index of the profiled step whose host range holds time `t`, if any."""
    i = bisect.bisect_right([r[0] for r in ranges], t) - 1
    return i if i >= 0 and t <= ranges[i][1] else None


def costs(events: list[Any], ranges: list[tuple[float, float]], cuda: bool) -> list[tuple[str, float]]:
    """(name, µs): each kernel's GPU time on CUDA, else each op's self CPU time in the profiled steps (HOST's too)."""
    if cuda:
        return [(e.name, e.time_range.elapsed_us()) for e in events if is_device_work(e)]
    return [
        (HOST if e.name.startswith("ProfilerStep") else e.name, e.self_cpu_time_total)
        for e in events
        if e.device_type == DeviceType.CPU and step_of(e.time_range.start, ranges) is not None
    ]


def tables(work: list[tuple[str, float]], n: int, window_us: float, top: int) -> tuple[list[dict], dict]:
    """The top `top` names by time (ms and calls per step, share of the step) and the time by category."""
    us, calls = Counter(), Counter()
    for name, t in work:
        us[name] += t
        calls[name] += 1
    rows = [
        {"name": k, "ms_per_step": v / n / 1e3, "share": v / window_us, "calls_per_step": calls[k] / n}
        for k, v in us.most_common(top)
    ]
    by_cat: dict[str, float] = defaultdict(float)
    for name, t in us.items():
        by_cat[OTHER if name == HOST else category(name)] += t
    total = sum(by_cat.values()) or 1.0
    cats = {c: {"ms_per_step": by_cat[c] / n / 1e3, "share": by_cat[c] / total} for c, _ in (*CATEGORIES, (OTHER, ""))}
    return rows, cats


def site(w: warnings.WarningMessage) -> str:
    """Where a warning was raised: relative to the repository, else to torch's folder."""
    path = Path(w.filename)
    base = next((b for b in (ROOT, Path(torch.__file__).parent.parent) if path.is_relative_to(b)), path.parent)
    return f"{path.relative_to(base)}:{w.lineno}"


def reader(e: Any) -> str:
    """Who read device data on the host: the op around the read, or Python (float(t), bool(t), t.item())."""
    p = e.cpu_parent
    while p is not None and p.name in ("aten::item", "aten::is_nonzero"):
        p = p.cpu_parent
    return "Python: float/int/bool(tensor), .item()" if p is None or p.name.startswith("ProfilerStep") else p.name


def host_waits(events: list[Any], ranges: list[tuple[float, float]], window: Window) -> dict[str, Any]:
    """Per profiled step: synchronising runtime calls, sync-debug warnings, ops that read device data on the
    host (READS: a wait each on a GPU, seen on CPU too), cudaMemcpy* calls; each one's most in a non-log step."""
    n, log_index = window.steps, window.log_step - window.start
    per_step = {k: [0] * n for k in ("sync_calls", "sync_warnings", "reads", "memcpy_calls")}
    sources: Counter[str] = Counter()  # who waited (sync-debug warnings' lines) or read device data (ops)
    for e in events:
        i = step_of(e.time_range.start, ranges) if e.device_type == DeviceType.CPU else None
        if i is not None:
            per_step["sync_calls"][i] += bool(re.search(SYNC_CALLS, e.name))
            per_step["reads"][i] += e.name in READS
            if e.name in READS and i != log_index:
                sources[f"non-log device read by {reader(e)}"] += 1
            per_step["memcpy_calls"][i] += e.name.startswith("cudaMemcpy")
    per_step["sync_warnings"] = [len(ws) for ws in window.warned]
    others = [i for i in range(n) if i != log_index]
    for i, ws in enumerate(window.warned):
        sources.update(f"{'log-step' if i == log_index else 'non-log'} sync at {site(w)}" for w in ws)
    nonlog = {k: max((v[i] for i in others), default=0) for k, v in per_step.items()}
    return dict(log_step=log_index, per_step=per_step, nonlog_max=nonlog, sources=sources.most_common(12))


def summarize(window: Window, shape: Shape, args: argparse.Namespace, seconds: float) -> dict[str, Any]:
    """Everything printed, as one dict (the JSON)."""
    events = list(window.prof.events())
    ranges = step_ranges(events)[: window.steps]
    profiled, timed = window.intervals(window.marks), window.intervals(window.timed)
    window_us, n = sum(profiled) * 1e3, window.steps
    top, cats = tables(costs(events, ranges, window.cuda), n, window_us, args.top)
    tokens, fpt = shape.batch * shape.seq, train_flops_per_token(shape)
    peak = args.peak_tflops * 1e12 if args.peak_tflops else (H100_BF16_TFLOPS * 1e12 if window.cuda else None)
    s: dict[str, Any] = dict(shape=shape.describe(), device=device_name(window.device), steps=n, seconds=seconds)
    s.update({k: getattr(args, k) for k in ("compile", "cuda_graph", "plain", "precision", "warmup")})
    s.update(tokens_per_step=tokens)
    s.update(step_ms=statistics.median(profiled), step_ms_unprofiled=statistics.median(timed), step_ms_each=profiled)
    s.update(peak_tflops=peak / 1e12 if peak else None, categories=cats, top=top)
    for key in ("", "_unprofiled"):
        s[f"tokens_per_s{key}"] = tokens / s[f"step_ms{key}"] * 1e3
        s[f"mfu{key}"] = s[f"tokens_per_s{key}"] * fpt / peak if peak else None
    s["host_waits"] = host_waits(events, ranges, window)
    s["host_ms_each"] = [(b - a) / 1e3 for a, b in ranges]
    if window.cuda:
        work = [e for e in events if is_device_work(e)]
        s["kernels_per_step"] = sum(not e.name.startswith(("Memcpy", "Memset")) for e in work) / n
        s["launch_calls_per_step"] = sum(e.name.startswith(LAUNCH_CALLS) for e in events) / n
        s["d2h_copies_per_step"] = sum("DtoH" in e.name for e in work) / n
        s["gpu_idle"] = max(0.0, 1.0 - sum(e.time_range.elapsed_us() for e in work) / window_us)  # one stream
        host = [(name, t) for name, t in costs(events, ranges, False) if name != HOST]
        s["top_host"] = tables(host, n, window_us, max(args.top // 2, 1))[0]
    return s


def report(s: dict[str, Any], cuda: bool) -> None:
    """The summary as plain lines: timing, host waits, GPU use, then the tables."""
    w, each = s["host_waits"], lambda xs: " ".join(f"{x:.1f}" for x in xs)
    mode = "train.cuda_graph=true" if s.get("cuda_graph") else "train.compile=true" if s["compile"] else "eager"
    mode += "; train.fused_kernels=false" if s.get("plain") else ""
    reads = "it reads the queued figures: one wait by design" if cuda else "on CPU every step reads its figures"
    print(f"\n== profile_step: {s['shape']}\n   {s['device']}; {mode}; {s['precision']}; loop: pipeline.training.loop")
    print(
        f"   {s['warmup']} warm-up, {s['steps']} timed (no profiler), {s['steps']} profiled steps, 1 more (validates); "
        f"the profiled window holds one log step (#{w['log_step']}: {reads})"
    )
    mfu = [f"{x:.1%}" if x is not None else "n/a" for x in (s["mfu_unprofiled"], s["mfu"])]
    peak = f" of {s['peak_tflops']:.0f} TFLOP/s" if s["peak_tflops"] else " (--peak-tflops to set on CPU)"
    print(
        f"step: {s['step_ms_unprofiled']:.2f} ms median unprofiled = {s['tokens_per_s_unprofiled']:,.0f} tok/s, "
        f"MFU {mfu[0]}{peak}; profiled {s['step_ms']:.2f} ms = {s['tokens_per_s']:,.0f} tok/s, MFU {mfu[1]}; "
        f"each profiled: {each(s['step_ms_each'])} ms (host: {each(s['host_ms_each'])})"
    )
    per, most = w["per_step"], w["nonlog_max"]
    print(
        f"host waits per profiled step (#{w['log_step']} logs): sync calls {per['sync_calls']}, sync-debug warnings "
        f"{per['sync_warnings']}, device data read (item/nonzero/...) {per['reads']}, cudaMemcpy* {per['memcpy_calls']}"
    )
    cpu = " (CPU: no waits; its fused AdamW reads its step counts on the host)"
    print(f"   non-log steps at most (each must be 0): {most}" + ("" if cuda else cpu))
    for source, count in w["sources"]:
        print(f"   {source} x{count}")
    if cuda:
        print(
            f"kernels: {s['kernels_per_step']:.0f}/step ({s['launch_calls_per_step']:.0f} launch calls), D2H copies "
            f"{s['d2h_copies_per_step']:.1f}/step; GPU idle {s['gpu_idle']:.1%} of the profiled window"
        )
    what = "GPU kernel time" if cuda else "self CPU time"
    print(f"time by category ({what}; ms/step, share):")
    for name, c in sorted(s["categories"].items(), key=lambda kv: -kv[1]["share"]):
        print(f"   {name:20s} {c['ms_per_step']:9.2f} {c['share']:7.1%}")
    print_top(f"top {len(s['top'])} by {what}", s["top"])
    if cuda:
        print_top(f"top {len(s['top_host'])} host ops by self CPU time, all threads", s["top_host"])


def print_top(title: str, rows: list[dict[str, Any]]) -> None:
    print(f"{title} (ms/step, share of step, calls/step, category):")
    for r in rows:
        cat = OTHER if r["name"] == HOST else category(r["name"])
        print(f"   {r['ms_per_step']:9.3f} {r['share']:6.1%} {r['calls_per_step']:7.1f}  {cat:19s} {r['name'][:110]}")


def save(s: dict[str, Any], window: Window, args: argparse.Namespace, shape: Shape) -> None:
    """The JSON summary to --out; the chrome trace to --trace (gzipped when large)."""
    if args.trace:
        path = Path(args.trace)
        path.parent.mkdir(parents=True, exist_ok=True)
        window.prof.export_chrome_trace(str(path))
        if path.suffix != ".gz" and path.stat().st_size > 16 * 2**20:  # then gzipped (torch does it for .gz)
            path.unlink()
            path = Path(f"{path}.gz")
            window.prof.export_chrome_trace(str(path))
        s["trace"] = str(path)
        print(f"trace: {path} ({path.stat().st_size / 2**20:.1f} MiB)")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    modes = f"{'_compile' * args.compile}{'_graph' * args.cuda_graph}{'_plain' * args.plain}"
    name = f"profile_{shape.name}_{args.device}{modes}.json"
    (out / name).write_text(json.dumps(s, indent=1))
    print(f"summary: {out / name}")


def default_out() -> str:
    """Where a summary goes unless --out or $OUT says: never benchmarks/results/, whose files each
    carry the conditions of one dated run (a profile on another machine overwrote them)."""
    return str(Path(tempfile.gettempdir()) / "profile_step")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="135m", help="135m, tiny, tiny-default, small or smoke (gpu_common)")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cuda")
    p.add_argument("--compile", action="store_true", help="train.compile=true (compiled blocks)")
    p.add_argument("--cuda-graph", action="store_true", help="train.cuda_graph=true (each step one CUDA graph)")
    p.add_argument("--plain", action="store_true", help="train.fused_kernels=false (no Triton kernels)")
    p.add_argument("--precision", choices=["bf16", "fp32"], default="bf16")
    p.add_argument("--frozen-table", action="store_true", help="optim.table_lr_scale=0, as the default recipe trains")
    p.add_argument("--steps", type=int, default=5, help="timed steps, then as many profiled")
    p.add_argument("--warmup", type=int, default=3, help="steps first (at least 1: compilation, the first log)")
    p.add_argument("--top", type=int, default=15, help="rows of the top table")
    p.add_argument("--peak-tflops", type=float, help=f"MFU denominator (CUDA default {H100_BF16_TFLOPS:.0f})")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--trace", help="write a chrome trace here (.gz: gzipped; gzipped anyway above 16 MiB)")
    p.add_argument(
        "--out",
        default=os.environ.get("OUT") or default_out(),
        help="the summary's folder ($OUT, else a folder under the temp dir: a committed results file is"
        " replaced only when named here, with its date and machine beside it)",
    )
    args = p.parse_args(argv)
    if args.steps < 1 or args.warmup < 1:
        p.error("--steps and --warmup must be at least 1")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Profile, print, save; the summary."""
    args = parse_args(argv)
    torch.set_num_threads(args.threads or torch.get_num_threads())
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("no CUDA device (use --device cpu)")
    shape = pick_shapes(args.shape, None, None)[0]
    window = Window(torch.device(args.device), args.warmup, args.steps)
    start = time.perf_counter()
    run_loop(args, shape, window)
    summary = summarize(window, shape, args, time.perf_counter() - start)
    report(summary, window.cuda)
    save(summary, window, args, shape)
    return summary


if __name__ == "__main__":
    main()
