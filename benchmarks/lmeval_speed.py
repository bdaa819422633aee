"""lm-eval on the SmolLM2 GGUF: our `smollm-gguf` model vs lm-eval's own `hf` model (transformers,
loading the same GGUF with `gguf_file=`), side by side on the same local multiple-choice tasks.

    python benchmarks/lmeval_speed.py [--docs 48] [--batch-size 16] [--threads 1] [--repeats 3]

Two offline tasks written to a temp folder: `easy_mc` (8 one-line common-sense questions, two
choices) and `arith_mc` (`--docs` sums of small numbers, four numeric choices). Both models are
loaded once, then lm-eval's real evaluator runs each task on each, interleaved, `--repeats` times;
the median docs/s is reported, with the load (1-min load average) beside it because the machine is
shared. Agreement: accuracy of each, how many docs pick the same choice, and the largest difference
between the two models' log-likelihood of one choice (both dequantize Q4_1 to fp32). Results, with the
conditions (`harness.write_results`), go to `--out` (benchmarks/results/lmeval_speed.json). Run it on a
quiet machine: the load average is recorded beside every run.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import lm_eval
import torch
from harness import RESULTS, write_results  # first: this checkout's library on sys.path
from lm_eval.api.registry import get_model
from lm_eval.tasks import TaskManager

from pipeline.donor.locate import resolve_gguf_path
from pipeline.evaluate.lmeval import MODEL_NAME, model_class

EASY = [
    ("The capital of France is", ["Paris", "a banana"], 0),
    ("One, two, three, four,", ["five", "purple"], 0),
    ("Water is", ["wet", "made of iron wires"], 0),
    ("The opposite of hot is", ["dry spaghetti", "cold"], 1),
    ("Monday, Tuesday,", ["Wednesday", "elephant"], 0),
    ("A dog is an", ["animal", "equation"], 0),
    ("The sky is", ["blue", "a sandwich"], 0),
    ("Ice is frozen", ["kettle", "water"], 1),
]
OUT = RESULTS / "lmeval_speed.json"


def arithmetic(n: int, seed: int = 0) -> list[tuple[str, list[str], int]]:
    rng = random.Random(seed)
    docs = []
    for _ in range(n):
        a, b = rng.randint(1, 20), rng.randint(1, 20)
        wrong = rng.sample([x for x in range(2, 41) if x != a + b], 3)
        choices = [str(x) for x in [a + b, *wrong]]
        rng.shuffle(choices)
        docs.append((f"Question: What is {a} plus {b}?\nAnswer:", choices, choices.index(str(a + b))))
    return docs


def write_task(folder: Path, name: str, docs: list[tuple[str, list[str], int]]) -> None:
    data = folder / f"{name}.jsonl"
    data.write_text("".join(json.dumps({"question": q, "choices": c, "answer": a}) + "\n" for q, c, a in docs))
    (folder / f"{name}.yaml").write_text(
        f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\n"
        f"  cache_dir: {folder / 'hf-cache'}\ntest_split: test\noutput_type: multiple_choice\n"
        'doc_to_text: "{{question}}"\ndoc_to_choice: "{{choices}}"\ndoc_to_target: "{{answer}}"\n'
        "metric_list:\n  - metric: acc\n    aggregation: mean\n    higher_is_better: true\n"
    )


def evaluate(lm: Any, task: str, manager: TaskManager) -> tuple[float, float, list[list[float]]]:
    """(seconds, acc, per-doc choice log-likelihoods) of one run of lm-eval's evaluator."""
    start = time.perf_counter()
    out = lm_eval.simple_evaluate(model=lm, tasks=[task], task_manager=manager, log_samples=True)
    seconds = time.perf_counter() - start
    samples = sorted(out["samples"][task], key=lambda s: s["doc_id"])
    return seconds, out["results"][task]["acc,none"], [[float(r[0][0]) for r in s["resps"]] for s in samples]


def load(args: argparse.Namespace) -> dict[str, tuple[Any, float]]:
    gguf = resolve_gguf_path("smollm2")
    models = {}
    start = time.perf_counter()
    models[MODEL_NAME] = model_class()(path="smollm2", batch_size=args.batch_size, device="cpu")
    models[MODEL_NAME] = (models[MODEL_NAME], time.perf_counter() - start)
    start = time.perf_counter()
    hf_args = {"pretrained": str(gguf.parent), "gguf_file": gguf.name, "dtype": "float32"}
    hf = get_model("hf")(**hf_args, batch_size=args.batch_size, device="cpu")
    models["hf (transformers)"] = (hf, time.perf_counter() - start)
    return models


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--docs", type=int, default=48)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=OUT, help="the results file")
    args = parser.parse_args()
    load_before = os.getloadavg()[0]
    torch.set_num_threads(args.threads)
    folder = Path(tempfile.mkdtemp(prefix="lmeval-speed-"))
    tasks = {"easy_mc": EASY, "arith_mc": arithmetic(args.docs)}
    for name, docs in tasks.items():
        write_task(folder, name, docs)
    manager = TaskManager(include_path=str(folder), include_defaults=False)
    models = load(args)
    runs: dict[str, dict[str, list]] = {t: {m: [] for m in models} for t in tasks}
    for _ in range(args.repeats):
        for task in tasks:
            for name, (lm, _) in models.items():
                runs[task][name].append((*evaluate(lm, task, manager), os.getloadavg()[0]))
    result = report(args, tasks, models, runs)
    write_results(args.out, figures(result, tasks, models), result, load_before, measured=MEASURED)


MEASURED = {  # the README's Measured row (benchmarks/results_table.py)
    "topic": "lm-eval",
    "order": 10,
    "headline": "{arith_mc_ratio} lm-eval's `hf` model on arith_mc",
    "table": "docs/evaluation.md#lm-eval-speed-smollm-gguf-vs-lm-evals-hf-model",
}


def figures(result: dict[str, Any], tasks: dict, models: dict) -> dict[str, str]:
    """The named figures docs/evaluation.md quotes: per task docs/s, ratio, agreement; each model's load time."""
    ours, peer = list(models)
    out = {"ours_load_s": f"{result['load_seconds'][ours]:.2f} s", "hf_load_s": f"{result['load_seconds'][peer]:.2f} s"}
    for task in tasks:
        row = result[task]
        out[f"{task}_ours_docs_s"] = f"{row[ours]['docs_per_s']:.2f}"
        out[f"{task}_hf_docs_s"] = f"{row[peer]['docs_per_s']:.2f}"
        out[f"{task}_ratio"] = f"{row['speed_ratio']:.2f}x"
        out[f"{task}_max_dloglik"] = f"{row['max_abs_loglik_diff']:.1e}".replace("e-0", "e-")
        out[f"{task}_acc"] = f"{row[ours]['acc']:.3f}"
    return out


def report(args: argparse.Namespace, tasks: dict, models: dict, runs: dict) -> dict[str, Any]:
    result: dict[str, Any] = {
        "args": {k: str(v) for k, v in vars(args).items()},
        "load_seconds": {m: round(s, 2) for m, (_, s) in models.items()},
    }
    ours, peer = list(models)
    print(f"\n{args.threads} thread(s), batch {args.batch_size}; load s: {result['load_seconds']}")
    for task, docs in tasks.items():
        row: dict[str, Any] = {"docs": len(docs)}
        for name in models:
            secs = [s for s, _, _, _ in runs[task][name]]
            row[name] = {
                "docs_per_s": round(len(docs) / statistics.median(secs), 2),
                "acc": runs[task][name][0][1],
                "loadavg": [round(x[3], 2) for x in runs[task][name]],
            }
        a, b = runs[task][ours][0][2], runs[task][peer][0][2]
        row["max_abs_loglik_diff"] = max(abs(x - y) for da, db in zip(a, b) for x, y in zip(da, db))
        row["same_choice"] = sum(
            max(range(len(x)), key=x.__getitem__) == max(range(len(y)), key=y.__getitem__) for x, y in zip(a, b)
        )
        row["speed_ratio"] = round(row[ours]["docs_per_s"] / row[peer]["docs_per_s"], 2)
        result[task] = row
        print(
            f"{task} ({len(docs)} docs): {ours} {row[ours]['docs_per_s']} docs/s acc {row[ours]['acc']:.3f} | "
            f"{peer} {row[peer]['docs_per_s']} docs/s acc {row[peer]['acc']:.3f} | ratio {row['speed_ratio']}x | "
            f"same choice {row['same_choice']}/{len(docs)}, max |d loglik| {row['max_abs_loglik_diff']:.2e}"
        )
    return result


if __name__ == "__main__":
    main()
