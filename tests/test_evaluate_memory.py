"""What lets evaluate hold one model at a time (docs/finetuning.md, "Peak memory per stage"):
a loaded GGUF's mapped pages can be dropped, and llama.cpp's parity can be computed from logits
kept after our model is freed, a slice of positions at a time, with the same numbers as before."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from pipeline.evaluate.parity import ROWS, compare, compare_logits, our_logits
from pipeline.gguf.reader import GGUFFile
from pipeline.models.llama import Llama
from pipeline.models.transformer import TransformerConfig, init_weights
from tests.conftest import write_tiny_gguf

CFG = TransformerConfig(vocab_size=256, d_model=64, n_layer=1, n_head=4, n_kv_head=2, d_ff=128, context_length=160)


def mapped_kb(path: Path) -> int:
    """This process's resident kB of `path`'s mappings (/proc/self/smaps)."""
    total, ours = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        fields = line.split()
        if "-" in fields[0] and len(fields) >= 5:  # a mapping's header line: address range, perms, ..., path
            ours = fields[-1] == str(path)
        elif ours and fields[0] == "Rss:":
            total += int(fields[1])
    return total


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/smaps")
def test_release_pages_drops_the_files_resident_pages_and_reads_still_work(tmp_path: Path) -> None:
    path = write_tiny_gguf(tmp_path / "m.gguf", vocab=8192, width=256).resolve()  # an 8 MiB table
    g = GGUFFile(path)
    table = g.tensor("token_embd.weight")
    assert mapped_kb(path) >= 8192  # reading it faulted the whole table in
    g.release_pages()
    assert mapped_kb(path) < 64  # a page or two at most, not the table
    assert np.array_equal(g.tensor("token_embd.weight"), table)  # read back from the page cache


def test_parity_from_kept_logits_gives_the_whole_window_numbers() -> None:
    """evaluate keeps our logits, frees the model, then compares with llama.cpp ROWS positions at a time."""
    model = Llama(CFG)
    init_weights(model, 0.05, 0)
    lengths = (ROWS * 2 + 13, ROWS, 5)  # a window split into three slices, one exactly one slice, one short
    windows = [np.random.default_rng(n).integers(0, 256, n).tolist() for n in lengths]
    noise = torch.Generator().manual_seed(0)
    theirs = [(x + 0.5 * torch.randn(x.shape, generator=noise)).numpy() for x in our_logits(model, windows)]
    whole = compare(model, windows, [torch.from_numpy(s.astype(np.float64)).log_softmax(-1) for s in theirs])
    kept = our_logits(model, windows)
    sliced = compare_logits(kept, theirs)
    assert sliced == whole  # bit for bit: top-1 agreement, mean and max KL, windows, tokens
    assert sliced.tokens == sum(lengths) and sliced.windows == 3 and sliced.mean_kl > 1e-3
    assert kept == []  # each window's logits dropped once compared
