"""Realize is deterministic, warm-start inits carry the donor, and exports load back exactly
(through our reader and through transformers)."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch

from pipeline.config import ModelConfig
from pipeline.donor.pca import pca
from pipeline.gguf.reader import GGUFFile
from pipeline.init.realize import realize
from pipeline.modeldir import load_model_dir, save_model_dir
from pipeline.models.llama_gguf import export_llama, load_llama
from pipeline.models.ops.elementwise import RMSNormFn, RopeFn, SwiGLUFn
from pipeline.tokenizer.pretokenizers import donor_tokenizer_metadata

TINY = ModelConfig(d_model=32, n_layer=2, n_head=4, n_kv_head=2, d_ff=64, context_length=64)
VOCAB = 49152


@pytest.fixture(scope="module")
def donor_lens(smollm2: GGUFFile):
    table = smollm2.tensor("token_embd.weight")
    return pca(table, 64), table


def ids(n: int = 24, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, n), generator=torch.Generator().manual_seed(seed))


def test_realize_is_deterministic_from_seed() -> None:
    a, b, c = (realize(TINY, "scratch", VOCAB, s) for s in (1, 1, 2))
    for (name, pa), pb in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(pa, pb), name
    assert not torch.equal(a.tok_embd.weight, c.tok_embd.weight)


def test_pca_init_uses_projected_donor_rows(donor_lens) -> None:
    lens, _ = donor_lens
    m = realize(TINY, "pca", VOCAB, 0, lens)
    table = m.tok_embd.weight.detach().numpy()
    expected = lens.projected[:, :32]
    scale = table[:, 0] @ expected[:, 0] / (expected[:, 0] @ expected[:, 0])
    np.testing.assert_allclose(table, expected * scale, rtol=1e-5, atol=1e-7)
    assert abs(table.std() - TINY.init_std) < 1e-4


def test_lens_init_equals_pca_init_at_step_zero(donor_lens) -> None:
    lens, table = donor_lens
    p = realize(TINY, "pca", VOCAB, 0, lens)
    q = realize(TINY, "lens", VOCAB, 0, lens, table)
    assert q.cfg.donor_dim == 576 and q.tok_embd.weight.shape == (VOCAB, 576)
    with torch.no_grad():
        torch.testing.assert_close(q.embedding_table(), p.tok_embd.weight, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(q(ids()), p(ids()), atol=1e-4, rtol=1e-4)


def test_save_load_round_trip(tmp_path: Path) -> None:
    m = realize(TINY, "scratch", VOCAB, 3)
    save_model_dir(tmp_path, m)
    n = load_model_dir(tmp_path)
    assert n.cfg == m.cfg
    with torch.no_grad():
        assert torch.equal(m(ids()), n(ids()))


def trained_like(init: str, donor_lens, seed: int = 5):
    """A model with non-trivial weights (norms and lens not at their init values)."""
    lens, table = donor_lens
    m = realize(TINY, init, VOCAB, seed, lens, table)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn(p.shape, generator=g))
    return m


@pytest.mark.parametrize("init", ["pca", "lens"])
def test_f32_export_reloads_exactly(tmp_path: Path, smollm2: GGUFFile, donor_lens, init: str) -> None:
    m = trained_like(init, donor_lens)
    path = export_llama(m, tmp_path / "m.gguf", donor_tokenizer_metadata(smollm2), {"general.name": "t"}, "f32")
    back, g = load_llama(path)
    assert back.cfg.donor_dim == 0 and back.cfg.d_model == 32
    with torch.no_grad():
        torch.testing.assert_close(back(ids()), m(ids()), atol=2e-5, rtol=1e-5)
    # complete tokenizer metadata, copied with the donor's values
    for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.pre", "tokenizer.chat_template"):
        assert g.metadata[key] == smollm2.metadata[key]
    assert g.metadata["general.file_type"] == 0 and g.metadata["llama.rope.dimension_count"] == 8


def test_f16_export_is_close(tmp_path: Path, smollm2: GGUFFile, donor_lens) -> None:
    m = trained_like("pca", donor_lens)
    path = export_llama(m, tmp_path / "h.gguf", donor_tokenizer_metadata(smollm2), {}, "f16")
    back, g = load_llama(path)
    assert g.tensor_info("blk.0.attn_q.weight").ggml_type == "F16"
    assert g.tensor_info("blk.0.attn_norm.weight").ggml_type == "F32"
    with torch.no_grad():
        lp_a = torch.log_softmax(back(ids()), -1)
        lp_b = torch.log_softmax(m(ids()), -1)
    assert (lp_a - lp_b).abs().max() < 1e-2


def test_export_loads_in_transformers_with_equal_logprobs(tmp_path: Path, smollm2: GGUFFile, donor_lens) -> None:
    transformers = pytest.importorskip("transformers")
    os.environ["HF_HUB_OFFLINE"] = "1"
    m = trained_like("lens", donor_lens)
    export_llama(m, tmp_path / "model.gguf", donor_tokenizer_metadata(smollm2), {"general.name": "t"}, "f32")
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file="model.gguf", dtype=torch.float32)
    hf.eval()
    x = ids(32)
    with torch.no_grad():
        ours = torch.log_softmax(m(x).double(), -1)
        theirs = torch.log_softmax(hf(x).logits.double(), -1)
    assert (ours - theirs).abs().max().item() <= 1e-3


def test_kv_cache_matches_full_forward() -> None:
    from pipeline.inference.sampling import generate_ids
    from pipeline.models.transformer import KVCache

    m = realize(TINY, "scratch", VOCAB, 0).eval()
    x = ids(20)
    with torch.no_grad():
        full = m(x)
        cache = KVCache(TINY.n_layer)
        parts = [m(x[:, :7], cache), m(x[:, 7:12], cache)] + [m(x[:, i : i + 1], cache) for i in range(12, 20)]
    torch.testing.assert_close(torch.cat(parts, 1), full, atol=1e-5, rtol=1e-5)
    # greedy generation with the cache equals argmax over full recomputation
    prompt = x[0, :5].tolist()
    got = generate_ids(m, prompt, 10)
    seq = list(prompt)
    with torch.no_grad():
        for _ in range(10):
            seq.append(int(m(torch.tensor([seq]))[0, -1].argmax()))
    assert got == seq[5:]
    # past the context window it keeps going (sliding window), and sampling is seeded
    assert len(generate_ids(m, prompt, TINY.context_length + 5)) == TINY.context_length + 5
    a = generate_ids(m, prompt, 8, temperature=1.0, top_k=5, seed=3)
    assert a == generate_ids(m, prompt, 8, temperature=1.0, top_k=5, seed=3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", ["rms_norm", "rope", "swiglu"])
def test_the_layers_own_backward_gives_the_same_gradients_under_torch_compile(name: str, dtype: torch.dtype) -> None:
    """torch 2.11's dynamo zeroed every input gradient of an autograd.Function whose forward ended in a
    cast that did nothing (`.to(x.dtype)` of an fp32 result): compiled blocks trained RMSNorm and Q/K
    on zero gradients, silently. Dynamo's own `eager` backend shows it without compiling anything."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 5, 8, generator=g).to(dtype)
    args = {
        "rms_norm": (RMSNormFn.apply, (x, torch.randn(8, generator=g)), (1e-5,)),
        "rope": (RopeFn.apply, (x,), (torch.randn(5, 4, generator=g), torch.randn(5, 4, generator=g), False)),
        "swiglu": (SwiGLUFn.apply, (x, torch.randn(2, 3, 5, 8, generator=g).to(dtype)), ()),
    }
    fn, inputs, constants = args[name]
    weights = torch.randn(x.shape, generator=g)
    grads = []
    for compiled in (False, True):
        leaves = [t.detach().clone().requires_grad_() for t in inputs]
        call = torch.compile(fn, backend="eager", fullgraph=True) if compiled else fn
        (call(*leaves, *constants).float() * weights).sum().backward()
        grads.append([t.grad for t in leaves])
    for eager, compiled in zip(*grads):
        assert eager.abs().sum() > 0
        torch.testing.assert_close(compiled, eager)
