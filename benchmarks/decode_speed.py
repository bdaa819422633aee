"""Greedy decode speed of our model vs llama.cpp (llama-cpp-python) on the SmolLM2 GGUF, side by side.

    python benchmarks/decode_speed.py [--new-tokens 64] [--threads 1 2] [--repeats 3] [--prompt "..."] [--eager]
        [--out benchmarks/results/decode_cpu.json]

Both decode the same prompt ids (our tokenizer) for the same number of new tokens, greedily, on
the same number of threads, after a warm-up; runs are interleaved (ours int8, bf16, fp32 as
`generate precision=...` runs them, i.e. `pipeline.inference.decode.for_decoding`; with `--eager` also
the plain bf16 module; then llama.cpp) and the median of the repeats is reported, because the
machine is shared. Decode rate
= tokens after the first over their time (llama.cpp's "eval" rate); prefill = prompt pass + first
token. Threads default to 1: on a shared 2-core machine, 2 threads of either engine wait at
OpenMP / ggml barriers while other jobs hold a core, and both rates collapse.

Agreement: "same leading ids" = how many leading greedy ids equal llama.cpp's (one near-tie flips
the rest); "teacher-forced" = at how many of llama.cpp's positions our argmax is llama.cpp's id
when fed llama.cpp's prefix; "vs fp32" = the same against our fp32 path's greedy ids, with the
fp32 top-2 logit margin at each position where they differ (a small margin = a near-tie). Ours runs
the dequantized weights (fp32, bf16, or int8 per row), llama.cpp the Q4_1 weights with quantized
activations, so near-ties can go either way.

On a GPU (issue 19: one H100), ours vs transformers `generate` (dynamic cache) vs transformers' static
cache compiled, bf16 and fp32, each alone on the device (`decode_contenders.py`; no llama.cpp there):

    python benchmarks/decode_speed.py --device cuda --contenders ours,hf,hf-static --precisions bf16,fp32

`--donor PATH` reads another GGUF; `--donor random --shape 135m` runs random weights of that shape
(no donor file needed).
The same run on this CPU at toy size (proves the code paths; the figures mean nothing):

    python benchmarks/decode_speed.py --device cpu --contenders ours,hf,hf-static --donor random --shape smoke
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable

import torch
from decode_contenders import CONTENDERS, run_all, timed  # this folder is on sys.path when run as a script
from harness import write_results

from pipeline.donor.locate import resolve_gguf_path
from pipeline.inference.chat_session import common_prefix
from pipeline.inference.decode import PRECISIONS, PackedLlama, for_decoding
from pipeline.inference.sampling import Sampling, stream_ids
from pipeline.models.registry import load_gguf
from pipeline.tokenizer.gguf_tokenizer import tokenizer_from_gguf

PROMPT = "The history of the Python programming language begins"
MEASURED = {  # the README's Measured row (benchmarks/results_table.py)
    "topic": "decode",
    "order": 8,
    "headline": "{t2_int8_vs_llamacpp} llama.cpp at 2 threads, int8 ({t2_int8_tok_s} vs {t2_llamacpp_tok_s} tok/s)",
    "table": "docs/tools.md#decode-speed-against-llamacpp",
}


def forced_logits(model: torch.nn.Module, prompt_ids: list[int], ref_ids: list[int]) -> torch.Tensor:
    """fp32 logits at each of `ref_ids`' positions when fed `prompt_ids + ref_ids` (teacher forcing)."""
    with torch.inference_mode():
        return model(torch.tensor([prompt_ids + ref_ids[:-1]]))[0, len(prompt_ids) - 1 :].float()


def teacher_forced_agreement(model: torch.nn.Module, prompt_ids: list[int], ref_ids: list[int]) -> int:
    """How many of the reference greedy ids are also our argmax when fed the reference's own prefix:
    a per-position check that does not compound after one near-tie flips."""
    return int((forced_logits(model, prompt_ids, ref_ids).argmax(-1) == torch.tensor(ref_ids)).sum())


def disagreements_vs_fp32(model: torch.nn.Module, fp32: torch.nn.Module, prompt_ids: list[int], ids: list[int]) -> str:
    """Teacher-forced agreement with our fp32 path on its own greedy `ids`, and fp32's top-2 margin
    where the argmaxes differ."""
    ours, ref = forced_logits(model, prompt_ids, ids), forced_logits(fp32, prompt_ids, ids)
    differ = (ours.argmax(-1) != ref.argmax(-1)).nonzero().flatten().tolist()
    top2 = ref.topk(2, dim=-1).values
    margins = ", ".join(f"{float(top2[i, 0] - top2[i, 1]):.2f}" for i in differ)
    return f"{len(ids) - len(differ)}/{len(ids)}" + (f" (fp32 margins {margins})" if differ else "")


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the weights one token reads: every matmul weight (and scale) once, the tied table once."""
    if not isinstance(model, PackedLlama):
        return sum(p.numel() * p.element_size() for p in model.parameters())
    linears = [model.head] + [getattr(w, n) for w in model.layers for n in ("qkv", "wo", "gate_up", "down")]
    tensors = [t for lin in linears for t in (lin.weight, lin.scale) if t is not None]
    return sum(t.numel() * t.element_size() for t in tensors)


def bench(
    threads: int, models: dict[str, torch.nn.Module], path: str, prompt_ids: list[int], n: int, repeats: int
) -> dict[str, list[tuple[list[int], float, float]]]:
    """Interleaved timed runs of each of our models and llama.cpp, all on `threads` threads."""
    from llama_cpp import Llama as LlamaCpp  # the peer; not a project dependency

    torch.set_num_threads(threads)
    peer = LlamaCpp(path, n_ctx=512, n_threads=threads, n_threads_batch=threads, verbose=False, seed=0)

    def ours(m: torch.nn.Module) -> Callable[[int], tuple[list[int], float, float]]:
        return lambda k: timed(stream_ids(m, prompt_ids, Sampling(temperature=0.0)), k)

    def llama_cpp(k: int) -> tuple[list[int], float, float]:
        peer.reset()  # no prompt-prefix reuse between runs
        return timed(peer.generate(prompt_ids, temp=0.0, repeat_penalty=1.0), k)

    runners = {name: ours(m) for name, m in models.items()} | {"llama.cpp": llama_cpp}
    for run in runners.values():  # warm-up: allocator, oneDNN / ggml kernels, mmap pages
        run(8)
    results: dict[str, list[tuple[list[int], float, float]]] = {name: [] for name in runners}
    for _ in range(repeats):
        for name, run in runners.items():
            results[name].append(run(n))
    peer.close()
    return results


def report(threads: int, results: dict, models: dict, prompt_ids: list[int], n: int, tok) -> dict[str, dict]:
    """The table of one thread count, printed; its rows by engine, returned."""
    print(f"\n{threads} thread(s): decode tok/s = (n-1)/decode time, median of {len(results['llama.cpp'])} runs")
    head = ("decode tok/s", "prefill s", "vs llama.cpp", "same leading ids", "teacher-forced", "vs fp32")
    print(f"{'':11} {head[0]:>12} {head[1]:>10} {head[2]:>12} {head[3]:>17} {head[4]:>15}  {head[5]}")
    ref_ids = results["llama.cpp"][0][0]
    ref_rate = statistics.median((n - 1) / d for _, _, d in results["llama.cpp"])
    fp32_ids = results["ours fp32"][0][0]
    rows = {}
    for name, runs in results.items():
        rate = statistics.median((n - 1) / d for _, _, d in runs)
        prefill = statistics.median(p for _, p, _ in runs)
        lead = common_prefix(runs[0][0], ref_ids)
        forced = teacher_forced_agreement(models[name], prompt_ids, ref_ids) if name in models else n
        fp32 = models["ours fp32"]
        vs_fp32 = disagreements_vs_fp32(models[name], fp32, prompt_ids, fp32_ids) if name in models else ""
        cells = f"{rate:12.1f} {prefill:10.3f} {rate / ref_rate:11.3f}x {lead:>11}/{n} {forced:>11}/{n}"
        print(f"{name:11} {cells}  {vs_fp32}")
        rows[name] = {"tok_s": rate, "prefill_s": prefill, "vs_llamacpp": rate / ref_rate, "teacher_forced": forced}
    print(f"llama.cpp text: {tok.decode(ref_ids)!r}")
    for name in models:
        if results[name][0][0] != ref_ids:
            print(f"{name} text: {tok.decode(results[name][0][0])!r}")
    return rows


def figures(tables: dict[int, dict[str, dict]]) -> dict[str, str]:
    """The named figures the docs quote: per thread count and engine, decode tok/s and the ratio to llama.cpp."""
    out = {}
    for threads, rows in tables.items():
        for name, row in rows.items():
            slug = f"t{threads}_{name.replace('ours ', '').replace('.', '').replace(' ', '_')}"
            out[f"{slug}_tok_s"] = f"{row['tok_s']:.1f}"
            out[f"{slug}_vs_llamacpp"] = f"{row['vs_llamacpp']:.2f}x"
    return out


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--new-tokens", type=int, help="default 64 (CPU vs llama.cpp); with --contenders 256")
    ap.add_argument("--threads", type=int, nargs="+", default=[1])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--prompt", default=PROMPT)
    ap.add_argument("--eager", action="store_true", help="also time the plain bf16 module (the old path)")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="cuda: ours vs transformers")
    ap.add_argument("--contenders", help=f"from {','.join(CONTENDERS)} (default with cuda: all), one after another")
    ap.add_argument("--precisions", default="bf16,fp32", help="with --contenders")
    ap.add_argument("--donor", default="smollm2", help="with --contenders: smollm2, a GGUF path, or random")
    ap.add_argument("--shape", default="135m", help="with --donor random: a shape of gpu_common.named_shapes")
    ap.add_argument("--prompt-tokens", type=int, default=32, help="with --contenders: the prompt cycled to this")
    ap.add_argument("--warmup", type=int, default=2, help="with --contenders: untimed runs first")
    ap.add_argument("--out", help="CPU vs llama.cpp: write the results file here (benchmarks/results/decode_cpu.json)")
    args = ap.parse_args()
    if args.device == "cuda" and not args.contenders:
        args.contenders = ",".join(CONTENDERS)
    args.new_tokens = args.new_tokens or (256 if args.contenders else 64)
    return args


def main() -> None:
    args = parse_args()
    if args.contenders:  # one after another on the device (decode_contenders.py)
        run_all(args, " ".join(["python", *sys.argv]))
        return
    path = resolve_gguf_path("smollm2")
    model, g = load_gguf(path)
    tok = tokenizer_from_gguf(g)
    prompt_ids = tok.encode(args.prompt)
    if tok.add_bos and tok.bos_id is not None:
        prompt_ids = [tok.bos_id, *prompt_ids]
    start = time.perf_counter()
    models = {f"ours {p}": for_decoding(model.eval(), p) for p in PRECISIONS}  # int8, bf16, fp32
    pack_s = time.perf_counter() - start
    if args.eager:
        models["eager bf16"] = model.to(torch.bfloat16)
    print(f"SmolLM2-135M-Instruct (Q4_1 GGUF), prompt {args.prompt!r} ({len(prompt_ids)} tokens), {args.new_tokens}")
    print(f"new tokens, greedy; ours = packed dequantized weights in torch {torch.__version__} (packing all three:")
    print(f"{pack_s:.1f} s), peer = llama-cpp-python")
    peer_mb = sum(g.tensor_info(name).n_bytes for name in g.tensor_names()) / 1e6
    sizes = "; ".join(f"{name} {weight_bytes(m) / 1e6:.0f} MB" for name, m in models.items())
    print(f"weights read per token: {sizes}; llama.cpp {peer_mb:.0f} MB (Q4_1 blocks, Q8_0 embedding/head)")
    load_before, tables = os.getloadavg()[0], {}
    for threads in args.threads:
        results = bench(threads, models, str(path), prompt_ids, args.new_tokens, args.repeats)
        tables[threads] = report(threads, results, models, prompt_ids, args.new_tokens, tok)
    if args.out:
        data = {
            "prompt_tokens": len(prompt_ids),
            "new_tokens": args.new_tokens,
            "repeats": args.repeats,
            "tables": tables,
        }
        named = figures(tables)
        row = MEASURED if "t2_int8_tok_s" in named else None  # the README's row needs the 2-thread run
        write_results(args.out, named, data, load_before, **({"measured": row} if row else {}))


if __name__ == "__main__":
    main()
