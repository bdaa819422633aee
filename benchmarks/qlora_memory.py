"""QLoRA vs LoRA on SmolLM2-135M: peak RSS and training tokens/s, one subprocess per variant.

Both variants train the same rank-r adapters on the same instruction rows (the pydoc Q/A set,
response-only loss) for the same steps from the same seed, in fp32; only the frozen base differs:
both keep the GGUF's Q4_1 blocks, `lora` also holds each matrix dequantized in the matmul dtype (as
the train loop prepares it: fp32 here), `qlora` dequantizes per matmul. Each variant runs in its own
process so peak RSS (ru_maxrss) is its own.

    python benchmarks/qlora_memory.py                # 2 x 4 steps per variant, batch 2 x 256, rank 8 on q,v
    python benchmarks/qlora_memory.py --batch-size 1 --targets q,k,v,o,gate,up,down
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import tempfile
import time
from pathlib import Path

from harness import child_json
from harness import peak_rss_mib as peak_rss_mb
from harness import rss_mib as rss_mb


def child(args: argparse.Namespace) -> dict:
    """One variant: load base, attach adapters, train `steps` steps on the packed rows; figures as a dict."""
    import torch

    from pipeline.config import LoraConfig
    from pipeline.data.packed import load_rows
    from pipeline.donor.locate import resolve_gguf_path
    from pipeline.finetune.lora import attach_lora, trainable_summary
    from pipeline.finetune.model import load_base, prepare_training
    from pipeline.training.batches import RowSampler

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    rss_start = rss_mb()
    t0 = time.perf_counter()
    model, g = load_base(resolve_gguf_path("smollm2"), args.variant)
    load_s = time.perf_counter() - t0
    del g  # the GGUF reader (parsed tokenizer arrays, mmap) is not needed for training
    gc.collect()
    rss_loaded = rss_mb()
    attach_lora(model, LoraConfig(rank=args.rank, alpha=2.0 * args.rank, targets=tuple(args.targets.split(","))))
    prepare_training(model, args.variant, torch.float32)  # as the train loop does at precision=fp32
    model_mb = sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers())) / 2**20
    sampler = RowSampler(load_rows(args.data), args.batch_size, seed=0)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    model.train()
    losses, times = [], []
    for _ in range(args.steps):
        x, y, seg = sampler()
        t = time.perf_counter()
        loss = model.loss(x, y, seg)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t)
        losses.append(loss.item())
    timed = times[1:] if len(times) > 1 else times  # the first step pays one-time initialisation
    tokens = args.batch_size * args.seq_len
    return {
        "variant": args.variant,
        "load_s": load_s,
        "rss_start_mb": rss_start,
        "rss_after_load_mb": rss_loaded,
        "model_mb": model_mb,
        "peak_rss_mb": peak_rss_mb(),
        "step_s": timed,
        "tokens_per_step": tokens,
        "losses": losses,
        **trainable_summary(model),
    }


def run_variant(variant: str, args: argparse.Namespace, data: Path) -> dict:
    cmd = [
        sys.executable,
        __file__,
        "--child",
        variant,
        "--data",
        str(data),
        *("--steps", str(args.steps), "--batch-size", str(args.batch_size), "--seq-len", str(args.seq_len)),
        *("--rank", str(args.rank), "--targets", args.targets, "--threads", str(args.threads)),
    ]
    return child_json(cmd)


def merge_runs(runs: list[dict]) -> dict:
    """One variant's repeats: largest peak RSS, tokens/s from the median and the best timed step."""
    steps = sorted(s for r in runs for s in r["step_s"])
    median = steps[len(steps) // 2]
    out = {**runs[0], "peak_rss_mb": max(r["peak_rss_mb"] for r in runs)}
    out.update(s_per_step=median, tokens_per_s=runs[0]["tokens_per_step"] / median)
    out["tokens_per_s_best"] = runs[0]["tokens_per_step"] / steps[0]
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--targets", default="q,v")
    # one intra-op thread: on a shared 2-core box, 2 threads make every op wait for a descheduled peer
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=2, help="runs per variant, alternating")
    p.add_argument("--child", choices=["lora", "qlora"])
    p.add_argument("--data")
    args = p.parse_args()
    if args.child:
        args.variant = args.child
        print(json.dumps(child(args)))
        return
    from pipeline.config import DataConfig
    from pipeline.data.instruct import build_instruct, read_instruct_jsonl
    from pipeline.data.packed import save_rows
    from pipeline.data.pydoc_qa import write_pydoc_instruct
    from pipeline.donor.locate import resolve_gguf_path
    from pipeline.gguf.reader import GGUFFile
    from pipeline.tokenizer.gguf_tokenizer import tokenizer_from_gguf

    with tempfile.TemporaryDirectory() as tmp:
        # rows are built once here and packed like the train stage's (segment-masked attention)
        write_pydoc_instruct(tmp)
        g = GGUFFile(resolve_gguf_path("smollm2"))
        cfg = DataConfig(max_seq_len=args.seq_len)
        packed = build_instruct(read_instruct_jsonl(Path(tmp) / "train.jsonl"), tokenizer_from_gguf(g), g.metadata, cfg)
        data = save_rows(packed, Path(tmp) / "train.npz")
        del g
        # alternate the variants so a burst of load from other processes hits both alike
        runs = [(v, run_variant(v, args, data)) for _ in range(args.repeats) for v in ("lora", "qlora")]
    results = {v: merge_runs([r for name, r in runs if name == v]) for v in ("lora", "qlora")}
    lora, qlora = results["lora"], results["qlora"]
    print(
        f"SmolLM2-135M-Instruct (Q4_1 GGUF), {args.repeats} x {args.steps} steps of {args.batch_size}x{args.seq_len} "
        f"tokens per variant, rank {args.rank} on {args.targets}, {args.threads} threads"
    )
    print(f"{'':>24}{'lora':>12}{'qlora':>12}{'qlora/lora':>12}")
    for key, fmt in (
        ("load_s", "{:.1f}"),
        ("model_mb", "{:.0f}"),
        ("rss_start_mb", "{:.0f}"),
        ("rss_after_load_mb", "{:.0f}"),
        ("peak_rss_mb", "{:.0f}"),
        ("tokens_per_s", "{:.0f}"),
        ("tokens_per_s_best", "{:.0f}"),
        ("s_per_step", "{:.2f}"),
    ):
        a, b = lora[key], qlora[key]
        print(f"{key:>24}{fmt.format(a):>12}{fmt.format(b):>12}{b / a:>12.2f}")
    print(f"{'trainable params':>24}{lora['trainable_params']:>12}{qlora['trainable_params']:>12}")
    diffs = [abs(a - b) for a, b in zip(lora["losses"], qlora["losses"])]
    print(f"losses lora  {[round(x, 4) for x in lora['losses']]}")
    print(f"losses qlora {[round(x, 4) for x in qlora['losses']]}  (max |diff| {max(diffs):.2e})")


if __name__ == "__main__":
    main()
