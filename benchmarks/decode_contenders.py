"""decode_speed.py's side-by-side run on a device (issue 19: one GPU): greedy decode of one prompt, batch 1,
each contender alone on the device, one after another, in each precision.

Contenders: `ours` (`for_decoding(model, precision, device)` + `stream_ids`, as `generate` runs it),
`hf` (transformers `generate`, dynamic cache), `hf-static` (`generate` with
`cache_implementation="static"`: transformers compiles its decoding forward itself, with a
`CompileConfig(fullgraph=True, mode="reduce-overhead")` on CUDA; on CPU its compile is forced on with
the default mode, so the same path runs here). transformers loads the same GGUF
(`from_pretrained(dir, gguf_file=...)`), or with `--donor random` both sides build the shape with random
weights (no GGUF or gguf-py needed: a bare GPU host; their greedy ids then differ).

Decode tok/s = tokens after the first over their time. Ours streams one id at a time (each id reaches
the host), so the first id's arrival splits prefill from decode, as on CPU; `generate` returns all ids at
once, so its decode time is the time of a `k`-token call less that of a 1-token call (the same prompt).
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from gpu_common import clock, device_name, guarded, hf_llama, memory_label, named_shapes, peak_mib, release

from pipeline.donor.locate import resolve_gguf_path
from pipeline.inference.decode import for_decoding
from pipeline.inference.sampling import Sampling, stream_ids
from pipeline.models.llama import Llama
from pipeline.models.registry import load_gguf
from pipeline.models.transformer import init_weights
from pipeline.tokenizer.gguf_tokenizer import tokenizer_from_gguf

CONTENDERS = ("ours", "hf", "hf-static")
Runner = Callable[[int], tuple[list[int], float, float]]  # k -> (ids, prefill s, decode s)


@dataclass
class Models:
    """Both sides' fp32 models on the CPU (each contender copies its own onto the device) and the prompt."""

    ours: torch.nn.Module
    hf: Callable[[], torch.nn.Module]
    prompt_ids: list[int]
    what: str


def timed(stream: Iterator[int], n: int) -> tuple[list[int], float, float]:
    """(ids, prefill seconds, decode seconds) of the first `n` ids of `stream`."""
    ids: list[int] = []
    start = time.perf_counter()
    first = start
    for tok in stream:
        if not ids:
            first = time.perf_counter()
        ids.append(int(tok))
        if len(ids) >= n:
            break
    end = time.perf_counter()
    return ids, first - start, end - first


def cycle_to(ids: list[int], n: int) -> list[int]:
    """`ids` repeated to exactly `n` tokens (a prompt of the asked length from a short text)."""
    return [ids[i % len(ids)] for i in range(n)]


def load_models(args: argparse.Namespace) -> Models:
    """The GGUF donor for both sides (`--donor smollm2` or a path), or `--donor random` at `--shape`."""
    n_ctx = args.prompt_tokens + args.new_tokens
    if args.donor == "random":
        shape = named_shapes()[args.shape]
        ours = Llama(shape.config(context=n_ctx))
        init_weights(ours, 0.02, 0)
        ids = torch.randint(0, shape.vocab, (args.prompt_tokens,), generator=torch.Generator().manual_seed(0))

        def hf() -> torch.nn.Module:
            torch.manual_seed(0)
            return hf_llama(shape).eval()

        return Models(ours, hf, ids.tolist(), f"{shape.describe_model()}, random weights (each side its own)")
    return donor_models(args.donor, args.prompt, args.prompt_tokens)


def donor_models(spec: str, prompt: str, prompt_tokens: int) -> Models:
    """Our fp32 model of the GGUF and transformers' of the same file (dequantized by gguf-py), the prompt
    tokenized by our tokenizer (BOS first) and cycled to `prompt_tokens`."""
    path = resolve_gguf_path(spec)
    model, g = load_gguf(path)
    tok = tokenizer_from_gguf(g)
    ids = cycle_to(tok.encode(prompt), prompt_tokens)
    if tok.add_bos and tok.bos_id is not None:
        ids = [tok.bos_id, *ids[:-1]]
    cpu_copy: list[torch.nn.Module] = []

    def hf() -> torch.nn.Module:
        """A fresh copy of transformers' model for each contender (the file is dequantized once)."""
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging

        if not cpu_copy:
            logging.disable_progress_bar()  # a bar per tensor in a log file
            os.environ.setdefault("TQDM_DISABLE", "1")  # the GGUF dequantizer's own bar
            loaded = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
            cpu_copy.append(loaded.eval())
        return copy.deepcopy(cpu_copy[0])

    return Models(model, hf, ids, f"{path.name} (both sides dequantized from it)")


def ours_runner(models: Models, precision: str, device: torch.device) -> Runner:
    m = for_decoding(models.ours.eval(), precision, device)

    def run(k: int) -> tuple[list[int], float, float]:
        clock(device)
        return timed(stream_ids(m, models.prompt_ids, Sampling(temperature=0.0)), k)

    return run


def hf_runner(models: Models, precision: str, static: bool, n: int, device: torch.device) -> tuple[Runner, object]:
    """transformers `generate` of 1 or `n` ids on a copy of the model in `precision`; (runner, model)."""
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import CompileConfig

    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    model = models.hf().to(device=device, dtype=dtype).eval()
    model.generation_config.eos_token_id = None  # never stop early: transformers fills unset keys from it
    gc = GenerationConfig(do_sample=False, eos_token_id=None, pad_token_id=0)
    if static:
        gc.cache_implementation = "static"
        gc.compile_config = CompileConfig(
            fullgraph=True, mode="reduce-overhead" if device.type == "cuda" else "default"
        )
        if device.type != "cuda":
            gc.compile_config._compile_all_devices = True  # transformers compiles on accelerators only otherwise
    x = torch.tensor([models.prompt_ids], device=device)
    configs = {k: copy.deepcopy(gc) for k in (1, n)}
    for k, c in configs.items():
        c.max_new_tokens = k

    def gen(k: int) -> tuple[list[int], float]:
        start = clock(device)
        with torch.inference_mode():
            out = model.generate(x, attention_mask=torch.ones_like(x), generation_config=configs[k])
        ids = out[0, x.shape[1] :].tolist()
        if len(ids) != k:  # a rate over fewer tokens than counted would be wrong
            raise RuntimeError(f"generate stopped after {len(ids)} of {k} tokens")
        return ids, clock(device) - start

    def run(k: int) -> tuple[list[int], float, float]:
        _, first = gen(1)
        ids, total = gen(k)
        return ids, first, total - first

    return run, model


def measure(name: str, precision: str, models: Models, args: argparse.Namespace, device: torch.device) -> dict:
    """Warm-up runs (compilation, CUDA graphs), then `args.repeats` timed runs of `args.new_tokens` ids."""
    t0 = clock(device)
    if name == "ours":
        run, model = ours_runner(models, precision, device), None
    else:
        run, model = hf_runner(models, precision, name == "hf-static", args.new_tokens, device)
    t1 = clock(device)
    for _ in range(args.warmup):
        run(args.new_tokens)
    t2 = clock(device)
    runs = [run(args.new_tokens) for _ in range(args.repeats)]
    n = args.new_tokens
    return {
        "ids": runs[0][0],
        "rate": statistics.median((n - 1) / d for _, _, d in runs),
        "prefill": statistics.median(p for _, p, _ in runs),
        "peak": peak_mib(device),
        "load": t1 - t0,
        "warm": t2 - t1,
        "compiled": model is not None and hasattr(model, "_compiled_call"),
    }


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def run_precision(precision: str, names: list[str], models: Models, args: argparse.Namespace, device) -> dict:
    """Every contender in one precision, printed as it finishes; then the ratios to the fastest transformers one."""
    print(
        f"\n{precision}:  {'decode tok/s':>12} {'prefill ms':>10} {memory_label(device):>15} {'load s':>7} "
        f"{'warm-up s':>9}  same leading ids as the first"
    )
    done: dict[str, dict] = {}
    for name in names:
        release(device, compiled=True)
        r = guarded(f"{name} {precision}", lambda name=name: measure(name, precision, models, args, device))
        release(device, compiled=True)
        if not isinstance(r, dict):
            continue
        done[name] = r
        first = next(iter(done.values()))["ids"]
        note = "  (compiled)" if r["compiled"] else ""
        print(
            f"  {name:10s} {r['rate']:12.1f} {r['prefill'] * 1e3:10.1f} {r['peak']:15.0f} {r['load']:7.1f} "
            f"{r['warm']:9.1f}  {common_prefix(r['ids'], first):>4}/{len(first)}{note}",
            flush=True,
        )
    ref = max((n for n in done if n.startswith("hf")), key=lambda n: done[n]["rate"], default=None)
    for name, r in done.items():
        if ref and name != ref:
            print(
                f"  ratio {name}/{ref}: decode {r['rate'] / done[ref]['rate']:.2f}x, memory "
                f"{r['peak'] / done[ref]['peak']:.2f}x"
            )
    return done


def run_all(args: argparse.Namespace, argv: str) -> None:
    device = torch.device(args.device)
    names = args.contenders.split(",")
    unknown = [n for n in names if n not in CONTENDERS]
    if unknown:
        raise SystemExit(f"unknown contender(s) {', '.join(unknown)}; known: {', '.join(CONTENDERS)}")
    models = load_models(args)
    print(f"device: {device_name(device)}\ncommand: {argv}")
    print(
        f"{models.what}; prompt {len(models.prompt_ids)} tokens, {args.new_tokens} new tokens, greedy, batch 1; "
        f"{args.warmup} warm-up runs, median of {args.repeats}"
    )
    rows = []
    for precision in args.precisions.split(","):
        done = run_precision(precision, names, models, args, device)
        cells = [f"{done[n]['rate']:.0f}" if n in done else "-" for n in names]
        rows.append(f"| {precision} | " + " | ".join(cells) + " |")
    print(f"\ndecode tok/s on {device_name(device)}:\n| precision | " + " | ".join(names) + " |")
    print("|---" * (len(names) + 1) + "|\n" + "\n".join(rows))
