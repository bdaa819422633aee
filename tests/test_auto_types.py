"""`export.dtype=auto:<MB>`: per-matrix types chosen by measured KL within a size budget (`export.auto_types`)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pipeline.config import ModelConfig
from pipeline.errors import ConfigError
from pipeline.export.auto_types import Step, budget_mb, choose, export_auto, ladder, matrices_of, measure
from pipeline.export.naming import file_name
from pipeline.gguf.reader import GGUFFile
from pipeline.init.realize import realize
from pipeline.models.registry import export_gguf, load_gguf
from pipeline.tokenizer.pretokenizers import donor_tokenizer_metadata
from stages._run.typed import typed_config
from stages.compose import compose_config

pytestmark = pytest.mark.usefixtures("one_thread")
TINY = ModelConfig(d_model=64, n_layer=2, n_head=4, n_kv_head=2, d_ff=128, context_length=64)


def test_the_greedy_takes_the_cheapest_kl_per_byte_until_the_budget_fits() -> None:
    """Hand-made ladders: `a` loses little per byte, `b` much; a budget that needs one move moves `a`;
    one that needs both moves both; bytes left after an overshooting move buy back the best upgrade."""
    steps = {
        "a": [Step("Q8_0", 100, 0.0), Step("Q4_0", 50, 0.01)],
        "b": [Step("Q8_0", 100, 0.0), Step("Q5_0", 70, 0.03), Step("Q4_0", 50, 0.5)],
    }
    assert {n: s.qtype for n, s in choose(steps, 200).items()} == {"a": "Q8_0", "b": "Q8_0"}
    assert {n: s.qtype for n, s in choose(steps, 150).items()} == {"a": "Q4_0", "b": "Q8_0"}
    assert {n: s.qtype for n, s in choose(steps, 120).items()} == {"a": "Q4_0", "b": "Q5_0"}
    assert {n: s.qtype for n, s in choose(steps, 100).items()} == {"a": "Q4_0", "b": "Q4_0"}
    overshoot = {
        "a": [Step("Q8_0", 100, 0.0), Step("Q4_0", 50, 0.01)],
        "b": [Step("Q8_0", 100, 0.0), Step("Q4_0", 10, 0.05)],
    }
    # down: a (150 > 140), then b (60); the 80 bytes left buy a back
    assert {n: s.qtype for n, s in choose(overshoot, 140).items()} == {"a": "Q8_0", "b": "Q4_0"}


def test_the_budget_parses_and_bad_ones_name_the_key() -> None:
    assert budget_mb("auto:20") == 20.0 and budget_mb("q4_0") is None
    assert typed_config(compose_config(["export.dtype=auto:12.5"])).export.dtype == "auto:12.5"
    for bad in ("auto:", "auto:-3", "auto:big"):
        with pytest.raises(ConfigError, match="export.dtype.*auto:<MB>"):
            typed_config(compose_config([f"export.dtype={bad}"]))


def test_rows_decide_the_ladder() -> None:
    assert ladder(64) == ["Q8_0", "Q5_0", "Q4_0"]  # not a multiple of 256: no K-quant
    assert set(ladder(256)) >= {"Q8_0", "Q5_0", "Q4_0"}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory, smollm2: GGUFFile):
    model = realize(TINY, "scratch", 49152, 0)
    windows = torch.randint(0, 2000, (2, 32), generator=torch.Generator().manual_seed(0))
    return model, donor_tokenizer_metadata(smollm2), windows, tmp_path_factory.mktemp("auto")


def test_each_matrix_is_measured_alone_and_restored(tiny) -> None:
    """Every 2-D matrix of the file is found in the loaded model; each of its types adds KL >= 0, Q4_0 far
    more than Q8_0 over the model; the model's weights are back as they were after measuring."""
    model, meta, windows, tmp = tiny
    f32 = export_gguf(model, tmp / "f32.gguf", meta, {}, "f32")
    g = GGUFFile(f32)
    fmodel = load_gguf(f32)[0].eval()
    matrices = matrices_of(fmodel, g)
    assert set(matrices) == {n for n in g.tensor_names() if g.tensor(n).ndim == 2}
    before = {n: p.detach().clone() for n, p in matrices.items()}
    steps = measure(fmodel, matrices, windows)
    assert all(torch.equal(before[n], p) for n, p in matrices.items())
    assert all([s.qtype for s in lad] == ["Q8_0", "Q5_0", "Q4_0"] for lad in steps.values())
    assert all(s.kl >= 0 for lad in steps.values() for s in lad)
    assert sum(lad[-1].kl for lad in steps.values()) > 10 * sum(lad[0].kl for lad in steps.values())


def test_the_file_fits_its_budget_and_llama_cpp_reads_it(tiny) -> None:
    """Between the all-Q4_0 and all-Q8_0 sizes the file is at most the budget with a mix of types, each
    tensor stored as chosen; below the smallest possible file, a named error with the size that fits."""
    model, meta, windows, tmp = tiny
    sizes = {t: export_gguf(model, tmp / f"{t}.gguf", meta, {}, t).stat().st_size for t in ("q8_0", "q4_0")}
    budget = (sizes["q8_0"] + sizes["q4_0"]) / 2 / 1e6
    path, metrics = export_auto(model, tmp / "auto.gguf", meta, {}, f"auto:{budget}", windows)
    assert path.stat().st_size <= budget * 1e6
    g = GGUFFile(path)
    types = {g.tensor_info(n).ggml_type for n in g.tensor_names() if g.tensor(n).ndim == 2}
    assert len(types) >= 2 and types <= {"Q8_0", "Q5_0", "Q4_0"}
    assert metrics["auto_q8_0"] + metrics["auto_q5_0"] + metrics["auto_q4_0"] == 15  # 7 per block, token_embd
    assert g.metadata["pipeline.auto.budget_mb"] == pytest.approx(budget) and metrics["auto_kl"] > 0
    llama_cpp = pytest.importorskip("llama_cpp")
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=64, verbose=False, logits_all=True)
    ids = [int(t) for t in windows[0, :16]]
    llm.eval(ids)
    theirs = np.asarray(llm.scores[: llm.n_tokens])
    with torch.no_grad():  # the same file in our reader: llama.cpp computes what we do, type by type
        ours = load_gguf(path)[0].eval()(torch.tensor([ids]))[0].numpy()
    assert (ours.argmax(-1) == theirs.argmax(-1)).all() and np.abs(ours - theirs).max() < 0.02
    with pytest.raises(ConfigError, match=r"config key export.dtype: expected auto:<MB> of at least"):
        export_auto(model, tmp / "small.gguf", meta, {}, f"auto:{sizes['q4_0'] / 2e6}", windows)
    assert not (tmp / "small.gguf").exists()


def test_the_file_name_says_auto_and_its_budget() -> None:
    from pipeline.export.naming import Metadata

    assert file_name(Metadata(name="x", basename="X", size_label="28M"), "auto:20").endswith("-AUTO-20MB.gguf")
