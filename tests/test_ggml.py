"""ggml's own quantizer through ctypes, and QAT to llama.cpp's K-quant mixes with it."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants

from pipeline.config import ModelConfig, OptimConfig, TrainConfig
from pipeline.errors import ConfigError
from pipeline.gguf import ggml
from pipeline.gguf.quantize import llamacpp_quantize
from pipeline.gguf.reader import GGUFFile
from pipeline.init.realize import realize
from pipeline.models.llama_gguf import export_llama
from pipeline.models.registry import export_gguf, load_gguf
from pipeline.tokenizer.pretokenizers import donor_tokenizer_metadata
from pipeline.training.loop import TrainJob, train
from pipeline.training.qat import ggml_fake_quant, named_targets
from pipeline.training.validation import evaluate_loss

pytest.importorskip("llama_cpp")
pytestmark = pytest.mark.usefixtures("one_thread")
# rows of 256 (K-quant super-blocks) and 512; 2 layers: Q4_K_M puts Q6_K on layer 1's attn_v/ffn_down
K_TINY = ModelConfig(d_model=256, n_layer=2, n_head=4, n_kv_head=2, d_ff=512, context_length=64)


@pytest.fixture(scope="module")
def k_files(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A tiny model's f32 export and llama-quantize's Q4_K_M of it."""
    tmp = tmp_path_factory.mktemp("k")
    model = realize(K_TINY, "scratch", 2048, 0)
    f32 = export_gguf(model, tmp / "f32.gguf", {}, {}, "f32")
    return f32, llamacpp_quantize(f32, tmp / "q4_k_m.gguf", "q4_k_m")


def test_ggml_quantize_writes_llama_quantizes_bytes(k_files: tuple[Path, Path]) -> None:
    """Tensor for tensor, ggml_quantize_chunk gives the bytes llama_model_quantize wrote, and ggml's
    dequantizer the values our reader (gguf-py) reads from them."""
    src, out = GGUFFile(k_files[0]), GGUFFile(k_files[1])
    kinds = set()
    for name in out.tensor_names():
        raw, kind, _ = out.raw_tensor(name)
        if kind == "F32":
            continue
        kinds.add(kind)
        qtype = GGMLQuantizationType[kind]
        w = src.tensor(name)
        mine = ggml.quantize(w, qtype, threads=2)
        assert np.array_equal(mine.reshape(-1), np.asarray(raw).reshape(-1)), name
        assert np.array_equal(ggml.dequantize(mine, qtype, w.shape), out.tensor(name)), name
    assert kinds == {"Q4_K", "Q6_K"}


@pytest.mark.parametrize("kind", ["Q4_0", "Q8_0", "Q5_K", "Q6_K", "Q4_K"])
def test_ggml_round_trip_is_gguf_pys(kind: str) -> None:
    qtype = GGMLQuantizationType[kind]
    w = (np.random.default_rng(1).standard_normal((8, 512)) * 0.02).astype(np.float32)
    q = ggml.quantize(w, qtype)
    assert q.shape == (8, ggml.row_size(qtype, 512))
    expected = quants.dequantize(q, qtype).reshape(w.shape)
    assert np.array_equal(ggml.round_trip(w, qtype), expected)
    if kind in ("Q4_0", "Q8_0"):  # gguf-py quantizes the legacy types itself: the same bytes
        assert np.array_equal(q, quants.quantize(w, qtype))


def test_ggml_refusals_are_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(Exception, match="blocks of 256") as err:
        ggml.quantize(np.zeros((2, 96), np.float32), GGMLQuantizationType.Q4_K)
    assert "\n" not in str(err.value)
    assert not ggml.requires_imatrix(GGMLQuantizationType.Q4_K)
    assert ggml.requires_imatrix(GGMLQuantizationType.IQ2_XXS)
    monkeypatch.setattr("pipeline.gguf.quantize.llamacpp_installed", lambda: False)
    ggml.library.cache_clear()
    try:
        with pytest.raises(ConfigError, match="llama-cpp-python") as err:
            ggml.library()
        assert "\n" not in str(err.value)
    finally:
        ggml.library.cache_clear()


def test_k_qat_types_are_llama_cpps(k_files: tuple[Path, Path]) -> None:
    out = GGUFFile(k_files[1])
    model = realize(K_TINY, "scratch", 2048, 0)
    table = {name: kind for _, kind, name in named_targets(model, "q4_k_m")}
    written = {n: out.tensor_info(n).ggml_type for n in out.tensor_names()}
    assert table == {n: kind for n, kind in written.items() if kind != "F32"}
    assert table["token_embd.weight"] == "Q6_K" and table["blk.1.ffn_down.weight"] == "Q6_K"
    assert table["blk.0.attn_q.weight"] == "Q4_K"


def test_a_k_qat_run_exports_exactly_the_weights_it_validated(smollm2: GGUFFile, tmp_path: Path) -> None:
    """The q4_k_m file of a QAT run holds ggml's round trip of the trained weights with llama.cpp's
    per-tensor types, so our reader scores it at the train stage's val loss."""
    rng = np.random.default_rng(0)
    data = rng.integers(0, 2000, 6000).astype(np.uint16)
    train_ids, val_ids = data[:5000], data[5000:]
    model = realize(K_TINY, "scratch", 49152, 0)
    tcfg = TrainConfig(steps=4, batch_size=4, seq_len=32, eval_every=2, qat="q4_k_m", qat_start=0.5, keep_best=False)
    result = train(model, train_ids, val_ids, TrainJob(tcfg, OptimConfig(lr=3e-3, warmup_steps=1), 0, progress=False))
    path = export_llama(model, tmp_path / "q.gguf", donor_tokenizer_metadata(smollm2), {}, "q4_k_m")
    exported, g = load_gguf(path)
    for (p, kind, name), ours in zip(named_targets(model, "q4_k_m"), named_targets(exported, "q4_k_m")):
        assert g.tensor_info(name).ggml_type == kind
        assert torch.equal(ggml_fake_quant(p.detach(), kind), ours[0].detach()), name
        assert not torch.equal(p.detach(), ours[0].detach())  # the loop kept full precision
    cpu = torch.device("cpu")
    assert evaluate_loss(exported, val_ids, 32, 4, cpu) == pytest.approx(result.final_val_loss, abs=1e-5)
