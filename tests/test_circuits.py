"""The donor's copy circuit: the probe's attention is the model's own, and SmolLM2's induction heads are found
where they are (layers 17-18, fed by the previous-token head of layer 16) and kept by the `circuit` cut."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file, save_file

from pipeline.donor.calibrate import Calibration, calibrate
from pipeline.donor.circuits import (
    COPY_MIN,
    attention_maps,
    circuit_layers,
    copy_head,
    copy_scores,
    probe_sequences,
)
from pipeline.errors import DataError
from pipeline.models.llama import Llama
from pipeline.models.llama_gguf import load_llama
from pipeline.models.transformer import TransformerConfig, init_weights


def tiny() -> Llama:
    torch.manual_seed(0)
    model = Llama(
        TransformerConfig(vocab_size=64, d_model=32, n_layer=2, n_head=4, n_kv_head=2, d_ff=64, context_length=128)
    )
    init_weights(model, 0.2, seed=0)
    return model.eval()


def test_the_probe_reads_the_attention_the_model_computes() -> None:
    """The maps times the values, through wo, give each layer's real attention output (batch of one)."""
    model, ids = tiny(), probe_sequences(torch.arange(64).view(1, -1), n=1, length=20)
    maps = attention_maps(model, ids)
    outputs, inputs = [], []

    def keep(_module: torch.nn.Module, args: tuple, out: torch.Tensor) -> None:
        inputs.append(args)
        outputs.append(out)

    hooks = [b.attn.register_forward_hook(keep) for b in model.blocks]
    with torch.no_grad():
        model.hidden(ids)
    for h in hooks:
        h.remove()
    for block, a, args, out in zip(model.blocks, maps, inputs, outputs):
        _, _, v = block.attn.project(*args[:2])
        v = v.repeat_interleave(a.shape[0] // v.shape[1], dim=1)[0]
        y = (a @ v).transpose(0, 1).reshape(1, ids.shape[1], -1)
        torch.testing.assert_close(block.attn.wo(y), out, atol=1e-5, rtol=1e-4)


def test_probe_sequences_repeat_the_corpus_tokens() -> None:
    ids = torch.tensor([[5, 9, 11, 40]])
    probe = probe_sequences(ids, n=3, length=6)
    assert probe.shape == (3, 12) and torch.equal(probe[:, :6], probe[:, 6:])
    assert set(probe.flatten().tolist()) <= {5, 9, 11, 40}


def test_circuit_layers_keep_induction_layers_and_the_previous_token_head_below() -> None:
    induction, previous = np.zeros((8, 2)), np.zeros((8, 2))
    induction[5, 1], induction[6, 0], induction[2, 0] = 0.9, 0.6, COPY_MIN / 2
    previous[4, 0], previous[1, 1], previous[7, 0] = 0.8, 0.5, 0.95  # 7 is above the circuit: no key reads it
    assert circuit_layers(induction, previous, 12) == (4, 5, 6)
    assert circuit_layers(induction, previous, 8) == (4, 5), "at most a quarter of the cut: the strongest head first"
    assert circuit_layers(induction, previous, 4) == (), "a shallow cut keeps its most influential layers"
    assert circuit_layers(np.zeros((8, 2)), previous, 12) == (), "no induction head, no circuit"
    assert copy_head(induction[5], previous[5]) == 1 and copy_head(induction[2], previous[2]) is None


def test_smollm2s_copy_circuit(smollm2_path) -> None:
    donor, _ = load_llama(smollm2_path)
    ids = torch.randint(0, 49152, (4, 256), generator=torch.Generator().manual_seed(1))
    induction, previous = copy_scores(donor, ids)
    assert induction.shape == previous.shape == (30, 9)
    assert induction[17].max() > 0.6 and induction[18].max() > 0.6 and induction[:16].max() < 0.2
    assert previous[16].max() > 0.8
    assert circuit_layers(induction, previous, 12)[:3] == (16, 17, 18)


def test_a_calibration_without_the_copy_scores_names_the_fix(tmp_path) -> None:
    """A calibration file from before the copy scores existed is refused in one line, not a KeyError."""
    calib = calibrate(tiny(), torch.randint(0, 64, (2, 32), generator=torch.Generator().manual_seed(0)), bf16=False)
    assert calib.head_induction.shape == calib.head_previous.shape == (2, 4)
    path = tmp_path / "calibration.safetensors"
    calib.save(str(path))
    old = {k: v for k, v in load_file(str(path)).items() if not k.startswith("head_induction")}
    save_file(old, str(path))
    with pytest.raises(DataError, match="calibration.safetensors: expected a donor calibration .* no head_induction"):
        Calibration.load(str(path))
