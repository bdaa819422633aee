"""A student as its donor's draft model: acceptance and greedy speedup, in llama.cpp and in our decode.

    python benchmarks/draft_speed.py [--draft models/export/model.gguf] [--donor smollm2] [--prompts 6]
        [--prompt-tokens 32] [--new-tokens 64] [--k 4] [--threads 2] [--out FILE]

Run from the project root after `dvc repro` (it reads the packed val split for prompts). Each prompt
is `--prompt-tokens` tokens of the val split (spread evenly over it). Each engine decodes each prompt
greedily for `--new-tokens` tokens twice, the donor alone and the donor with the draft proposing
`--k` tokens per donor forward, interleaved prompt by prompt (the machine is shared):

- llama.cpp (llama-cpp-python, when installed): its `draft_model=` hook, fed by a greedy draft that
  runs the student GGUF in its own `Llama` (its KV cache kept across calls, trimmed to the common
  prefix). Drafted = tokens proposed within the generated length; accepted = those the donor's
  output kept. llama.cpp verifies a batch of k+1 positions where plain decoding runs one, so a
  near-tie can flip: the table counts the prompts whose text differs from the donor alone's and the
  first position where it does.
- ours (`pipeline.inference.speculative.speculative_greedy`, `generate draft=` runs it): both models
  packed for `--precision` (fp32 by default: exact against plain greedy).

Speedup = the donor alone's wall time over the pair's, summed over the prompts (prefill included).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pipeline.data.packed import load_split  # noqa: E402
from pipeline.donor.locate import resolve_gguf_path  # noqa: E402
from pipeline.inference.decode import for_decoding  # noqa: E402
from pipeline.inference.generate import load_for_generation  # noqa: E402
from pipeline.inference.sampling import generate_ids  # noqa: E402
from pipeline.inference.speculative import speculative_greedy  # noqa: E402


def val_prompts(packed: Path, n: int, length: int) -> list[list[int]]:
    """`n` prompts of `length` tokens, evenly spread over the val split."""
    val = load_split(packed, "val")
    starts = np.linspace(0, len(val) - length - 1, n).astype(int)
    return [[int(t) for t in val[s : s + length]] for s in starts]


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The first position where two continuations differ, None when they are the same."""
    n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return None if n == len(a) == len(b) else n


class _Totals:
    """What one engine's pairs add up to over the prompts."""

    def __init__(self) -> None:
        self.alone_s = self.pair_s = 0.0
        self.drafted = self.accepted = self.tokens = 0
        self.differ: list[int] = []  # first differing position of each prompt whose text differs

    def record(self, alone: list[int], pair: list[int], alone_s: float, pair_s: float) -> None:
        self.alone_s, self.pair_s, self.tokens = self.alone_s + alone_s, self.pair_s + pair_s, self.tokens + len(alone)
        at = first_difference(alone, pair)
        if at is not None:
            self.differ.append(at)

    def summary(self) -> dict[str, float | list[int]]:
        return {
            "acceptance": self.accepted / max(self.drafted, 1),
            "drafted": self.drafted,
            "donor_alone_tok_s": self.tokens / self.alone_s,
            "with_draft_tok_s": self.tokens / self.pair_s,
            "speedup": self.alone_s / self.pair_s,
            "prompts_differing": len(self.differ),
            "first_differing_positions": self.differ,
        }


def ours(args: argparse.Namespace, prompts: list[list[int]]) -> dict[str, float | list[int]]:
    target = for_decoding(load_for_generation(args.donor)[0], args.precision)
    draft = for_decoding(load_for_generation(str(args.draft))[0], args.precision)
    totals = _Totals()
    generate_ids(target, prompts[0], 4)  # warm-up: first-call allocations out of the timings
    speculative_greedy(target, draft, prompts[0], 4, args.k)
    for ids in prompts:
        t0 = time.perf_counter()
        alone = generate_ids(target, ids, args.new_tokens)
        t1 = time.perf_counter()
        spec = speculative_greedy(target, draft, ids, args.new_tokens, args.k)
        totals.record(alone, spec.ids, t1 - t0, time.perf_counter() - t1)
        totals.drafted, totals.accepted = totals.drafted + spec.drafted, totals.accepted + spec.accepted
    return totals.summary()


class GreedyDraft:
    """llama-cpp-python's draft hook: `k` greedy tokens of a student `Llama` after the given ids,
    reusing the student's KV cache for the prefix it shares with the last call. Each call's
    proposal is kept (`calls`) so acceptance can be counted against the output afterwards."""

    def __init__(self, llm, k: int) -> None:
        self.llm, self.k = llm, k
        self.calls: list[tuple[int, list[int]]] = []  # (position of the first drafted token, proposal)

    def __call__(self, input_ids: np.ndarray, **_: object) -> np.ndarray:
        llm, ids = self.llm, [int(t) for t in input_ids]
        held = [int(t) for t in llm.input_ids[: llm.n_tokens]]
        keep = min(first_difference(held, ids) or len(held), len(ids) - 1)  # at least one id to evaluate
        llm.n_tokens = keep
        llm._ctx.kv_cache_seq_rm(-1, keep, -1)
        llm.eval(ids[keep:])
        out: list[int] = []
        for _ in range(self.k):  # without logits_all, llama.cpp keeps the last position's logits only
            out.append(int(np.argmax(np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(llm.n_vocab(),)))))
            if len(out) < self.k:
                llm.eval(out[-1:])
        self.calls.append((len(ids), out))
        return np.array(out, dtype=np.intc)

    def count(self, prompt_len: int, output: list[int]) -> tuple[int, int]:
        """(drafted, accepted) over this prompt's calls, drafts past the output's end not counted."""
        drafted = accepted = 0
        for at, proposal in self.calls:
            run = True
            for i, tok in enumerate(proposal):
                p = at + i - prompt_len
                if p >= len(output):
                    break
                drafted += 1
                run = run and output[p] == tok
                accepted += run
        self.calls.clear()
        return drafted, accepted


def llamacpp(args: argparse.Namespace, prompts: list[list[int]]) -> dict[str, float | list[int]] | None:
    try:
        from llama_cpp import Llama
    except ImportError:
        print("llama.cpp: llama-cpp-python is not installed (make llamacpp); skipped")
        return None
    common = {"n_ctx": 512, "n_threads": args.threads, "n_threads_batch": args.threads, "verbose": False}
    donor = str(resolve_gguf_path(args.donor))
    alone = Llama(model_path=donor, **common)
    draft = GreedyDraft(Llama(model_path=str(args.draft), **common), args.k)
    paired = Llama(model_path=donor, draft_model=draft, **common)
    totals = _Totals()

    def run(llm: Llama, ids: list[int]) -> tuple[list[int], float]:
        t0, out = time.perf_counter(), []
        for tok in llm.generate(ids, temp=0.0, top_k=1, reset=True):
            out.append(int(tok))
            if len(out) == args.new_tokens:
                break
        return out, time.perf_counter() - t0

    run(alone, prompts[0]), run(paired, prompts[0])  # warm-up
    draft.calls.clear()
    for ids in prompts:
        a, a_s = run(alone, ids)
        p, p_s = run(paired, ids)
        totals.record(a, p, a_s, p_s)
        d, acc = draft.count(len(ids), p)
        totals.drafted, totals.accepted = totals.drafted + d, totals.accepted + acc
    return totals.summary()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--draft", type=Path, default=ROOT / "models/export/model.gguf")
    ap.add_argument("--donor", default="smollm2")
    ap.add_argument("--packed", type=Path, default=ROOT / "data/packed")
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--precision", default="fp32", choices=("fp32", "bf16", "int8"))
    ap.add_argument("--engines", default="llamacpp,ours")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    if not args.draft.is_file():
        sys.exit(f"--draft {args.draft}: expected a GGUF file, found none; run dvc repro first or name one")
    torch.set_num_threads(args.threads)
    prompts = val_prompts(args.packed, args.prompts, args.prompt_tokens)
    engines = {"llamacpp": llamacpp, "ours": ours}
    result = {"draft": str(args.draft), "donor": args.donor, "k": args.k, "threads": args.threads}
    result.update(prompts=len(prompts), prompt_tokens=args.prompt_tokens, new_tokens=args.new_tokens)
    for name in args.engines.split(","):
        r = engines[name](args, prompts)
        if r is None:
            continue
        result[name] = r
        print(
            f"{name:9s} acceptance {r['acceptance']:.1%} of {r['drafted']} drafted; donor alone "
            f"{r['donor_alone_tok_s']:.1f} tok/s, with draft {r['with_draft_tok_s']:.1f} tok/s: {r['speedup']:.2f}x; "
            f"{r['prompts_differing']} of {len(prompts)} texts differ (first at {r['first_differing_positions']})"
        )
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
