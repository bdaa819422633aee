"""evaluate.quant_types: the export quantized to each type and scored beside it, by our reader and by
llama.cpp on the same windows."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from pipeline.errors import ConfigError
from pipeline.evaluate.evaluate_text import check_quant_types
from pipeline.evaluate.metric_names import quant_types_of
from pipeline.evaluate.quantized import loss_and_kl, quant_metrics, write_quantized
from pipeline.gguf.quantize import llamacpp_installed
from pipeline.gguf.reader import GGUFFile
from pipeline.models.llama import Llama
from pipeline.models.llama_gguf import export_llama
from pipeline.models.registry import load_gguf
from pipeline.models.transformer import TransformerConfig, init_weights
from pipeline.tokenizer.pretokenizers import donor_tokenizer_metadata
from stages._run.typed import typed_config
from stages.compose import compose_config

pytestmark = pytest.mark.usefixtures("one_thread")
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def export(tmp_path_factory, smollm2: GGUFFile) -> Path:
    """A tiny llama with the donor's tokenizer, exported at f32 as the export stage writes it."""
    cfg = TransformerConfig(vocab_size=49152, d_model=64, n_layer=2, n_head=4, n_kv_head=2, d_ff=128, context_length=64)
    model = Llama(cfg)
    init_weights(model, 0.05, 0)
    path = tmp_path_factory.mktemp("quant") / "model.gguf"
    return export_llama(model, path, donor_tokenizer_metadata(smollm2), {"pipeline.x": "y"}, "f32")


def val_tokens(n: int = 16 * 8 + 1) -> np.ndarray:
    return np.random.default_rng(0).integers(0, 49152, n).astype(np.uint16)


def test_each_type_is_scored_against_the_export_and_coarser_types_lose_more(export: Path) -> None:
    m = quant_metrics(export, ["q8_0", "q4_0"], val_tokens(), 16, 4, CPU, [])
    assert quant_types_of(m) == ["q8_0", "q4_0"]
    assert 0 < m["quant_q8_0_kl"] < m["quant_q4_0_kl"]  # coarser blocks, further from the export
    assert abs(m["quant_q8_0_val_loss_rise"]) < abs(m["quant_q4_0_val_loss_rise"]) + 1e-3
    assert m["quant_q4_0_mb"] < m["quant_q8_0_mb"] < export.stat().st_size / 1e6
    ref, _ = load_gguf(export)
    assert loss_and_kl(ref, ref, val_tokens(), 16, 4, CPU)[1] == pytest.approx(0.0, abs=1e-9)


def test_the_quantized_file_keeps_the_exports_keys_and_tokenizer(export: Path, tmp_path: Path) -> None:
    q = GGUFFile(write_quantized(export, "q4_0", tmp_path / "q.gguf"))
    f = GGUFFile(export)
    assert q.metadata["pipeline.x"] == "y" and q.metadata["general.file_type"] == 2  # MOSTLY_Q4_0
    assert {k: v for k, v in q.metadata.items() if k.startswith("tokenizer.")} == {
        k: v for k, v in f.metadata.items() if k.startswith("tokenizer.")
    }


@pytest.mark.skipif(not llamacpp_installed(), reason="llama-cpp-python not installed (make llamacpp)")
def test_llamacpp_scores_the_quantized_file_as_we_do(export: Path) -> None:
    val = val_tokens()
    windows = [val[i * 16 : (i + 1) * 16].astype(np.int64).tolist() for i in range(2)]
    m = quant_metrics(export, ["q8_0", "q4_k_m"], val, 16, 4, CPU, windows)
    for dtype in ("q8_0", "q4_k_m"):  # llama.cpp quantizes activations and keeps K/V in f16: close, not equal
        assert m[f"quant_{dtype}_llamacpp_window_loss"] == pytest.approx(m[f"quant_{dtype}_ours_window_loss"], abs=1e-2)


def test_bad_quant_types_are_refused_naming_the_key(monkeypatch: pytest.MonkeyPatch) -> None:
    for bad in ("[q3]", "[f32]"):
        with pytest.raises(ConfigError) as err:
            typed_config(compose_config([f"evaluate.quant_types={bad}"]))
        assert str(err.value).startswith("config key evaluate.quant_types:") and "\n" not in str(err.value)
    monkeypatch.setattr("pipeline.evaluate.evaluate_text.llamacpp_installed", lambda: False)
    check_quant_types(["q8_0", "q4_0"])  # gguf-py writes these: no llama.cpp needed
    with pytest.raises(ConfigError, match="evaluate.quant_types: expected llama-cpp-python installed for q4_k_m"):
        check_quant_types(["q8_0", "q4_k_m"])
