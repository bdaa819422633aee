"""GPT-2: the module (causal, seeded, cached), training, and its GGUF, which reads back exactly
through our loader and gives our numbers in transformers and llama.cpp; the stage chain end to end."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from pipeline.config import ModelConfig, OptimConfig, TrainConfig
from pipeline.data.instruct import example_arrays, pack_examples
from pipeline.data.packed import Packed
from pipeline.errors import ConfigError, GGUFError
from pipeline.gguf.reader import GGUFFile
from pipeline.init.realize import realize
from pipeline.models.gpt2 import GPT2
from pipeline.models.registry import export_gguf, load_gguf
from pipeline.models.transformer import KVCache
from pipeline.tokenizer.pretokenizers import donor_tokenizer_metadata
from pipeline.training.loop import TrainJob, train
from tests.helpers import transformers_overrides
from tests.scratch import TINY_VAL_FRACTION

ROOT = Path(__file__).resolve().parent.parent
VOCAB = 49152
TINY = ModelConfig(arch="gpt2", d_model=32, n_layer=2, n_head=4, n_kv_head=4, d_ff=128, context_length=64)


def ids(n: int = 24, seed: int = 0, batch: int = 2) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, n), generator=torch.Generator().manual_seed(seed))


def perturbed(mcfg: ModelConfig = TINY, seed: int = 5) -> GPT2:
    """A model whose every parameter (biases, LayerNorms, positions) is away from its init value."""
    m = realize(mcfg, "scratch", VOCAB, seed)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    return m.eval()


@pytest.fixture(scope="module")
def tok_meta(smollm2: GGUFFile) -> dict:
    return donor_tokenizer_metadata(smollm2)


def test_shapes_and_causality() -> None:
    m = perturbed()
    x = ids()
    with torch.no_grad():
        logits = m(x)
        assert logits.shape == (2, 24, VOCAB) and m.hidden(x).shape == (2, 24, 32)
        y = x.clone()
        y[:, 10] = (y[:, 10] + 1) % VOCAB
        changed = m(y)
    torch.testing.assert_close(changed[:, :10], logits[:, :10], rtol=0, atol=0)
    assert (changed[:, 10:] - logits[:, 10:]).abs().amax() > 1e-3
    with pytest.raises(ValueError, match="context_length"):
        m(ids(65, batch=1))


def test_init_is_seeded_with_zero_biases_and_unit_norms() -> None:
    a, b, c = (realize(TINY, "scratch", VOCAB, s) for s in (1, 1, 2))
    assert isinstance(a, GPT2) and a.cfg.arch == "gpt2" and a.lens is None
    for (name, pa), pb in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(pa, pb), name
    assert not torch.equal(a.tok_embd.weight, c.tok_embd.weight)
    for name, p in a.state_dict().items():
        if name.endswith("bias"):
            assert not p.any(), name
        elif "norm" in name:
            assert torch.equal(p, torch.ones_like(p)), name
        else:
            std = 0.02 / 2 if name.endswith(("attn.proj.weight", "ffn.down.weight")) else 0.02  # 1/sqrt(2*n_layer)
            assert abs(float(p.std()) - std) < 2e-3, name


def test_kv_cache_matches_full_forward() -> None:
    m = perturbed()
    x = ids(20, seed=3)
    with torch.no_grad():
        full = m(x)
        cache = KVCache(m.cfg.n_layer)
        parts = [m(x[:, :7], cache), m(x[:, 7:12], cache)] + [m(x[:, t : t + 1], cache) for t in range(12, 20)]
    assert cache.length == 20
    torch.testing.assert_close(torch.cat(parts, dim=1), full, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("tied", [True, False])
def test_f32_export_reads_back_exactly(tmp_path: Path, tok_meta: dict, tied: bool) -> None:
    m = perturbed(replace(TINY, tie_embeddings=tied))
    path = export_gguf(m, tmp_path / "m.gguf", tok_meta, {"general.name": "t"}, "f32")
    back, g = load_gguf(path)
    assert isinstance(back, GPT2) and back.cfg == m.cfg
    assert g.architecture == "gpt2" and g.has_tensor("output.weight") is not tied
    assert g.metadata["gpt2.attention.layer_norm_epsilon"] == pytest.approx(1e-5)
    with torch.no_grad():
        assert torch.equal(back(ids()), m(ids()))


def test_f16_export_reads_back_close(tmp_path: Path, tok_meta: dict) -> None:
    m = perturbed()
    back, g = load_gguf(export_gguf(m, tmp_path / "m.gguf", tok_meta, {}, "f16"))
    assert g.tensor_info("blk.0.attn_qkv.weight").ggml_type == "F16"
    assert g.tensor_info("blk.0.attn_qkv.bias").ggml_type == "F32"
    with torch.no_grad():
        torch.testing.assert_close(back(ids()), m(ids()), atol=2e-3, rtol=0)


def test_pca_and_lens_inits_work_and_the_lens_is_folded_at_export(tmp_path: Path, tok_meta: dict) -> None:
    from pipeline.donor.pca import pca

    table = np.random.default_rng(0).standard_normal((VOCAB, 48)).astype(np.float32)  # a stand-in donor
    lens = pca(table, 48)
    p = realize(TINY, "pca", VOCAB, 0, lens)
    q = realize(TINY, "lens", VOCAB, 0, lens, table)
    assert q.cfg.donor_dim == 48 and q.lens is not None and q.tok_embd.weight.shape == (VOCAB, 48)
    scale = 0.02 / lens.projected[:, :32].std()
    np.testing.assert_allclose(p.tok_embd.weight.detach().numpy(), lens.projected[:, :32] * scale, rtol=1e-5)
    with torch.no_grad():
        torch.testing.assert_close(q(ids()), p(ids()), atol=1e-4, rtol=1e-4)
        back, _ = load_gguf(export_gguf(q, tmp_path / "q.gguf", tok_meta, {}, "f32"))
        assert back.lens is None and back.cfg.donor_dim == 0
        torch.testing.assert_close(back(ids()), q(ids()), atol=1e-5, rtol=1e-5)


def test_config_rejects_grouped_query_attention_for_gpt2() -> None:
    with pytest.raises(ConfigError, match="model.n_kv_head"):
        replace(TINY, n_kv_head=2)
    replace(TINY, n_head=2, n_kv_head=2, d_model=30)  # odd head size: no RoPE here


def test_loader_names_a_foreign_tensor(tmp_path: Path, tok_meta: dict) -> None:
    from pipeline.gguf.writer import write_gguf
    from pipeline.models.gpt2_gguf import gpt2_metadata, gpt2_tensors

    m = perturbed()
    tensors = gpt2_tensors(m)
    tensors["output.bias"] = np.zeros(VOCAB, dtype=np.float32)
    path = write_gguf(tmp_path / "x.gguf", "gpt2", {**gpt2_metadata(m.cfg, "f32"), **tok_meta}, tensors)
    with pytest.raises(GGUFError, match="output.bias"):
        load_gguf(path)


@pytest.mark.parametrize(
    "sizes",
    [
        {"context_length": 1024, "d_ff": 128, "tie_embeddings": True},  # GPT-2 sizes: no overrides needed
        {"context_length": 64, "d_ff": 96, "tie_embeddings": False},  # needs n_positions / n_inner
    ],
    ids=["gpt2-sizes", "overrides"],
)
def test_transformers_loads_the_export(tmp_path: Path, tok_meta: dict, sizes: dict) -> None:
    os.environ["HF_HUB_OFFLINE"] = "1"
    from transformers import AutoModelForCausalLM

    m = perturbed(replace(TINY, **sizes))
    export_gguf(m, tmp_path / "m.gguf", tok_meta, {}, "f32")
    kwargs = transformers_overrides(m.cfg)
    assert (kwargs == {}) is (sizes["context_length"] == 1024)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="m.gguf", dtype=torch.float32, **kwargs).eval()
    assert type(hf).__name__ == "GPT2LMHeadModel" and hf.config.tie_word_embeddings is sizes["tie_embeddings"]
    x = ids(32, seed=7)
    with torch.no_grad():
        theirs = torch.log_softmax(hf(x).logits.float(), -1)
        ours = torch.log_softmax(m(x).float(), -1)
    diff = float((theirs - ours).abs().max())
    assert diff < 1e-3, f"max |log-prob difference| {diff}"


def repeated_corpus(n_distinct: int = 40, repeats: int = 60, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.tile(rng.choice(VOCAB, n_distinct, replace=False), repeats).astype(np.uint16)


@pytest.fixture(scope="module")
def trained():
    """Tiny GPT-2 trained on a repeated 40-token pattern: predictions with clear margins."""
    data = repeated_corpus()
    model = realize(TINY, "scratch", VOCAB, 0)
    tcfg = TrainConfig(steps=40, batch_size=8, seq_len=32, eval_every=40, log_every=1, precision="fp32", device="cpu")
    result = train(
        model, data[:2000], data[2000:], TrainJob(tcfg, OptimConfig(lr=1e-2, warmup_steps=5), 0, progress=False)
    )
    return model.eval(), result, data


def test_training_reduces_loss(trained) -> None:
    _, result, _ = trained
    first = result.history[0]["train_loss"]
    assert first > 9.0  # about ln(49152) = 10.8 at init
    assert result.final_train_loss < first - 5.0 and result.final_val_loss < 3.0


def test_trains_on_packed_instruction_rows() -> None:
    """gpt2 with data=instruct: response-only loss over packed rows, segment-masked, through the one loop."""
    rng = np.random.default_rng(0)
    examples = []
    for _ in range(12):  # a fixed prompt -> response mapping the model can learn
        prompt = rng.choice(VOCAB, 5, replace=False).tolist()
        examples.append(example_arrays(prompt, [prompt[0], prompt[1], prompt[0]]))
    x, y, seg = pack_examples(examples, 32, pad_id=0)
    rows = Packed(x, y, seg)
    model = realize(TINY, "scratch", VOCAB, 0)
    tcfg = TrainConfig(steps=30, batch_size=2, eval_every=30, log_every=1, precision="fp32", device="cpu")
    result = train(model, rows, rows, TrainJob(tcfg, OptimConfig(lr=1e-2, warmup_steps=2), 0, progress=False))
    assert result.initial_val_loss > 9.0 and result.final_val_loss < result.initial_val_loss - 3.0
    assert any("epoch_train_ppl" in h for h in result.history)


def test_llama_cpp_greedy_continuation_matches_ours(tmp_path: Path, tok_meta: dict, trained) -> None:
    llama_cpp = pytest.importorskip("llama_cpp")
    from pipeline.inference.sampling import generate_ids

    model, _, data = trained
    path = export_gguf(model, tmp_path / "m.gguf", tok_meta, {}, "f32")
    prompt = [int(t) for t in data[5:11]]
    ours = generate_ids(model, prompt, 12)
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=model.cfg.context_length, logits_all=True, verbose=False)
    llm.eval(prompt)
    their_logits = torch.tensor(np.array(llm.scores[: len(prompt)]))
    theirs = []
    for _ in range(12):
        theirs.append(int(np.argmax(llm.scores[llm.n_tokens - 1])))
        llm.eval([theirs[-1]])
    with torch.no_grad():
        our_logits = model(torch.tensor([prompt]))[0]
    diff = float((their_logits - our_logits).abs().max())
    assert theirs == ours, f"llama.cpp {theirs} vs ours {ours} (prompt logits max |diff| {diff})"
    assert ours == [int(t) for t in data[11:23]]  # it learned the pattern, so the match is meaningful
    assert diff < 1e-2


def sh(cwd: Path, *args: str) -> str:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{' '.join(args)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


def test_gpt2_tiny_config_composes_and_needs_no_transformers_overrides() -> None:
    from omegaconf import OmegaConf

    from pipeline.config import PipelineConfig
    from stages._run.typed import typed_config
    from stages.compose import compose_config
    from tests.helpers import llama_config

    composed = compose_config(["model=gpt2-tiny"])
    as_dict = OmegaConf.to_container(composed, resolve=True)
    assert as_dict == OmegaConf.to_container(OmegaConf.merge(OmegaConf.structured(PipelineConfig), as_dict))
    mcfg = typed_config(composed).model
    assert mcfg.arch == "gpt2" and mcfg.n_kv_head == mcfg.n_head
    assert transformers_overrides(llama_config(mcfg, VOCAB)) == {}


@pytest.mark.slow
def test_stage_chain_trains_exports_and_evaluates_gpt2(tmp_path: Path) -> None:
    """pack -> realize -> train -> export -> evaluate with model=gpt2-tiny (shrunk), as subprocesses.

    The donor stage is left out: recipe=from-scratch does not read it (test_e2e runs it).
    """
    for name in ("conf", "stages", "pipeline"):
        shutil.copytree(ROOT / name, tmp_path / name, ignore=shutil.ignore_patterns("__pycache__"))
    overrides = [
        "model=gpt2-tiny",
        "recipe=from-scratch",
        "train=smoke",
        "train.device=cpu",
        "tracking.enabled=false",
        "evaluate.max_new_tokens=8",
        f"data.val_fraction={TINY_VAL_FRACTION}",  # 630 val tokens, not 7191: each val pass is 49152-way logits
        *("model.d_model=32", "model.n_layer=2", "model.n_head=2", "model.n_kv_head=2", "model.d_ff=128"),
    ]
    for stage in ("pack", "realize", "train", "export", "evaluate"):
        sh(tmp_path, sys.executable, "-m", f"stages.{stage}", *overrides)
    config = json.loads((tmp_path / "models" / "init" / "config.json").read_text())
    assert config["arch"] == "gpt2" and config["d_model"] == 32
    g = GGUFFile(tmp_path / "models" / "export" / "model.gguf")
    assert g.architecture == "gpt2" and g.metadata["gpt2.block_count"] == 2
    assert not g.has_tensor("output.weight") and g.metadata["tokenizer.ggml.model"] == "gpt2"
    evaluate = json.loads((tmp_path / "metrics" / "evaluate.json").read_text())
    train_metrics = json.loads((tmp_path / "metrics" / "train.json").read_text())
    assert abs(evaluate["val_loss"] - train_metrics["kept_val_loss"]) <= 1e-3  # the stage also enforces it
    samples = json.loads((tmp_path / "models" / "evaluate" / "samples.json").read_text())
    assert len(samples) == 3 and all({"prompt", "greedy", "sampled"} <= set(s) for s in samples)
