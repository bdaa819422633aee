"""The llama family beyond llama: Qwen2 (q/k/v biases), Qwen3 (per-head q/k norms, wide heads), Gemma 3
(post norms, GELU gate, scaled table, sliding layers with their own RoPE base) and Llama 3's RoPE
(frequency factors, linear scaling). Each is a GGUF this test writes with random weights; our fp32 logits
must equal transformers' own class for that architecture, and llama.cpp must run our export of it."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from pipeline.errors import GGUFError
from pipeline.gguf.reader import GGUFFile
from pipeline.gguf.writer import write_model_gguf
from pipeline.models.llama import Llama
from pipeline.models.llama_gguf import config_from_gguf, export_llama, gguf_tensors, llama_metadata
from pipeline.models.registry import load_gguf
from pipeline.models.transformer import TransformerConfig, init_weights
from pipeline.tokenizer.pretokenizers import donor_tokenizer_metadata

VOCAB = 49152  # the SmolLM2 tokenizer the files carry (llama.cpp and transformers want a real one)
BASE = dict(vocab_size=VOCAB, d_model=64, n_layer=3, n_head=4, n_kv_head=2, d_ff=96, context_length=128)
CONFIGS = {
    "qwen2": dict(arch="qwen2", rope_theta=1e6, tie_embeddings=False),
    "qwen3": dict(arch="qwen3", key_length=32, rope_theta=1e6, norm_eps=float(np.float32(1e-6))),
    "gemma3": dict(
        arch="gemma3",
        key_length=32,
        n_layer=6,
        n_kv_head=1,
        rope_theta=1e6,
        norm_eps=float(np.float32(1e-6)),
        sliding_window=16,
        sliding_layers=(True,) * 5 + (False,),  # llama.cpp's default pattern: every 6th layer global
    ),
    "llama3": dict(rope_freq_factors=(), rope_theta=5e5),  # factors: `llama3_factors`
    "llama-linear": dict(rope_scale=4.0),
}


LLAMA3_ROPE = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 64}


def llama3_factors(theta: float, head_dim: int) -> tuple[float, ...]:
    """Llama 3's RoPE as llama.cpp's converter writes it (`rope_freqs`, conversion/llama.py), from LLAMA3_ROPE."""
    r = LLAMA3_ROPE
    low, high = (
        r["original_max_position_embeddings"] / r["low_freq_factor"],
        r["original_max_position_embeddings"] / r["high_freq_factor"],
    )
    out = []
    for freq in 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim)):
        wavelen = 2 * np.pi / freq
        if wavelen < high:
            out.append(1.0)
        elif wavelen > low:
            out.append(r["factor"])
        else:
            smooth = (r["original_max_position_embeddings"] / wavelen - r["low_freq_factor"]) / (
                r["high_freq_factor"] - r["low_freq_factor"]
            )
            out.append(1 / ((1 - smooth) / r["factor"] + smooth))
    return tuple(float(np.float32(f)) for f in out)


CONFIGS["llama3"]["rope_freq_factors"] = llama3_factors(5e5, BASE["d_model"] // BASE["n_head"])


def random_model(arch_kwargs: dict, seed: int = 0) -> Llama:
    """A model of that architecture with random weights, norms and biases all different from 1 and 0."""
    norm_eps = float(np.float32(1e-5))
    model = Llama(TransformerConfig(**{**BASE, "norm_eps": norm_eps, **arch_kwargs}))
    init_weights(model, 0.08, seed)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
    return model.eval()


@pytest.fixture(scope="module")
def tok_meta(smollm2: GGUFFile) -> dict:
    return donor_tokenizer_metadata(smollm2)


@pytest.fixture(scope="module", params=list(CONFIGS))
def written(request, tok_meta: dict, tmp_path_factory) -> tuple[str, Llama, Path]:
    """(name, the random model, its GGUF written by our exporter)."""
    model = random_model(CONFIGS[request.param])
    path = tmp_path_factory.mktemp(request.param) / "model.gguf"
    export_llama(model, path, tok_meta, {"general.name": f"random {request.param}"})
    return request.param, model, path


def ids(n: int = 40, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (1, n), generator=torch.Generator().manual_seed(seed))


def logprobs(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        out = model(x)
        return getattr(out, "logits", out)[0].float().log_softmax(-1)


def test_the_file_reads_back_as_the_same_model(written) -> None:
    name, model, path = written
    back, g = load_gguf(path)
    assert g.architecture == model.cfg.arch and back.cfg == model.cfg
    for key, arr in gguf_tensors(model).items():
        np.testing.assert_array_equal(g.tensor(key), arr, err_msg=key)
    torch.testing.assert_close(logprobs(back, ids()), logprobs(model, ids()), rtol=0, atol=0)


def hf_model(name: str, model: Llama, path: Path) -> torch.nn.Module:
    """transformers' own class for the architecture: from our GGUF through its GGUF loader, or for
    Llama 3's RoPE (which its GGUF loader does not read) built from the config with our weights."""
    transformers = pytest.importorskip("transformers")
    cfg = model.cfg
    if not name.startswith("llama"):
        # its GGUF loader reads no key_length for Qwen3, and keeps Gemma 3's default query scale (1/16):
        # both given as llama.cpp reads them
        extra = {"qwen3": {"head_dim": cfg.head_dim}, "gemma3": {"query_pre_attn_scalar": cfg.head_dim}}.get(name, {})
        return transformers.AutoModelForCausalLM.from_pretrained(
            path.parent, gguf_file=path.name, dtype=torch.float32, **extra
        )
    rope = {"rope_type": "linear", "factor": cfg.rope_scale, "rope_theta": cfg.rope_theta}
    if cfg.rope_freq_factors:
        rope = {"rope_type": "llama3", **LLAMA3_ROPE, "rope_theta": cfg.rope_theta}
    hf_cfg = transformers.LlamaConfig(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.d_model,
        intermediate_size=cfg.d_ff,
        num_hidden_layers=cfg.n_layer,
        num_attention_heads=cfg.n_head,
        num_key_value_heads=cfg.n_kv_head,
        max_position_embeddings=cfg.context_length,
        rms_norm_eps=cfg.norm_eps,
        tie_word_embeddings=True,
        rope_parameters=rope,
    )
    hf = transformers.LlamaForCausalLM(hf_cfg)
    hf.load_state_dict(hf_state(model), strict=False)
    return hf


def hf_state(model: Llama) -> dict[str, torch.Tensor]:
    """Our llama weights under transformers' names, Q/K rows back in its halves layout."""

    def unpermute(w: torch.Tensor, heads: int) -> torch.Tensor:
        return w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

    cfg, out = model.cfg, {"model.embed_tokens.weight": model.tok_embd.weight, "model.norm.weight": model.norm.weight}
    for i, b in enumerate(model.blocks):
        p = f"model.layers.{i}."
        out |= {p + "self_attn.q_proj.weight": unpermute(b.attn.wq.weight, cfg.n_head)}
        out |= {p + "self_attn.k_proj.weight": unpermute(b.attn.wk.weight, cfg.n_kv_head)}
        out |= {p + "self_attn.v_proj.weight": b.attn.wv.weight, p + "self_attn.o_proj.weight": b.attn.wo.weight}
        out |= {p + "mlp.gate_proj.weight": b.ffn.gate.weight, p + "mlp.up_proj.weight": b.ffn.up.weight}
        out |= {p + "mlp.down_proj.weight": b.ffn.down.weight, p + "input_layernorm.weight": b.attn_norm.weight}
        out |= {p + "post_attention_layernorm.weight": b.ffn_norm.weight}
    out["lm_head.weight"] = model.tok_embd.weight
    return {k: v.detach() for k, v in out.items()}


def test_our_logits_equal_transformers_own_class(written, monkeypatch: pytest.MonkeyPatch) -> None:
    """Beyond the sliding window (40 tokens, window 16) and with every rule on: the max |d log-prob|."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    name, model, path = written
    hf = hf_model(name, model, path).eval()
    x = ids()
    worst = float((logprobs(hf, x) - logprobs(model, x)).abs().max())
    print(f"{name}: max |d log-prob| vs transformers {worst:.1e}")
    assert worst <= 1e-3, (name, worst)
    if model.cfg.sliding_window:  # control: without the window the two disagree past it
        windows = [b.attn.window for b in model.blocks]
        try:
            for b in model.blocks:
                b.attn.window = 0
            assert float((logprobs(hf, x) - logprobs(model, x)).abs().max()) > 0.01
        finally:
            for b, w in zip(model.blocks, windows):
                b.attn.window = w


def test_llamacpp_runs_our_export(written) -> None:
    """llama.cpp computes what we compute on our export: top-1 agreement >= 0.9 at every position."""
    llama_cpp = pytest.importorskip("llama_cpp")
    name, model, path = written
    x = ids()
    llm = llama_cpp.Llama(model_path=str(path), logits_all=True, verbose=False, n_ctx=64, n_threads=1)
    llm.eval(x[0].tolist())
    theirs = torch.from_numpy(np.asarray(llm.scores[: x.shape[1]], dtype=np.float32)).log_softmax(-1)
    ours = logprobs(model, x)
    agree = float((ours.argmax(-1) == theirs.argmax(-1)).float().mean())
    print(f"{name}: top-1 agreement with llama.cpp {agree:.3f}, max |d log-prob| {(ours - theirs).abs().max():.1e}")
    assert agree >= 0.9, (name, agree)


def test_llamacpp_reads_a_cut_sliding_pattern(tok_meta: dict, tmp_path: Path) -> None:
    """A student cut from Gemma 3 keeps its donor layers' kinds, which need not be every 6th: the pattern
    is written per layer, and llama.cpp follows it (a layer read as the wrong kind disagrees)."""
    llama_cpp = pytest.importorskip("llama_cpp")
    model = random_model({**CONFIGS["gemma3"], "n_layer": 3, "sliding_layers": (False, True, False)})
    path = export_llama(model, tmp_path / "cut.gguf", tok_meta, {})
    assert GGUFFile(path).metadata["gemma3.attention.sliding_window_pattern"] == [False, True, False]
    assert config_from_gguf(GGUFFile(path)).sliding_layers == (False, True, False)
    x = ids(60)
    llm = llama_cpp.Llama(model_path=str(path), logits_all=True, verbose=False, n_ctx=64, n_threads=1)
    llm.eval(x[0].tolist())
    theirs = torch.from_numpy(np.asarray(llm.scores[:60], dtype=np.float32)).argmax(-1)
    assert float((logprobs(model, x).argmax(-1) == theirs).float().mean()) >= 0.9


def test_what_the_module_cannot_compute_is_refused_by_name(tok_meta: dict, tmp_path: Path) -> None:
    model = random_model(CONFIGS["gemma3"])
    cases = {
        "gemma3.final_logit_softcapping": (30.0, "soft-capping"),
        "gemma3.rope.scaling.type": ("yarn", "scaling"),
        "gemma3.attention.value_length": (16, "values of another width"),
    }
    for key, (value, said) in cases.items():
        meta = {**llama_metadata(model.cfg, "f32"), key: value}
        if key.endswith("scaling.type"):
            meta["gemma3.rope.scaling.factor"] = 4.0
        path = write_model_gguf(tmp_path / "bad.gguf", "gemma3", meta, gguf_tensors(model), tok_meta, {}, "f32")
        with pytest.raises(GGUFError, match=said) as e:
            load_gguf(path)
        assert key.split(".")[-1].split("_")[0] in str(e.value) and "\n" not in str(e.value)


def test_a_config_round_trips_through_json(tmp_path: Path) -> None:
    cfg = random_model(CONFIGS["gemma3"]).cfg
    (tmp_path / "config.json").write_text(cfg.to_json())
    assert TransformerConfig.load(tmp_path / "config.json") == cfg
    bad = replace(cfg, sliding_layers=(True,))
    (tmp_path / "config.json").write_text(bad.to_json())
    with pytest.raises(Exception, match="sliding_layers"):
        TransformerConfig.load(tmp_path / "config.json")


@pytest.mark.parametrize("name", list(CONFIGS))
def test_the_packed_decoder_computes_the_module(name: str) -> None:
    """generate/chat's decoder (q/k rows reordered to pairs, fused matmuls, a static cache) gives the
    module's logits in fp32, whole and one token at a time past the sliding window."""
    from pipeline.inference.decode import PackedLlama

    model = random_model(CONFIGS[name])
    packed = PackedLlama(model, "fp32")
    x = ids(40)
    whole = logprobs(model, x)
    with torch.no_grad():
        torch.testing.assert_close(packed(x)[0].log_softmax(-1), whole, rtol=0, atol=2e-4)
        cache = packed.new_cache()
        steps = [packed(x[:, :8], cache)[0]] + [packed(x[:, i : i + 1], cache)[0] for i in range(8, 40)]
    torch.testing.assert_close(torch.cat(steps).log_softmax(-1), whole, rtol=0, atol=2e-4)
    packed.step_mode = "static"  # the CUDA graph's step, run eagerly: the window as a mask over the buffer
    cache = packed.new_cache()
    with torch.no_grad():
        steps = [packed(x[:, :1], cache)[0]] + [packed(x[:, i : i + 1], cache)[0] for i in range(1, 40)]
    torch.testing.assert_close(torch.cat(steps).log_softmax(-1), whole, rtol=0, atol=2e-4)


@pytest.mark.parametrize("name", ["qwen2", "qwen3", "gemma3"])
def test_a_full_size_subclone_is_the_donor(name: str) -> None:
    """Every rule carried over: biases and q/k norms with their heads, Gemma's post norms on the kept
    coordinates (a permutation of the stream, not a rotation), its table scale; a student of the donor's
    own size computes the donor, and a smaller one keeps each kept layer's kind (sliding or global)."""
    from pipeline.donor.calibrate import calibrate
    from pipeline.init.subclone import subclone

    donor = random_model(CONFIGS[name])
    calib = calibrate(donor, torch.randint(0, VOCAB, (4, 48), generator=torch.Generator().manual_seed(2)), bf16=False)
    # a tied head is exact only on the coordinate axes (test_subclone): Gemma's permutation keeps them
    full = donor.cfg if name == "gemma3" else replace(donor.cfg, tie_embeddings=False)
    student, sel = subclone(donor, calib, full, "first")
    x = ids(40)
    assert float((logprobs(student, x) - logprobs(donor, x)).abs().max()) < 1e-3
    if name == "gemma3":
        assert np.count_nonzero(calib.basis) == calib.basis.shape[0]  # a permutation
        small = replace(donor.cfg, n_layer=3, d_model=48, d_ff=64)
        student, sel = subclone(donor, calib, small, "even")
        assert student.cfg.sliding_layers == tuple(donor.cfg.sliding_layers[i] for i in sel.layers)
        assert torch.isfinite(logprobs(student, x)).all()
