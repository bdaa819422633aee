"""A student as its donor's draft model: acceptance and greedy speedup, in llama.cpp and in our decode.

    python benchmarks/draft_speed.py [--draft models/export/model.gguf] [--donor smollm2] [--prompts 6]
        [--prompt-tokens 32] [--new-tokens 64] [--k 2,4] [--p-min 0.2] [--threads 2] [--draft-precision int8]
        [--precisions fp32,int8] [--alone int4]
        [--out benchmarks/results/draft_speed.json]

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
- ours (`pipeline.inference.speculative.speculative_greedy`, `generate draft=` runs it): the donor
  packed for each of `--precisions` (fp32: exact against plain greedy; int8, the default decode: the
  donor's check of k+1 positions rounds differently from one-position steps), the draft for
  `--draft-precision` (int8 by default: the draft's rounding changes its proposals, not the output);
  and the donor alone in each of `--alone` (int4 by default; a paired precision's donor-alone runs,
  interleaved with its pairs, are its baseline).

A speed-up names its baseline: each pairing is set against its own donor alone (the wall times
summed over the prompts, prefill included, for each draft length in `--k`), against our fastest
single-model decode of the donor (`ours_best_alone`) and against llama.cpp's donor alone; `--out`
writes every figure by name (`figures`), with the conditions (`benchmarks/harness.py`).

Each engine also times its parts (median of single calls): the donor's one-position step t1, its
(k+1)-position check tv and the draft's step td. They bound what any draft can give on this machine:
`ceiling` = (k+1)·t1 / (k·td + tv), the speedup if every drafted token were accepted; `predicted`
puts the measured drafts and tokens per check in place of k and k+1 (a check of d drafts costing t1
+ d·(tv - t1)/k).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import numpy as np
import torch
from harness import ROOT, write_results  # first: this checkout's library on sys.path

from pipeline.data.packed import load_split
from pipeline.donor.locate import resolve_gguf_path
from pipeline.inference.decode import for_decoding
from pipeline.inference.generate import load_for_generation
from pipeline.inference.sampling import generate_ids
from pipeline.inference.speculative import speculative_greedy


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
        self.checks = 0  # donor forwards that checked drafts
        self.differ: list[int] = []  # first differing position of each prompt whose text differs

    def record(self, alone: list[int], pair: list[int], alone_s: float, pair_s: float) -> None:
        self.alone_s, self.pair_s, self.tokens = self.alone_s + alone_s, self.pair_s + pair_s, self.tokens + len(alone)
        at = first_difference(alone, pair)
        if at is not None:
            self.differ.append(at)

    def count(self, drafted: int, accepted: int, checks: int) -> None:
        self.drafted += drafted
        self.accepted += accepted
        self.checks += checks

    def summary(self) -> dict[str, float | list[int]]:
        return {
            "tokens_per_check": self.tokens / max(self.checks, 1),
            "acceptance": self.accepted / max(self.drafted, 1),
            "drafted": self.drafted,
            "donor_alone_tok_s": self.tokens / self.alone_s,
            "with_draft_tok_s": self.tokens / self.pair_s,
            "speedup": self.alone_s / self.pair_s,
            "prompts_differing": len(self.differ),
            "first_differing_positions": self.differ,
        }


def ceiling(k: int, t1: float, tv: float, td: float, drafted: float | None = None, kept: float | None = None) -> float:
    """The speedup drafts of per-token cost `td` give a donor whose step costs `t1` and whose check of
    k+1 positions costs `tv` (linear in between): `drafted` tokens a check, `kept` tokens out of each
    check (by default k and k+1: every draft full and accepted)."""
    drafted = k if drafted is None else drafted
    check = t1 + drafted * (tv - t1) / k
    return (drafted + 1 if kept is None else kept) * t1 / (drafted * td + check)


def median_ms(step: Callable[[], object], undo: Callable[[], object], reps: int = 15) -> float:
    """The median wall time of `step` in milliseconds, `undo` run (untimed) after each."""
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
        undo()
    return float(np.median(times) * 1e3)


def with_costs(runs: dict[int, _Totals], cost: Callable[[str, int], float]) -> dict[str, object]:
    """Each draft length's summary with the bound its measured parts set (see the module docstring)."""
    t1, td = cost("donor", 1), cost("draft", 1)
    out: dict[str, object] = {"donor_step_ms": t1, "draft_step_ms": td}
    for k, totals in runs.items():
        tv, r = cost("donor", k + 1), totals.summary()
        drafted = r["drafted"] / max(totals.checks, 1)
        predicted = ceiling(k, t1, tv, td, drafted, r["tokens_per_check"])
        r.update(check_ms=tv, drafted_per_check=drafted, ceiling=ceiling(k, t1, tv, td), predicted=predicted)
        out[f"k{k}"] = r
    return out


def ours(args: argparse.Namespace, prompts: list[list[int]]) -> dict[str, object]:
    """Our speculative decode with the donor in each of `--precisions` (fp32: exact; int8: the default decode,
    whose donor-alone runs are the baseline a user would otherwise run), and the donor alone in each of
    `--alone` (int4: near-exact for the Q4_1 donor)."""
    draft = for_decoding(load_for_generation(str(args.draft))[0], args.draft_precision)
    out: dict[str, object] = {}
    for precision in args.precisions:
        target = for_decoding(load_for_generation(args.donor)[0], precision)
        out[precision] = paired(args, prompts, target, draft)
    for precision in args.alone:
        target = for_decoding(load_for_generation(args.donor)[0], precision)
        out[f"{precision}_alone"] = alone_rate(prompts, args.new_tokens, partial(generate_ids, target))
    return out


def alone_rate(prompts: list[list[int]], new_tokens: int, decode: Callable[[list[int], int], list[int]]) -> dict:
    """A single model's greedy decode over the prompts (prefill included), after one warm-up call."""
    decode(prompts[0], 4)
    t0, tokens = time.perf_counter(), 0
    for ids in prompts:
        tokens += len(decode(ids, new_tokens))
    return {"tok_s": tokens / (time.perf_counter() - t0), "tokens": tokens}


def paired(args: argparse.Namespace, prompts: list[list[int]], target, draft) -> dict[str, object]:
    """`target` alone and with `draft`, interleaved prompt by prompt, for each draft length."""
    generate_ids(target, prompts[0], 4)  # warm-up: first-call allocations out of the timings
    runs = {k: _Totals() for k in args.k}
    for k, totals in runs.items():
        speculative_greedy(target, draft, prompts[0], 4, k)
        for ids in prompts:
            t0 = time.perf_counter()
            alone = generate_ids(target, ids, args.new_tokens)
            t1 = time.perf_counter()
            spec = speculative_greedy(target, draft, ids, args.new_tokens, k, p_min=args.p_min)
            totals.record(alone, spec.ids, t1 - t0, time.perf_counter() - t1)
            totals.count(spec.drafted, spec.accepted, spec.target_calls)

    @torch.inference_mode()
    def cost(which: str, n: int) -> float:
        model = target if which == "donor" else draft
        cache = model.new_cache()
        model(torch.tensor([prompts[0]]), cache)
        step = torch.tensor([prompts[1][:n]])
        return median_ms(lambda: model(step, cache)[0].argmax(-1), lambda: cache.truncate(len(prompts[0])))

    return with_costs(runs, cost)


class GreedyDraft:
    """llama-cpp-python's draft hook: `k` greedy tokens of a student `Llama` after the given ids,
    reusing the student's KV cache for the prefix it shares with the last call. Each call's
    proposal is kept (`calls`) so acceptance can be counted against the output afterwards."""

    def __init__(self, llm, k: int, p_min: float = 0.0) -> None:
        self.llm, self.k, self.p_min = llm, k, p_min
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
            logits = np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(llm.n_vocab(),))
            top = int(np.argmax(logits))
            if self.p_min > 0 and 1.0 / np.exp(logits - logits[top]).sum() < self.p_min:
                break  # llama-server's --draft-p-min: only confident drafts are sent
            out.append(top)
            if len(out) < self.k:
                llm.eval(out[-1:])
        self.calls.append((len(ids), out))
        return np.array(out, dtype=np.intc)

    def count(self, prompt_len: int, output: list[int]) -> tuple[int, int, int]:
        """(drafted, accepted, checks) over this prompt's calls, drafts past the output's end not counted."""
        drafted = accepted = checks = 0
        for at, proposal in self.calls:
            run, checks = True, checks + (at - prompt_len < len(output))
            for i, tok in enumerate(proposal):
                p = at + i - prompt_len
                if p >= len(output):
                    break
                drafted += 1
                run = run and output[p] == tok
                accepted += run
        self.calls.clear()
        return drafted, accepted, checks


def llamacpp(args: argparse.Namespace, prompts: list[list[int]]) -> dict[str, object] | None:
    try:
        from llama_cpp import Llama
    except ImportError:
        print("llama.cpp: llama-cpp-python is not installed (make llamacpp); skipped")
        return None
    common = {"n_ctx": 512, "n_threads": args.threads, "n_threads_batch": args.threads, "verbose": False}
    donor = str(resolve_gguf_path(args.donor))
    alone, student = Llama(model_path=donor, **common), Llama(model_path=str(args.draft), **common)
    runs = {k: _Totals() for k in args.k}

    def run(llm: Llama, ids: list[int]) -> tuple[list[int], float]:
        t0, out = time.perf_counter(), []
        for tok in llm.generate(ids, temp=0.0, top_k=1, reset=True):
            out.append(int(tok))
            if len(out) == args.new_tokens:
                break
        return out, time.perf_counter() - t0

    for k, totals in runs.items():
        draft = GreedyDraft(student, k, args.p_min)
        paired = Llama(model_path=donor, draft_model=draft, **common)
        run(alone, prompts[0]), run(paired, prompts[0])  # warm-up
        draft.calls.clear()
        for ids in prompts:
            a, a_s = run(alone, ids)
            p, p_s = run(paired, ids)
            totals.record(a, p, a_s, p_s)
            totals.count(*draft.count(len(ids), p))
        del paired

    checker = Llama(model_path=donor, logits_all=True, **common)  # as the paired donor runs (all logits)

    def cost(which: str, n: int) -> float:
        llm = checker if which == "donor" else student
        llm.reset()
        llm.eval(prompts[0])
        held = llm.n_tokens

        def undo() -> None:
            llm.n_tokens = held
            llm._ctx.kv_cache_seq_rm(-1, held, -1)

        return median_ms(lambda: llm.eval(prompts[1][:n]), undo)

    return with_costs(runs, cost)


def report_line(k: int, r: dict, prompts: int) -> str:
    """One draft length's figures, as the table in docs/tools.md gives them."""
    return (
        f"  k={k}: accepted {r['acceptance']:.1%} of {r['drafted']} drafted, "
        f"{r['tokens_per_check']:.2f} tokens a check ({r['check_ms']:.1f} ms); "
        f"donor alone {r['donor_alone_tok_s']:.1f} tok/s, with draft "
        f"{r['with_draft_tok_s']:.1f}: {r['speedup']:.2f}x (predicted {r['predicted']:.2f}x, ceiling "
        f"{r['ceiling']:.2f}x at 100%); {r['prompts_differing']} of {prompts} texts differ "
        f"(first at {r['first_differing_positions']})"
    )


MEASURED = {  # the README's Measured row (benchmarks/results_table.py): every speed-up beside its baselines
    "topic": "draft model",
    "order": 7,
    "headline": "`preset=draft`, k=2, the exact pairing (fp32 donor): {ours_fp32_k2}, {ours_fp32_k2_vs_own_alone} its "
    "donor alone, {ours_fp32_k2_vs_ours_best_alone} our fastest single-model decode ({ours_best_alone}), "
    "{ours_fp32_k2_vs_llamacpp_alone} llama.cpp's donor alone ({llamacpp_alone}); the int8 pairing "
    "{ours_int8_k2_vs_own_alone} its donor alone; in llama.cpp {llamacpp_k2_vs_llamacpp_alone}",
    "table": "docs/tools.md#a-student-as-the-donors-draft",
}


def pairings(result: dict) -> dict[str, dict]:
    """Each measured pairing (llama.cpp's, ours per donor precision) by name: its per-k figures."""
    out = {"llamacpp": result["llamacpp"]} if "llamacpp" in result else {}
    out.update({f"ours_{p}": r for p, r in result.get("ours", {}).items() if not p.endswith("_alone")})
    return out


def baselines(result: dict) -> dict[str, float]:
    """The single-model decodes a user would otherwise run, tok/s: the donor alone in llama.cpp and in each
    of our precisions (from the `--alone` runs, else from the paired runs' interleaved donor-alone timings)."""
    out = {f"{name}_alone": r["k" + str(result["k"][0])]["donor_alone_tok_s"] for name, r in pairings(result).items()}
    for p, r in result.get("ours", {}).items():  # a paired precision keeps its interleaved timing
        if p.endswith("_alone"):
            out.setdefault(f"ours_{p}", r["tok_s"])
    ours = {n: v for n, v in out.items() if n.startswith("ours_")}
    if ours:
        out["ours_best_alone"] = max(ours.values())
        result["ours_best_alone"] = max(ours, key=ours.get)
    return out


def figures(result: dict) -> dict[str, str]:
    """The named figures the docs quote: each pairing's tok/s, acceptance and speed-up over every baseline
    (its own donor alone, our fastest single-model decode, llama.cpp's donor alone), and the baselines."""
    base = baselines(result)
    out = {name: f"{tok_s:.1f} tok/s" for name, tok_s in base.items()}
    if "ours_best_alone" in result:
        out["ours_best_alone_precision"] = result["ours_best_alone"].removeprefix("ours_").removesuffix("_alone")
    for name, r in pairings(result).items():
        for k in result["k"]:
            row = r[f"k{k}"]
            out[f"{name}_k{k}"] = f"{row['with_draft_tok_s']:.1f} tok/s"
            out[f"{name}_k{k}_accepted"] = f"{row['acceptance']:.1%}"
            out[f"{name}_k{k}_vs_own_alone"] = f"{row['speedup']:.2f}x"
            for b in ("ours_best_alone", "llamacpp_alone"):
                if b in base:
                    out[f"{name}_k{k}_vs_{b}"] = f"{row['with_draft_tok_s'] / base[b]:.2f}x"
    return out


def main() -> None:
    load_before = os.getloadavg()[0]
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--draft", type=Path, default=ROOT / "models/export/model.gguf")
    ap.add_argument("--donor", default="smollm2")
    ap.add_argument("--packed", type=Path, default=ROOT / "data/packed")
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--k", type=lambda v: [int(x) for x in v.split(",")], default=[2, 4], help="draft lengths: 2,4")
    ap.add_argument("--p-min", type=float, default=0.2, help="the draft stops below this probability (0: never)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--precisions", default="fp32,int8", help="ours: the donor's precisions paired with the draft")
    ap.add_argument("--alone", default="int4", help="ours: more of the donor's precisions timed alone (baselines)")
    ap.add_argument("--draft-precision", default="int8", choices=("fp32", "bf16", "int8"), help="ours: the draft's")
    ap.add_argument("--engines", default="llamacpp,ours")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    args.precisions, args.alone = args.precisions.split(","), [p for p in args.alone.split(",") if p]
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
    for name, r in pairings(result).items():
        print(f"{name}: donor step {r['donor_step_ms']:.1f} ms, draft step {r['draft_step_ms']:.2f} ms")
        for k in args.k:
            print(report_line(k, r[f"k{k}"], len(prompts)))
    named = figures(result)
    print("\n".join(f"{name}: {value}" for name, value in named.items()))
    if args.out:
        row = MEASURED if all(f in named for f in ("ours_fp32_k2", "ours_int8_k2", "llamacpp_k2")) else None
        write_results(args.out, named, result, load_before, **({"measured": row} if row else {}))


if __name__ == "__main__":
    main()
