"""train.qat: training on exactly the weights the export at that type holds."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants

from pipeline.config import ModelConfig, OptimConfig, TrainConfig
from pipeline.errors import ConfigError
from pipeline.gguf.reader import GGUFFile
from pipeline.init.realize import realize
from pipeline.models.llama_gguf import export_llama
from pipeline.models.registry import load_gguf
from pipeline.tokenizer.pretokenizers import donor_tokenizer_metadata
from pipeline.training.checkpoint import config_key
from pipeline.training.loop import TrainJob, train
from pipeline.training.qat import fake_q4_0, fake_q8_0, fake_quant, targets
from pipeline.training.resume import compat_dict
from pipeline.training.validation import evaluate_loss
from stages._run.typed import typed_config
from stages.compose import compose_config

pytestmark = pytest.mark.usefixtures("one_thread")
TINY = ModelConfig(d_model=64, n_layer=2, n_head=4, n_kv_head=2, d_ff=128, context_length=64)


@pytest.mark.parametrize(
    ("fake", "qtype"), [(fake_q8_0, GGMLQuantizationType.Q8_0), (fake_q4_0, GGMLQuantizationType.Q4_0)]
)
@pytest.mark.parametrize("scale", [1e-4, 0.02, 3.0])
def test_the_fake_quant_is_gguf_pys_round_trip_bit_for_bit(fake, qtype, scale: float) -> None:
    w = (np.random.default_rng(0).standard_normal((64, 256)) * scale).astype(np.float32)
    w[0, :32] = 0.0  # an all-zero block
    w[1, :32] = scale  # a block of equal values
    w[2, 5] = -4 * scale  # a negative extreme: Q4_0's scale takes its sign
    expected = quants.dequantize(quants.quantize(w, qtype), qtype).reshape(w.shape)
    assert np.array_equal(fake(torch.from_numpy(w)).numpy(), expected)


def test_each_matrix_gets_the_type_the_export_writes() -> None:
    model = realize(TINY, "scratch", 512, 0)
    kinds = {id(p): k for p, k in targets(model, "q4_0")}
    assert kinds[id(model.embedding_table())] == "Q8_0"  # the tied table / head stays Q8_0 below 8 bits
    assert {k for p, k in targets(model, "q4_0") if p is not model.embedding_table()} == {"Q4_0"}
    assert all(p.ndim == 2 for p, _ in targets(model, "q8_0"))  # norms stay F32
    odd = torch.nn.Parameter(torch.ones(4, 48))
    assert fake_quant(odd, "F16").dtype == torch.float32


def test_a_qat_run_exports_exactly_the_weights_it_validated(smollm2: GGUFFile, tmp_path: Path) -> None:
    """The q4_0 file of a QAT run holds the fake-quantized trained weights, so its val loss is the
    train stage's; the weights the loop keeps are full precision (the swap is undone)."""
    rng = np.random.default_rng(0)
    data = rng.integers(0, 2000, 6000).astype(np.uint16)
    train_ids, val_ids = data[:5000], data[5000:]
    model = realize(TINY, "scratch", 49152, 0)
    tcfg = TrainConfig(steps=6, batch_size=4, seq_len=32, eval_every=3, qat="q4_0", qat_start=0.5, keep_best=False)
    result = train(model, train_ids, val_ids, TrainJob(tcfg, OptimConfig(lr=3e-3, warmup_steps=1), 0, progress=False))
    assert any(not torch.equal(p, fake_quant(p, k)) for p, k in targets(model, "q4_0"))  # not left quantized
    path = export_llama(model, tmp_path / "q.gguf", donor_tokenizer_metadata(smollm2), {}, "q4_0")
    exported, _ = load_gguf(path)
    for (p, kind), q in zip(targets(model, "q4_0"), targets(exported, "q4_0")):
        assert torch.equal(fake_quant(p.detach(), kind), q[0].detach())
    cpu = torch.device("cpu")
    assert evaluate_loss(exported, val_ids, 32, 4, cpu) == pytest.approx(result.final_val_loss, abs=1e-5)


def test_qat_refusals_name_the_key() -> None:
    for overrides, key in (
        (["train.qat=q4_0"], "export.dtype"),
        (["train.qat=q3_k", "export.dtype=q4_k_m"], "train.qat"),
        (["train.qat=q4_k_m", "export.dtype=q4_k_m", "recipe.init=lens"], "train.qat"),
        (["train.qat=q4_0", "export.dtype=q4_0", "train.qat_start=1"], "train.qat_start"),
        (["preset=lora", "train.qat=q8_0", "export.dtype=q8_0"], "train.qat"),
    ):
        with pytest.raises(ConfigError) as err:
            typed_config(compose_config(overrides))
        assert str(err.value).startswith(f"config key {key}:") and "\n" not in str(err.value)
    assert typed_config(compose_config(["train.qat=q4_0", "export.dtype=q4_0"])).train.qat == "q4_0"


def test_a_qat_run_never_resumes_a_plain_runs_checkpoints() -> None:
    """QAT is another trajectory from qat_start on: its checkpoints live under another key (a QAT
    run once took a plain run's step-300 checkpoint as its own and exported unquantized weights),
    and a plain run's key is what it was before QAT existed."""
    cfg = TINY  # any dataclass: compat_dict records its fields
    plain = TrainConfig(steps=10)
    key = config_key(compat_dict(cfg, plain, OptimConfig(), 0, "init", "data"))
    keys = {key}
    for qat in (
        TrainConfig(steps=10, qat="q4_0"),
        TrainConfig(steps=10, qat="q4_0", qat_start=0.25),
        TrainConfig(steps=10, qat="q4_k_m", qat_imatrix=256),
    ):
        keys.add(config_key(compat_dict(cfg, qat, OptimConfig(), 0, "init", "data")))
    assert len(keys) == 4
    assert "qat" not in compat_dict(cfg, plain, OptimConfig(), 0, "init", "data")
