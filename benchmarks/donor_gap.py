"""The donor's worth on any corpus: how much of the from-scratch-to-donor gap the default run closes.

    python benchmarks/donor_gap.py pydoc fortunes=/data/fortunes.txt foldoc=/data/foldoc.txt [--out FILE]

Run from the project root after `make setup`. For each corpus (`pydoc`, the built-in default, or
`name=path`: a text file read with `data=text`, a folder with `data=dir` (every file in it), a
`.jsonl` with `data=jsonl`; `benchmarks/corpora.py` builds fortunes, FOLDOC, git-doc, perl-doc, manpages and django-doc)
it runs two `dvc exp run`s in this workspace, through every real stage:

- default: the default config, nothing else set (`recipe=subclone`)
- scratch: the same student shape trained from random weights (`recipe=from-scratch optim=adamw`)

and prints, per corpus, the student's, the from-scratch model's and the donor's val loss (the donor
on the same windows of `train.seq_len`, measured by the teach stage), the fraction of the gap the
default closes, (scratch - default) / (scratch - donor), and the wall time of each `dvc exp run`
(the default's is the whole chain, pack to report). `-S key=value` adds an override to both runs.
`--scratch-from FILE` (repeatable) takes a corpus's scratch run from an earlier results file of this
script instead of running it again, where that file has one (valid while the student's shape and the
from-scratch recipe are the same as then; the files' names are recorded); `--default-from NAME=FILE`
takes NAME's default run from FILE the same way (while the default config and code are the same).
A run where DVC restores a stage from its run cache, or train resumes from a checkpoint, fails: its time
is not a cold one (a workspace whose `checkpoints/` holds any run is refused before the first).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from harness import read_metrics, refuse_warm_checkpoints, timed_exp_run, write_results

from stages._malloc import malloc_env

RUNS: dict[str, tuple[str, ...]] = {"default": (), "scratch": ("recipe=from-scratch", "optim=adamw")}


def data_overrides(spec: str) -> tuple[str, list[str]]:
    """A corpus argument as (name, overrides): `pydoc`, or `name=path` read by the source its kind needs."""
    if spec == "pydoc":
        return "pydoc", []
    name, _, path = spec.partition("=")
    file = Path(path).resolve()
    if not name or not file.exists():
        sys.exit(f"corpus {spec!r}: expected pydoc or name=path to an existing file or folder; fix the path")
    if file.is_dir():  # every file of the folder, one document each
        return name, ["data=dir", f"data.path={file}", "data.glob=**/*"]
    group = "jsonl" if file.name.endswith((".jsonl", ".jsonl.gz")) else "text"
    return name, [f"data={group}", f"data.path={file}"]


def run(name: str, overrides: list[str]) -> dict[str, float]:
    """One `dvc exp run`; its metrics read back from the workspace it leaves, and each stage's wall time."""
    wall, stages = timed_exp_run(["--force", "-n", name], overrides)  # every stage runs: a cold run
    ev, tr, teach, pack = (read_metrics(s) for s in ("evaluate", "train", "teach", "pack"))
    return {
        "val_loss": ev["val_loss"],
        "donor_val_loss": ev.get("donor_val_loss", float("nan")),
        "train_tokens": pack.get("tokens_train", float("nan")),
        "cached_positions": teach.get("cached_positions", 0.0),
        "teach_seconds": teach.get("seconds", 0.0),
        "train_seconds": tr["seconds"],
        "wall_seconds": wall,
        **{f"stage_{stage}_s": seconds for stage, seconds in stages.items()},
    }


def closed(r: dict[str, dict[str, float]]) -> float:
    scratch, donor = r["scratch"]["val_loss"], r["default"]["donor_val_loss"]
    return (scratch - r["default"]["val_loss"]) / (scratch - donor)


def table(results: dict[str, dict[str, dict[str, float]]]) -> str:
    lines = [
        "| corpus | train tokens | default val | scratch val | donor val | gap closed | default run s "
        "| scratch run s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for corpus, r in results.items():
        d, s = r["default"], r["scratch"]
        lines.append(
            f"| {corpus} | {d['train_tokens']:,.0f} | {d['val_loss']:.4f} | {s['val_loss']:.4f} "
            f"| {d['donor_val_loss']:.4f} | **{closed(r):.0%}** | {d['wall_seconds']:.0f} | {s['wall_seconds']:.0f} |"
        )
    return "\n".join(lines)


def figures(results: dict[str, dict[str, dict[str, float]]]) -> dict[str, str]:
    """The named figures docs/donor.md quotes, per corpus: the default's, the scratch run's and the donor's
    val loss, the share of the gap closed and the default run's wall time."""
    out = {}
    for corpus, r in results.items():
        share = closed(r)
        out[f"{corpus}_default_val"] = f"{r['default']['val_loss']:.4f}"
        out[f"{corpus}_scratch_val"] = f"{r['scratch']['val_loss']:.4f}"
        out[f"{corpus}_donor_val"] = f"{r['default']['donor_val_loss']:.4f}"
        out[f"{corpus}_gap"] = f"{share:.1%}" if share < 1 else f"{share:.0%}"
        out[f"{corpus}_run_s"] = f"{r['default']['wall_seconds']:.0f} s"
        for key, value in r["default"].items():
            if key.startswith("stage_"):
                out[f"{corpus}_{key}"] = f"{value:.0f} s"
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("corpora", nargs="+", help="pydoc, or name=path (a text file, a folder, a .jsonl)")
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    parser.add_argument("-S", dest="extra", action="append", default=[], help="one more override for every run")
    parser.add_argument(
        "--scratch-from", type=Path, action="append", default=[], help="reuse a results file's scratch runs"
    )
    parser.add_argument(
        "--default-from", action="append", default=[], help="NAME=FILE: reuse that file's default run of NAME"
    )
    args = parser.parse_args()
    refuse_warm_checkpoints()
    earlier = {c: r for f in args.scratch_from for c, r in json.loads(f.read_text())["data"]["results"].items()}
    defaults = {
        name: json.loads(Path(f).read_text())["data"]["results"][name]["default"]
        for name, f in (spec.split("=", 1) for spec in args.default_from)
    }
    load_before = os.getloadavg()[0]
    results: dict[str, dict[str, dict[str, float]]] = {}
    for spec in args.corpora:
        corpus, data = data_overrides(spec)
        results[corpus] = {}
        for kind, overrides in RUNS.items():
            if kind == "default" and corpus in defaults:
                results[corpus][kind] = defaults[corpus]
            elif kind == "scratch" and corpus in earlier:
                results[corpus][kind] = earlier[corpus][kind]
            else:
                results[corpus][kind] = run(f"gap-{corpus}-{kind}", [*data, *overrides, *args.extra])
        r = results[corpus]
        print(
            f"{corpus}: default {r['default']['val_loss']:.4f}, scratch {r['scratch']['val_loss']:.4f}, "
            f"donor {r['default']['donor_val_loss']:.4f}: {closed(r):.0%} closed",
            flush=True,
        )
    print(table(results))
    if args.out:
        reused = {"scratch_from": [str(f) for f in args.scratch_from], "default_from": args.default_from}
        data = {"extra": args.extra, **reused, "results": results}
        write_results(args.out, figures(results), data, load_before, child_env=malloc_env())  # train's allocator


if __name__ == "__main__":
    main()
