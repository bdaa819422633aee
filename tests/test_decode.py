"""The packed decoder (pipeline.inference.decode): fp32 equals the module, int8/bf16 stay within their
rounding of it, the preallocated KV cache equals a full recompute, a bad precision is one line."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from pipeline.config import ChatConfig
from pipeline.errors import ConfigError
from pipeline.inference import decode
from pipeline.inference.decode import PackedLinear, PackedLlama, for_decoding
from pipeline.inference.sampling import Sampling, generate_ids, stream_ids
from pipeline.models.llama import Llama
from pipeline.models.llama_gguf import export_llama
from pipeline.models.registry import load_gguf
from pipeline.models.transformer import TransformerConfig, init_weights
from stages._run.typed import structured_config
from tests.test_gpt2 import perturbed

pytestmark = pytest.mark.usefixtures("one_thread")


def tiny_gguf(path: Path, dtype: str) -> torch.nn.Module:
    """A random 4-layer llama (GQA 4/2, norm weights away from 1) written as a `dtype` GGUF, read back."""
    model = Llama(TransformerConfig(96, 64, 4, 4, 2, 96, 128, 100000.0, 1e-5))
    init_weights(model, 0.2, seed=0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))))
    return load_gguf(export_llama(model, path, {}, {"general.name": "tiny"}, dtype))[0].eval()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> torch.nn.Module:
    return tiny_gguf(tmp_path_factory.mktemp("decode") / "tiny.gguf", "f32")


@pytest.fixture(scope="module")
def tiny_q4(tmp_path_factory) -> torch.nn.Module:
    """The same model as a Q4_1 GGUF (Q8_0 token table), as SmolLM2's donor file is."""
    return tiny_gguf(tmp_path_factory.mktemp("decode") / "tiny-q4_1.gguf", "q4_1")


def ids(n: int, seed: int = 0, vocab: int = 96) -> torch.Tensor:
    return torch.randint(0, vocab, (1, n), generator=torch.Generator().manual_seed(seed))


def test_fp32_packing_gives_the_module_s_logits(tiny: torch.nn.Module) -> None:
    x = ids(40)
    with torch.inference_mode():
        torch.testing.assert_close(PackedLlama(tiny, "fp32")(x), tiny(x), rtol=1e-5, atol=1e-5)


def test_int8_rows_round_to_the_nearest_step_and_multiply_as_dequantized() -> None:
    w = torch.randn(96, 64, generator=torch.Generator().manual_seed(1)) * torch.linspace(0.1, 3, 96)[:, None]
    lin = PackedLinear(w, "int8")
    assert lin.weight.dtype == torch.int8 and int(lin.weight.abs().max()) == 127
    step = lin.scale.float()[:, None]
    assert bool(((lin.dequantized() - w).abs() <= step / 2 + 1e-6).all())  # round to nearest, per row
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    ref = x.float() @ lin.dequantized().T  # the kernel = bf16 x times the dequantized rows
    torch.testing.assert_close(lin(x).float(), ref, rtol=1e-2, atol=2e-2)


def test_fast_paths_stay_within_their_rounding_of_fp32(tiny: torch.nn.Module) -> None:
    """bf16 keeps 8 significant bits of every weight and matmul input (a relative step of 2^-8);
    int8 rows add a step of max|row|/127 per weight, 2-3x bf16's on these rows. So: bf16 off by a
    few percent of the logits' spread on average, int8 by at most 4x that, neither by a tenth."""
    x = ids(48, seed=3)
    with torch.inference_mode():
        ref = tiny(x)
        err = {p: float((PackedLlama(tiny, p)(x) - ref).abs().mean() / ref.std()) for p in ("bf16", "int8")}
    assert 0 < err["bf16"] < 0.04 and 0 < err["int8"] < min(0.1, 4 * err["bf16"])


def test_int4_blocks_land_on_a_q4_1_grid_again(tiny: torch.nn.Module, tiny_q4: torch.nn.Module) -> None:
    """Weights dequantized from Q4_1 are q * d + m per block of 32: int4 blocks hold them up to the
    bf16 rounding of d and m (a few thousandths of the block range), while the f32 original's weights
    are off by up to half a step (a thirtieth of the range)."""
    for model, low, high in ((tiny_q4, 0.0, 0.01), (tiny, 0.01, 0.07)):  # half a step <= 2 max|w| / 30
        w = model.blocks[0].ffn.down.weight.detach()
        err = float((PackedLinear(w, "int4").dequantized() - w).abs().max() / w.abs().max())
        assert low < err < high
    x = ids(48, seed=3)
    with torch.inference_mode():
        ref = tiny_q4(x)
        err = {p: float((PackedLlama(tiny_q4, p)(x) - ref).abs().mean() / ref.std()) for p in ("bf16", "int8", "int4")}
    assert 0 < err["bf16"] < err["int4"] < err["int8"]  # on a Q4_1 file int4 is the closer of the two


def test_a_quantized_head_rescores_its_best_candidates_exactly(tiny: torch.nn.Module) -> None:
    model = PackedLlama(tiny, "int8")
    h = torch.randn(1, 3, 64, generator=torch.Generator().manual_seed(8)).to(torch.bfloat16)
    rough, exact = model.head(h).float(), h.float() @ model.head_rows.float().T
    out = model._logits(h)
    best = rough.topk(decode.RESCORED, dim=-1).indices
    torch.testing.assert_close(out.gather(-1, best), exact.gather(-1, best), rtol=1e-6, atol=1e-6)
    rest = torch.ones_like(out, dtype=torch.bool).scatter(-1, best, False)
    assert torch.equal(out[rest], rough[rest]) and not torch.equal(rough.gather(-1, best), exact.gather(-1, best))


@pytest.mark.parametrize("precision", ["int8", "bf16"])
def test_greedy_ids_equal_the_fp32_module(tiny: torch.nn.Module, precision: str) -> None:
    """A prompt without near-ties in its 24 greedy steps (the smallest fp32 top-2 margin is 2% of the
    logits' spread; other prompts of this random model flip at such ties, as near-ties may)."""
    prompt = ids(6, seed=1)[0].tolist()
    want = generate_ids(tiny, prompt, 24)
    assert generate_ids(for_decoding(tiny, precision), prompt, 24) == want


@pytest.mark.parametrize("step_mode", ["dynamic", "static"])
@pytest.mark.parametrize("precision", ["fp32", "bf16", "int8", "int4"])
def test_static_cache_decode_equals_full_recompute(
    tiny: torch.nn.Module, precision: str, step_mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Prefill, a second chunk, then one token at a time, the buffer growing twice on the way; the
    one-token steps as the CPU runs them (dynamic) and as a CUDA graph holds them (static shapes:
    the position a device tensor, attention over the whole buffer under a mask)."""
    monkeypatch.setattr(decode, "_FIRST_CAPACITY", 8)
    model, x = PackedLlama(tiny, precision), ids(30, seed=5)
    model.step_mode = step_mode
    with torch.inference_mode():
        full = model(x)
        cache = model.new_cache()
        parts = [model(x[:, :7], cache), model(x[:, 7:12], cache)]
        parts += [model(x[:, t : t + 1], cache) for t in range(12, 30)]
    assert cache.length == 30 and cache.k.shape[3] == 32
    tol = 1e-4 if precision == "fp32" else 2e-2 * float(full.std())  # summation order only, or bf16 rounding
    torch.testing.assert_close(torch.cat(parts, dim=1), full, rtol=0, atol=tol)
    cache.truncate(12)  # chat cuts the cache back to a common prefix: the next token sees 12 positions
    with torch.inference_mode():
        torch.testing.assert_close(model(x[:, 12:13], cache), full[:, 12:13], rtol=0, atol=tol)


def test_cached_stream_equals_recompute_across_the_sliding_window(tiny: torch.nn.Module) -> None:
    """Past the context (128) the window restarts from its last half, with a fresh cache."""
    model = for_decoding(tiny, "int8")
    prompt = ids(120, seed=6)[0].tolist()
    sampling = Sampling(temperature=0.8, top_k=20, seed=1)
    cached = [t for t, _ in zip(stream_ids(model, prompt, sampling), range(20))]
    recomputed = [t for t, _ in zip(stream_ids(model, prompt, sampling, use_cache=False), range(20))]
    assert cached == recomputed


def test_a_bad_precision_is_one_named_line(tiny: torch.nn.Module) -> None:
    with pytest.raises(ConfigError) as err:
        for_decoding(tiny, "int2")
    assert str(err.value).startswith("precision: expected one of int8, int4, bf16, fp32, found 'int2'")
    cfg = OmegaConf.create({"model_path": "smollm2", "precision": "q4"})
    with pytest.raises(ConfigError, match=r"config key precision: expected one of int8, int4, bf16, fp32") as err:
        structured_config(ChatConfig, cfg, "conf/chat.yaml")
    assert "\n" not in str(err.value)


def test_other_architectures_get_int8_linear_layers() -> None:
    model = perturbed()  # a gpt2 with every parameter away from its init
    x = ids(20, seed=7, vocab=model.cfg.vocab_size)
    with torch.inference_mode():
        ref = model(x)
        out = for_decoding(model, "int8")(x).float()
    assert type(model.blocks[0].attn.qkv).__name__ == "Int8Linear"
    assert 0 < float((out - ref).abs().mean() / ref.std()) < 0.05  # as for llama: a few percent of the spread


def test_a_failed_graph_capture_decodes_the_same_without_graphs(tiny: torch.nn.Module, caplog) -> None:
    """Where CUDA graphs cannot be captured (here: no CUDA at all), the decoder warns once and runs the
    same static step eagerly: the ids do not change."""
    prompt = ids(6, seed=1)[0].tolist()
    want = generate_ids(tiny, prompt, 12)
    model = for_decoding(tiny, "fp32")
    model.step_mode = "graph"
    assert generate_ids(model, prompt, 12) == want
    assert model.step_mode == "static" and not model.graphs
    assert [r.message for r in caplog.records if "graph capture failed" in r.message][:1]
