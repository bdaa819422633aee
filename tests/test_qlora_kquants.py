"""QLoRA on K-quant bases: Q4_K/Q5_K/Q6_K super-blocks dequantized in torch bit for bit as gguf-py
does, and a Q4_K_M / Q5_K_M file made by llama.cpp's quantizer fine-tunes, exports and merges."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from pipeline.config import LoraConfig, OptimConfig
from pipeline.finetune.adapters import apply_adapter, read_adapter_gguf, save_adapter_gguf
from pipeline.finetune.lora import attach_lora, merge_lora
from pipeline.finetune.model import load_base
from pipeline.finetune.quant import BLOCKS, QuantLinear, dequantize, split_blocks
from pipeline.gguf.quantize import llamacpp_quantize
from pipeline.gguf.reader import GGUFFile
from pipeline.models.llama import Llama
from pipeline.models.llama_gguf import export_llama, load_llama
from pipeline.models.transformer import TransformerConfig, init_weights
from pipeline.tokenizer.pretokenizers import donor_tokenizer_metadata
from pipeline.training.optim import make_optimizer

pytestmark = pytest.mark.usefixtures("one_thread")

# fp16 fields of each super-block (byte offsets): d and dmin, or Q6_K's d at the end
SCALES = {"Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}


@pytest.mark.parametrize("qtype", ["Q4_K", "Q5_K", "Q6_K"])
def test_k_quant_dequantize_equals_gguf_py_bit_for_bit(qtype: str) -> None:
    """Random super-blocks (every bit pattern of quants and 6-bit scales), finite fp16 scales."""
    rng = np.random.default_rng(0)
    n, nbytes = 48, BLOCKS[qtype][1]
    raw = rng.integers(0, 256, (n, nbytes), dtype=np.uint8)
    for at in SCALES[qtype]:
        raw[:, at : at + 2] = (rng.standard_normal(n) * 0.02).astype(np.float16).view(np.uint8).reshape(n, 2)
    raw[5, SCALES[qtype][0] : SCALES[qtype][0] + 2] = 0  # a zero scale
    shape = (6, n * 256 // 6)
    ref = gguf.quants.dequantize(raw.reshape(shape[0], -1), gguf.GGMLQuantizationType[qtype]).astype(np.float32)
    ours = dequantize(qtype, split_blocks(raw.reshape(-1), qtype, shape), shape).numpy()
    assert ours.shape == ref.shape and ours.view(np.uint32).tobytes() == ref.view(np.uint32).tobytes()


@pytest.fixture(scope="module")
def f32_base(tmp_path_factory: pytest.TempPathFactory, smollm2: GGUFFile) -> tuple[Path, Llama]:
    """A two-block llama whose matrices are whole 256-weight super-blocks wide, as an f32 GGUF."""
    pytest.importorskip("llama_cpp")
    cfg = TransformerConfig(
        vocab_size=49152, d_model=256, n_layer=2, n_head=4, n_kv_head=2, d_ff=512, context_length=64
    )
    model = Llama(cfg)
    init_weights(model, 0.1, 0)
    path = tmp_path_factory.mktemp("kq") / "f32.gguf"
    return export_llama(model, path, donor_tokenizer_metadata(smollm2), {}, "f32"), model


@pytest.mark.parametrize(("mix", "types"), [("q4_k_m", {"Q4_K", "Q6_K"}), ("q5_k_m", {"Q5_K", "Q6_K"})])
def test_qlora_on_a_llamacpp_k_quant_base(tmp_path: Path, f32_base, mix: str, types: set[str]) -> None:
    """The base keeps its K-quant blocks, computes what the dequantized base computes, trains its
    adapters only, and the adapter exports (llama.cpp GGUF) and merges as on any other base."""
    path = llamacpp_quantize(f32_base[0], tmp_path / f"{mix}.gguf", mix)
    dense, _ = load_llama(path)
    model, _ = load_base(path, "qlora")
    layers = [m for m in model.modules() if isinstance(m, QuantLinear)]
    assert types <= {m.ggml_type for m in layers} and len(layers) == 14
    assert not any(isinstance(m, torch.nn.Linear) for m in model.modules())
    x = torch.randint(0, 49152, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(model(x), dense(x))
    packed = {n: b.clone() for n, b in model.named_buffers()}
    attach_lora(model, LoraConfig(rank=4, alpha=8.0, targets=("q", "v", "down"), dropout=0.0))
    opt = make_optimizer(model, OptimConfig(lr=1e-2))
    for _ in range(2):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model.loss(x[:, :-1], x[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    assert all(torch.equal(b, packed[n.replace(".base.", ".")]) for n, b in model.named_buffers())
    with torch.no_grad():
        adapted = model(x)
    adapter = read_adapter_gguf(save_adapter_gguf(model, tmp_path / "adapter.gguf"))
    apply_adapter(dense, adapter)
    with torch.no_grad():
        assert (dense(x) - adapted).abs().max() < 1e-4
        merged = merge_lora(model)
        torch.testing.assert_close(merged(x), adapted, atol=1e-4, rtol=1e-4)
