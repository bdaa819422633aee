"""Pack throughput and memory on the compressed and columnar formats: our streaming pack of a JSONL.gz and
of a parquet file vs a plain `tokenizers` encode_batch loop reading the same file, side by side.

    python benchmarks/pack_formats.py [--size-mb 1024] [--dir /tmp/pack_formats] [--repeats 1]

Generates the synthetic documents of `benchmarks/pack_throughput.py` (CPython's pydoc topics repeated,
each copy headed by a counter) until their UTF-8 text passes `--size-mb` MiB (uncompressed text; the
files are smaller: gzip level 6, parquet with pyarrow's default snappy, 8192 rows a row group), writes
them as `corpus.jsonl.gz` ({"text": ...} per line) and `corpus.parquet` (column `text`), then per format
runs, each in its own subprocess and alternating pack / plain:
- pack: `pipeline.data.text.pack` over `iter_documents` (data.source=jsonl or parquet), writing
  train/val.bin with the split, fingerprint and counts;
- plain: a single-process loop reading the same file (gzip + json.loads per line; ParquetFile.iter_batches)
  that calls the tokenizer's `encode_batch` on 1000 documents at a time and counts the ids.
Each child reports its own wall time and peak RSS (getrusage(RUSAGE_SELF).ru_maxrss).
"""

from __future__ import annotations

import argparse
import gzip
import json
import statistics
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from pack_throughput import fmt, run_child, tps  # the sibling benchmark's helpers (it imports harness)

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
cfg = DataConfig(source=sys.argv[1], path=sys.argv[2])
t = time.perf_counter()
meta, m = pack(iter_documents(cfg), tok, cfg, Path(sys.argv[3]), progress=False)
wall = time.perf_counter() - t
print(json.dumps({"tokens": m["tokens"], "documents": m["documents"], "seconds": wall, "rss_mb": peak_rss_mb()}))
"""

PLAIN = r"""
import gzip, json, resource, sys, time
import pyarrow.parquet as pq
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
def texts():
    if sys.argv[1] == "jsonl":
        with gzip.open(sys.argv[2], "rt", encoding="utf-8") as f:
            for line in f:
                yield json.loads(line)["text"]
    else:
        for b in pq.ParquetFile(sys.argv[2]).iter_batches(batch_size=1024, columns=["text"]):
            yield from b.column(0).to_pylist()
batch = []
for text in texts():
    batch.append(text)
    if len(batch) == 1000:
        encode(batch); batch = []
encode(batch)
wall = time.perf_counter() - t
rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
print(json.dumps({"tokens": tokens, "documents": documents, "seconds": wall, "rss_mb": rss}))
"""

ROW_GROUP = 8192


def documents(size_mb: int):
    """The synthetic documents of `pack_throughput.make_corpus`, until `size_mb` MiB of UTF-8 text."""
    from pydoc_data.topics import topics

    texts = [topics[k].strip("\n") for k in sorted(topics)]
    target, written, n = size_mb << 20, 0, 0
    while written < target:
        for text in texts:
            doc = f"copy {n}\n{text}"
            yield doc
            written += len(doc.encode("utf-8"))
            n += 1
            if written >= target:
                return


def make_files(work: Path, size_mb: int) -> dict[str, Path]:
    """The same documents as a gzipped JSONL file and a parquet file (streamed out, flat memory)."""
    jsonl, parquet = work / "corpus.jsonl.gz", work / "corpus.parquet"
    schema = pa.schema([("text", pa.string())])
    with gzip.open(jsonl, "wt", encoding="utf-8") as j, pq.ParquetWriter(parquet, schema) as w:
        group: list[str] = []
        for doc in documents(size_mb):
            j.write(json.dumps({"text": doc}) + "\n")
            group.append(doc)
            if len(group) == ROW_GROUP:
                w.write_table(pa.table({"text": group}, schema=schema))
                group = []
        if group:
            w.write_table(pa.table({"text": group}, schema=schema))
    return {"jsonl": jsonl, "parquet": parquet}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-mb", type=int, default=1024)
    ap.add_argument("--dir", type=Path, default=Path("/tmp/pack_formats"))
    ap.add_argument("--repeats", type=int, default=1, help="pack/plain pairs per format (medians reported)")
    args = ap.parse_args()
    args.dir.mkdir(parents=True, exist_ok=True)
    files = make_files(args.dir, args.size_mb)
    rows = []
    for kind, path in files.items():
        print(
            f"{kind}: {path} ({path.stat().st_size / 2**20:,.0f} MiB on disk, {args.size_mb} MiB of text)", flush=True
        )
        runs: dict[str, list[dict]] = {"pack": [], "plain": []}
        for _ in range(args.repeats):
            runs["pack"].append(run_child(PACK, kind, str(path), str(args.dir / f"packed-{kind}")))
            print(f"  pack : {fmt(runs['pack'][-1])}", flush=True)
            runs["plain"].append(run_child(PLAIN, kind, str(path)))
            print(f"  plain: {fmt(runs['plain'][-1])}", flush=True)
            assert runs["plain"][-1]["documents"] == runs["pack"][-1]["documents"], "both read the same documents"
        row = {"format": kind, "file_mb": path.stat().st_size / 2**20, **runs}
        row["ratio"] = statistics.median(tps(p) for p in runs["pack"]) / statistics.median(
            tps(p) for p in runs["plain"]
        )
        print(f"  pack/plain tokens/s ratio (medians) {row['ratio']:.3f}", flush=True)
        rows.append(row)
    print(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
