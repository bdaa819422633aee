"""A subclone of the real SmolLM2 (the default recipe's model family: 6 query heads over 2 kv heads,
head size 64, the donor's RoPE base) exported as an f32 GGUF runs in llama.cpp and transformers as
it runs here."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from pipeline.donor.calibrate import calibrate
from pipeline.gguf.reader import GGUFFile
from pipeline.inference.sampling import generate_ids
from pipeline.init.subclone import fit_gain, subclone
from pipeline.models.llama import Llama
from pipeline.models.llama_gguf import export_llama, load_llama
from pipeline.tokenizer.gguf_tokenizer import tokenizer_from_gguf
from pipeline.tokenizer.pretokenizers import donor_tokenizer_metadata

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "smollm2_reference.json"


@pytest.fixture(scope="module")
def texts() -> list[list[int]]:
    return [t["tokens"] for t in json.loads(FIXTURE.read_text())["texts"].values()]


@pytest.fixture(scope="module")
def student(smollm2: GGUFFile, texts: list[list[int]], tmp_path_factory) -> tuple[Llama, Path]:
    """384 wide, 3 layers, d_ff 512: calibrated on the reference texts, head gain fitted, exported f32."""
    donor, _ = load_llama(smollm2)
    ids = torch.tensor([t[:48] for t in texts if len(t) >= 48])
    calib = calibrate(donor, ids, bf16=False)
    cfg = replace(donor.cfg, d_model=384, n_head=6, n_kv_head=2, n_layer=3, d_ff=512)
    model, _ = subclone(donor, calib, cfg, "importance")
    fit_gain(model, ids, iters=3)
    out = tmp_path_factory.mktemp("subclone") / "subclone-f32.gguf"
    meta = donor_tokenizer_metadata(smollm2)
    return model.eval(), export_llama(model, out, meta, {"general.name": "subclone"}, "f32")


@torch.no_grad()
def logprobs(model, ids: list[int]) -> torch.Tensor:
    out = model(torch.tensor([ids]))
    logits = out if isinstance(out, torch.Tensor) else out.logits
    return logits[0].float().log_softmax(-1)


def test_the_export_reads_back_exactly(student, texts) -> None:
    model, path = student
    back, _ = load_llama(path)
    assert (back.cfg.n_head, back.cfg.n_kv_head, back.cfg.n_layer) == (6, 2, 3)
    assert torch.equal(logprobs(back, texts[0]), logprobs(model, texts[0]))


def test_transformers_runs_the_subclone_export(student, texts, monkeypatch: pytest.MonkeyPatch) -> None:
    transformers = pytest.importorskip("transformers")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    model, path = student
    hf = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    worst = max(float((logprobs(hf.eval(), ids) - logprobs(model, ids)).abs().max()) for ids in texts)
    print(f"max |d log-prob| vs transformers: {worst:.1e}")
    assert worst <= 1e-3


def test_llamacpp_runs_the_subclone_export(student, smollm2: GGUFFile) -> None:
    llama_cpp = pytest.importorskip("llama_cpp")
    model, path = student
    llm = llama_cpp.Llama(model_path=str(path), verbose=False, n_ctx=256, n_threads=1, n_threads_batch=1)
    ids = tokenizer_from_gguf(smollm2).encode("def add(a, b):\n    return")
    theirs = []
    for t in llm.generate(ids, top_k=1, temp=0.0, repeat_penalty=1.0, reset=True):
        theirs.append(t)
        if len(theirs) == 12:
            break
    assert generate_ids(model, ids, 12, temperature=0.0) == theirs
    llm.reset()
    llm.eval(ids)
    last = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(llm.n_vocab(),))
    delta = float((logprobs(model, ids)[-1] - torch.from_numpy(last.copy()).log_softmax(-1)).abs().max())
    print(f"max |d log-prob| at the prompt end vs llama.cpp: {delta:.1e}")
    assert delta < 0.05  # llama.cpp keeps K/V in f16
