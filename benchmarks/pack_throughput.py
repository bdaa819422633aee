"""Pack throughput and memory: our streaming pack vs a plain `tokenizers` encode_batch loop, side by side.

    python benchmarks/pack_throughput.py [--size-mb 2048] [--small-mb 200] [--dir /tmp/pack_bench]
                                         [--plain-at-full/--no-plain-at-full] [--keep]

Generates a synthetic text corpus (CPython's pydoc topics repeated, each copy headed by a counter so
no two documents are equal; documents separated by `---` lines, the `data=text` format) of
`--small-mb` and `--size-mb`, then for each size runs, each in its own subprocess:
- pack: `pipeline.data.text.pack` over `iter_documents` (data.source=text), writing train/val.bin;
- plain: a single-process loop that reads the same documents, calls the tokenizer's `encode_batch`
  on 1000 at a time and counts the ids (no writing, no split, no fingerprint).
Each child reports its own peak RSS (getrusage(RUSAGE_SELF).ru_maxrss) and wall time; the parent
also checks RUSAGE_CHILDREN. Prints tokens/s, the pack/plain ratio and both RSS figures per size.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import textwrap
from pathlib import Path

from harness import child_json, peak_rss_mib, write_results

PACK = """
import json, sys, time
from pathlib import Path
from pipeline.config import DataConfig
from pipeline.data.corpus import iter_documents
from pipeline.data.text import pack, peak_rss_mb
from pipeline.gguf.reader import GGUFFile
from pipeline.donor.locate import resolve_gguf_path
from pipeline.tokenizer.gguf_tokenizer import tokenizer_from_gguf
tok = tokenizer_from_gguf(GGUFFile(resolve_gguf_path("smollm2")))
cfg = DataConfig(source="text", path=sys.argv[1])
t = time.perf_counter()
meta, m = pack(iter_documents(cfg), tok, cfg, Path(sys.argv[2]), progress=False)
wall = time.perf_counter() - t
print(json.dumps({"tokens": m["tokens"], "documents": m["documents"], "seconds": wall, "rss_mb": peak_rss_mb()}))
"""

PLAIN = r"""
import json, resource, sys, time
from pipeline.gguf.reader import GGUFFile
from pipeline.donor.locate import resolve_gguf_path
from pipeline.tokenizer.gguf_tokenizer import tokenizer_from_gguf
rust = tokenizer_from_gguf(GGUFFile(resolve_gguf_path("smollm2")))._tok  # the same tokenizers.Tokenizer
t = time.perf_counter()
tokens = documents = 0
def encode(texts):
    global tokens, documents
    tokens += sum(len(e.ids) for e in rust.encode_batch(texts, add_special_tokens=False))
    documents += len(texts)
batch, current = [], []
with open(sys.argv[1], encoding="utf-8") as f:
    for line in f:
        if line.strip() == "---":
            batch.append("".join(current).strip("\n")); current = []
            if len(batch) == 1000:
                encode(batch); batch = []
        else:
            current.append(line)
batch.append("".join(current).strip("\n"))
encode(batch)
wall = time.perf_counter() - t
rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
print(json.dumps({"tokens": tokens, "documents": documents, "seconds": wall, "rss_mb": rss}))
"""


def make_corpus(path: Path, size_mb: int) -> int:
    """A `---`-separated text corpus of about `size_mb` MiB from the pydoc topics; returns its documents."""
    from pydoc_data.topics import topics

    texts = [topics[k].strip("\n") for k in sorted(topics)]
    target, written, n = size_mb << 20, 0, 0
    with path.open("w", encoding="utf-8") as f:
        while written < target:
            for text in texts:
                chunk = f"{'---' + chr(10) if n else ''}copy {n}\n{text}\n"
                f.write(chunk)
                written += len(chunk.encode("utf-8"))
                n += 1
                if written >= target:
                    break
    return n


def run_child(code: str, *args: str) -> dict:
    """`code` in a fresh interpreter at the project root; the JSON line it prints last."""
    return child_json([sys.executable, "-c", textwrap.dedent(code), *args])


def measure(work: Path, size_mb: int, plain: bool) -> dict:
    corpus = work / f"corpus-{size_mb}mb.txt"
    docs = make_corpus(corpus, size_mb)
    print(f"{size_mb} MiB corpus: {docs} documents -> {corpus}", flush=True)
    row: dict = {"size_mb": size_mb, "documents": docs}
    row["pack"] = run_child(PACK, str(corpus), str(work / f"packed-{size_mb}"))
    print(f"  pack : {fmt(row['pack'])}", flush=True)
    if plain:
        row["plain"] = run_child(PLAIN, str(corpus))
        print(f"  plain: {fmt(row['plain'])}", flush=True)
        assert row["plain"]["documents"] == row["pack"]["documents"], "both read the same documents"
        row["ratio"] = tps(row["pack"]) / tps(row["plain"])
        print(f"  pack/plain tokens/s ratio {row['ratio']:.3f}", flush=True)
    shutil.rmtree(work / f"packed-{size_mb}", ignore_errors=True)
    corpus.unlink()
    return row


def tps(r: dict) -> float:
    return r["tokens"] / r["seconds"]


def fmt(r: dict) -> str:
    return f"{r['tokens']:,.0f} tokens in {r['seconds']:.1f} s = {tps(r):,.0f} tok/s, peak RSS {r['rss_mb']:.0f} MB"


MEASURED = {  # the README's Measured row (benchmarks/results_table.py)
    "topic": "pack",
    "order": 9,
    "headline": "2 GiB of text; {t2gib_pack_tok_s} tok/s at {t2gib_pack_rss} peak RSS",
    "table": "docs/data.md#pack-throughput",
}


def figures(rows: list[dict]) -> dict[str, str]:
    """The named figures docs/data.md quotes, per corpus size (`t200mib`, `t2gib`): pack's and the plain
    loop's tokens/s and peak RSS, and their ratio."""
    out = {}
    for row in rows:
        size = row["size_mb"]
        key = f"t{size // 1024}gib" if size % 1024 == 0 else f"t{size}mib"
        for side in ("pack", "plain"):
            if side in row:
                out[f"{key}_{side}_tok_s"] = f"{tps(row[side]) / 1000:.0f}k"
                out[f"{key}_{side}_rss"] = f"{row[side]['rss_mb']:.0f} MB"
        if "ratio" in row:
            out[f"{key}_ratio"] = f"{row['ratio']:.2f}"
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-mb", type=int, default=2048)
    ap.add_argument("--small-mb", type=int, default=200)
    ap.add_argument("--dir", type=Path, default=Path("/tmp/pack_bench"))
    ap.add_argument("--plain-at-full", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--out", type=Path, help="the results file (benchmarks/results/pack_throughput.json)")
    args = ap.parse_args()
    load_before = os.getloadavg()[0]
    args.dir.mkdir(parents=True, exist_ok=True)
    rows = [measure(args.dir, args.small_mb, plain=True)]
    if args.size_mb > args.small_mb:
        rows.append(measure(args.dir, args.size_mb, plain=args.plain_at_full))
    children = peak_rss_mib(children=True)
    print(f"largest child peak RSS (RUSAGE_CHILDREN): {children:.0f} MB")
    print(json.dumps(rows, indent=1))
    if args.out:
        named = figures(rows)
        row = MEASURED if "t2gib_pack_tok_s" in named else None  # the README's row needs the 2 GiB run
        write_results(args.out, named, rows, load_before, **({"measured": row} if row else {}))


if __name__ == "__main__":
    main()
