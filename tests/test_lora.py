"""LoRA/QLoRA on a frozen GGUF base: step 0 equals the base, only adapters train, merging is exact,
QLoRA's torch dequantization equals gguf-py's bit for bit, and bad recipes fail with named errors."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from pipeline.config import LoraConfig, OptimConfig
from pipeline.errors import AdapterError, ConfigError, GGUFError
from pipeline.finetune import quant
from pipeline.finetune.lora import (
    LoRALinear,
    attach_lora,
    load_lora_state_dict,
    lora_layers,
    lora_state_dict,
    merge_lora,
)
from pipeline.finetune.lora_cpu import dropout as lora_dropout
from pipeline.finetune.model import load_base, prepare_training
from pipeline.finetune.quant import (
    QuantEmbedding,
    QuantLinear,
    dequantize,
    dequantize_model,
    load_quantized_base,
    split_blocks,
)
from pipeline.gguf.reader import GGUFFile
from pipeline.gguf.writer import write_gguf
from pipeline.models.gpt2 import GPT2
from pipeline.models.llama import Llama
from pipeline.models.llama_gguf import gguf_tensors, llama_metadata, load_llama
from pipeline.models.transformer import TransformerConfig, init_weights
from pipeline.training.optim import make_optimizer
from tests.conftest import write_tiny_gguf
from tests.helpers import lora_parameters

CFG = TransformerConfig(vocab_size=96, d_model=64, n_layer=2, n_head=4, n_kv_head=2, d_ff=128, context_length=64)
ALL = ("q", "k", "v", "o", "gate", "up", "down")


pytestmark = pytest.mark.usefixtures("one_thread")


def tiny(seed: int = 0) -> Llama:
    m = Llama(CFG)
    init_weights(m, 0.05, seed)
    return m


def batch(seed: int = 0, n: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    t = torch.randint(0, CFG.vocab_size, (2, n + 1), generator=torch.Generator().manual_seed(seed))
    return t[:, :-1], t[:, 1:]


def write_tiny_base(path: Path, qtype: str = "f32", seed: int = 0) -> Path:
    m = tiny(seed)
    meta = {"general.type": "model", **llama_metadata(CFG, "f32")}
    if qtype == "f32":
        return write_gguf(path, "llama", meta, gguf_tensors(m))
    return write_gguf(path, "llama", meta, gguf_tensors(m), ggml_type=qtype)


def adam_steps(model: torch.nn.Module, n: int = 3) -> torch.optim.Optimizer:
    opt = make_optimizer(model, OptimConfig(lr=1e-2, weight_decay=0.1))
    for step in range(n):
        x, y = batch(step)
        model.loss(x, y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return opt


# ----- LoRA -----


def test_step0_equals_base_and_only_adapters_train() -> None:
    model = tiny()
    x, _ = batch()
    with torch.no_grad():
        before = model(x)
    base_state = {k: v.clone() for k, v in model.state_dict().items()}
    paths = attach_lora(model, LoraConfig(rank=4, alpha=8, dropout=0.1, targets=ALL))
    assert paths[:2] == ["blocks.0.attn.wq", "blocks.0.attn.wk"] and len(paths) == 7 * CFG.n_layer
    model.eval()
    with torch.no_grad():
        assert torch.equal(model(x), before)  # B = 0: bit-identical to the base
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert {id(p) for p in trainable} == {id(p) for p in lora_parameters(model)}
    model.train()
    opt = adam_steps(model)
    # the optimizer's state is the adapters' and nothing else
    assert {id(p) for p in opt.state} == {id(p) for p in lora_parameters(model)}
    # every base tensor is bit-identical; the adapters moved
    for name, m in lora_layers(model).items():
        assert torch.equal(m.base.weight, base_state[f"{name}.weight"])
        assert m.lora_B.abs().sum() > 0
    for name, t in model.state_dict().items():
        if "lora_" not in name:
            assert torch.equal(t, base_state[name.replace(".base.", ".")]), name
    model.eval()
    with torch.no_grad():
        assert not torch.equal(model(x), before)


def test_merge_folds_adapters_into_plain_weights() -> None:
    model = tiny()
    attach_lora(model, LoraConfig(rank=4, alpha=16, targets=("q", "v", "down"), dropout=0.0))
    with torch.no_grad():
        for m in lora_layers(model).values():
            m.lora_B.normal_(0, 0.05, generator=torch.Generator().manual_seed(1))
    x, _ = batch(3)
    with torch.no_grad():
        adapted = model(x)
        merged = merge_lora(model)
        assert not lora_layers(merged)
        assert set(merged.state_dict()) == set(tiny().state_dict())
        torch.testing.assert_close(merged(x), adapted, atol=1e-5, rtol=1e-5)


def test_lora_state_dict_round_trip_and_shape_mismatch() -> None:
    a = tiny()
    attach_lora(a, LoraConfig(rank=2, targets=("q", "k"), dropout=0.0))
    with torch.no_grad():
        for p in lora_parameters(a):
            p.normal_(0, 0.1)
    state = lora_state_dict(a)
    assert sorted(state)[:2] == ["blocks.0.attn.wk.lora_A", "blocks.0.attn.wk.lora_B"]
    b = tiny()
    attach_lora(b, LoraConfig(rank=2, targets=("q", "k"), init_seed=9, dropout=0.0))
    load_lora_state_dict(b, state)
    x, _ = batch()
    with torch.no_grad():
        assert torch.equal(a(x), b(x))
    c = tiny()
    attach_lora(c, LoraConfig(rank=3, targets=("q", "k"), dropout=0.0))
    with pytest.raises(
        AdapterError, match=r"blocks\.0\.attn\.wq\.lora_A: expected shape \(3, 64\).*found shape \(2, 64\)"
    ):
        load_lora_state_dict(c, state)


def test_init_is_seeded_and_scaled() -> None:
    def a_of(cfg: LoraConfig) -> torch.Tensor:
        m = tiny()
        attach_lora(m, cfg)
        return lora_layers(m)["blocks.1.attn.wv"].lora_A.detach()

    base = a_of(LoraConfig(init_seed=1, dropout=0.0))
    assert torch.equal(base, a_of(LoraConfig(init_seed=1, dropout=0.0)))
    assert not torch.equal(base, a_of(LoraConfig(init_seed=2, dropout=0.0)))
    torch.testing.assert_close(a_of(LoraConfig(init_seed=1, init_scale=0.5, dropout=0.0)), base * 0.5)
    assert base.abs().max() <= 1 / 8  # U(-1/sqrt(in), 1/sqrt(in)), in = 64


@pytest.mark.parametrize(
    ("kwargs", "pattern"),
    [
        ({"rank": 0}, "lora.rank: expected an integer >= 1"),
        ({"rank": -2}, "lora.rank"),
        ({"targets": ("q", "qkv")}, r"lora.targets.*unknown: \['qkv'\]"),
        ({"targets": ()}, "lora.targets"),
        ({"dropout": 1.0}, "lora.dropout"),
    ],
)
def test_bad_lora_config_is_named(kwargs: dict, pattern: str) -> None:
    with pytest.raises(ConfigError, match=pattern):
        LoraConfig(**kwargs)


def test_rank_above_layer_width_and_double_attach_are_named() -> None:
    with pytest.raises(ConfigError, match=r"lora.rank: expected at most the width of blocks.0.attn.wk \(32x64\): 32"):
        attach_lora(tiny(), LoraConfig(rank=33, targets=("k",), dropout=0.0))
    m = tiny()
    attach_lora(m, LoraConfig(rank=2, dropout=0.0))
    with pytest.raises(ConfigError, match=r"blocks.0.attn.wq.*found LoRALinear"):
        attach_lora(m, LoraConfig(rank=2, dropout=0.0))
    # a target the model does not have as a linear layer
    m = tiny()
    m.blocks[1].attn.wk = torch.nn.Identity()
    with pytest.raises(
        ConfigError, match=r"lora.targets \(blocks.1.attn.wk\): expected a plain linear layer.*Identity"
    ):
        attach_lora(m, LoraConfig(rank=2, targets=("q", "k"), dropout=0.0))
    assert all(p.requires_grad for p in m.parameters())  # nothing was changed
    with pytest.raises(ConfigError, match="model config arch: expected an architecture recipe=lora supports"):
        attach_lora(GPT2(replace(CFG, arch="gpt2")), LoraConfig(dropout=0.0))


def test_unsupported_base_architecture_is_named(tmp_path: Path) -> None:
    path = write_tiny_gguf(tmp_path / "gpt2.gguf", arch="gpt2")
    for recipe, mode in (("lora", "lora"), ("qlora", "qlora"), ("full-finetune", "full")):
        with pytest.raises(
            GGUFError, match=rf"general.architecture: expected an architecture recipe={recipe} supports"
        ):
            load_base(path, mode)


def test_full_finetune_trains_every_parameter(tmp_path: Path) -> None:
    model, _ = load_base(write_tiny_base(tmp_path / "b.gguf"), "full")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    assert all(p.requires_grad for p in model.parameters())
    opt = adam_steps(model, 2)
    assert len(opt.state) == len(list(model.parameters()))
    assert all(not torch.equal(v, before[k]) for k, v in model.state_dict().items())


# ----- QLoRA -----


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "F16", "BF16"])
def test_torch_dequantize_equals_gguf_py_bit_for_bit(qtype: str) -> None:
    w = np.random.default_rng(0).standard_normal((48, 96)).astype(np.float32) * 0.1
    w[3, :32] = 0.0  # an all-zero block
    qt = gguf.GGMLQuantizationType[qtype]
    raw = gguf.quants.quantize(w, qt)
    ref = gguf.quants.dequantize(raw, qt).astype(np.float32)
    ours = dequantize(qtype, split_blocks(raw.reshape(-1).view(np.uint8), qtype, w.shape), w.shape).numpy()
    assert ours.view(np.uint32).tobytes() == ref.view(np.uint32).tobytes()


def test_unsupported_quant_type_is_named() -> None:
    with pytest.raises(GGUFError, match=r"blk.0.attn_q.weight: expected a tensor type QLoRA keeps quantized.*Q6_K"):
        split_blocks(np.zeros(110, np.uint8), "Q3_K", (1, 256), "blk.0.attn_q.weight")


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_1"])
def test_quantized_base_equals_dequantized_base(tmp_path: Path, qtype: str) -> None:
    path = write_tiny_base(tmp_path / f"{qtype}.gguf", qtype)
    dense, _ = load_llama(path)
    q = load_quantized_base(path)
    blocks = [m for m in q.modules() if isinstance(m, QuantLinear)]
    assert len(blocks) == 7 * CFG.n_layer and all(b.ggml_type == qtype for b in blocks)
    assert not any(isinstance(m, torch.nn.Linear) for m in q.modules())
    assert not any(p.requires_grad for p in q.parameters())
    x, y = batch()
    with torch.no_grad():
        assert torch.equal(q(x), dense(x))  # same fp32 weights, same matmuls
    # input gradients through the re-dequantizing backward equal the dense layer's
    layer, ref = q.blocks[0].ffn.up, dense.blocks[0].ffn.up
    xin = torch.randn(3, 5, 64, requires_grad=True)
    layer(xin).square().sum().backward()
    g_q = xin.grad.clone()
    xin.grad = None
    ref(xin).square().sum().backward()
    torch.testing.assert_close(g_q, xin.grad, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_K"])
def test_token_table_stays_in_its_blocks(tmp_path: Path, qtype: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A quantized base keeps its token table in the file's blocks: a lookup rebuilds exactly the looked-up
    rows; the tied head is the exact fp32 table outside autocast and its bf16 rounding inside (rebuilt a
    few rows at a time, or recipe=lora's cached copy); dequantizing gives back an nn.Embedding."""
    path = write_tiny_base(tmp_path / f"{qtype}.gguf", qtype)
    dense, _ = load_llama(path)
    q = load_quantized_base(path)
    table, ref = q.tok_embd, dense.tok_embd.weight.detach()
    assert isinstance(table, QuantEmbedding) and table.ggml_type == GGUFFile(path).raw_tensor("token_embd.weight")[1]
    assert not torch.equal(ref, tiny().tok_embd.weight)  # quantization really changed the table
    idx = torch.tensor([[3, 0, 7, 3], [CFG.vocab_size - 1, 5, 5, 1]])
    assert torch.equal(table(idx), ref[idx])
    monkeypatch.setattr(quant, "ROWS_AT_ONCE", 7)  # several chunks and a ragged last one
    assert torch.equal(table.weight, ref)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.equal(table.weight, ref.to(torch.bfloat16))
    x, y = batch()
    with torch.no_grad():
        assert torch.equal(q(x), dense(x))
    prepare_training(q, "lora", torch.bfloat16)
    assert table.cached is not None and torch.equal(table.cached, ref.to(torch.bfloat16))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert table.weight is table.cached
    plain = dequantize_model(q)
    assert isinstance(plain.tok_embd, torch.nn.Embedding) and torch.equal(plain.tok_embd.weight, ref)


def test_qlora_trains_adapters_only_and_keeps_blocks(tmp_path: Path) -> None:
    path = write_tiny_base(tmp_path / "q4.gguf", "Q4_0")
    model, _ = load_base(path, "qlora")
    x, _ = batch()
    with torch.no_grad():
        before = model(x)
    packed = {n: b.clone() for n, b in model.named_buffers()}
    attach_lora(model, LoraConfig(rank=4, alpha=8, targets=ALL, dropout=0.0))
    with torch.no_grad():
        assert torch.equal(model(x), before)
    opt = adam_steps(model, 3)
    assert {id(p) for p in opt.state} == {id(p) for p in lora_parameters(model)}
    for n, b in model.named_buffers():
        assert torch.equal(b, packed[n.replace(".base.", ".")]), n
    # bf16 autocast runs through the quantized matmuls too
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model.loss(*batch(7))
    loss.backward()
    assert torch.isfinite(loss) and all(p.grad is not None for p in lora_parameters(model))
    # merging a QLoRA model gives plain fp32 linears equal to base + adapter
    with torch.no_grad():
        adapted = model(x)
        merged = merge_lora(model)
        assert all(isinstance(m.attn.wq, torch.nn.Linear) for m in merged.blocks)
        torch.testing.assert_close(merged(x), adapted, atol=1e-5, rtol=1e-5)


def test_adapter_dropout_drops_p_of_inputs_and_masks_the_gradient() -> None:
    """The kept entries are returned unscaled with the factor 1/(1-p) the caller owes them; under bf16
    autocast the output is the bf16 cast (the gradient comes back in the input's dtype)."""
    x = torch.randn(400, 500, requires_grad=True)
    torch.manual_seed(0)
    y, factor = lora_dropout(x, 0.05, True)
    dropped = y == 0
    assert abs(dropped.float().mean().item() - 0.05) < 0.003  # 200k draws: 5 sigma is 0.0024
    assert factor == pytest.approx(1 / 0.95) and torch.equal(y[~dropped], x[~dropped])
    y.sum().backward()
    assert torch.equal(x.grad == 0, dropped) and torch.equal(x.grad[~dropped], torch.ones(int((~dropped).sum())))
    torch.manual_seed(0)
    assert torch.equal(lora_dropout(x, 0.05, True)[0], y)  # seeded: a resumed run draws the same masks
    assert all(lora_dropout(x, p, on)[0] is x for p, on in ((0.05, False), (0.0, True)))
    torch.manual_seed(0)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        half, _ = lora_dropout(x, 0.05, True)
    assert half.dtype == torch.bfloat16 and torch.equal(half, y.bfloat16())
    x.grad = None
    half.float().sum().backward()
    assert x.grad.dtype == torch.float32 and torch.equal(x.grad == 0, dropped)


@pytest.mark.parametrize("autocast", [False, True])
def test_cpu_projection_equals_autograd_of_the_unfused_adapter(autocast: bool) -> None:
    """`LoRALinear` over a frozen `QuantLinear` on CPU runs as one autograd step: its output and its
    gradients (input, A, B) equal autograd's graph of base + B A dropout(x) bit for bit, dropout on and
    off, and with an input that needs no gradient (the first block's)."""
    g = torch.Generator().manual_seed(0)
    base = QuantLinear(48, 40, "F32", {"w": torch.randn(40, 48, generator=g) / 7})
    layer = LoRALinear(base, rank=4, alpha=8, dropout=0.1)
    with torch.no_grad():
        layer.lora_A.normal_(generator=g), layer.lora_B.normal_(generator=g)
    x0, grad = torch.randn(3, 50, 48, generator=g), torch.randn(3, 50, 40, generator=g)

    def unfused(x: torch.Tensor) -> torch.Tensor:
        kept, factor = lora_dropout(x, layer.p, layer.training)
        return base(x) + F.linear(F.linear(kept, layer.lora_A) * (layer.scaling * factor), layer.lora_B)

    outputs = {}
    for training, needs_grad in ((True, True), (False, True), (True, False)):
        layer.train(training)
        results = []
        for run in (unfused, layer):
            x = x0.clone().requires_grad_(needs_grad)
            torch.manual_seed(5)  # the same dropout mask for both
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                y = run(x)
            wrt = [layer.lora_A, layer.lora_B] + ([x] if needs_grad else [])
            results.append((y, *torch.autograd.grad(y, wrt, grad.to(y.dtype))))
        assert all(torch.equal(a, b) for a, b in zip(*results))
        outputs[training] = results[1][0]
    assert not torch.equal(outputs[True], outputs[False])  # dropout was on


def test_lora_matmul_cache_equals_qlora_and_keeps_fp32_exact(tmp_path: Path) -> None:
    """recipe=lora holds qlora's blocks plus one bf16 copy for bf16 matmuls: its losses and gradients
    equal qlora's exactly, fp32 matmuls still rebuild the exact weights, and the copy is no saved state."""
    path = write_tiny_base(tmp_path / "q8.gguf", "Q8_0")
    models = [load_base(path, mode)[0] for mode in ("lora", "qlora")]
    for m in models:
        attach_lora(m, LoraConfig(rank=4, alpha=8, targets=ALL, dropout=0.0))
        with torch.no_grad():
            for p in lora_parameters(m):
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    lora, qlora = models
    prepare_training(lora, "lora", torch.bfloat16)
    prepare_training(qlora, "qlora", torch.bfloat16)
    layer = lora.blocks[0].ffn.up.base
    assert layer.cached.dtype == torch.bfloat16 and qlora.blocks[0].ffn.up.base.cached is None
    assert qlora.tok_embd.cached.dtype == torch.bfloat16  # qlora keeps only its token table's copy
    assert layer.weight_as(torch.bfloat16) is layer.cached
    assert torch.equal(layer.weight_as(torch.float32), layer.dequantize())
    assert not any("cached" in k for k in lora.state_dict())
    x, y = batch(7)
    losses = []
    for m in models:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            losses.append(m.loss(x, y))
        losses[-1].backward()
    assert torch.equal(*losses)
    for a, b in zip(lora_parameters(lora), lora_parameters(qlora)):
        assert torch.equal(a.grad, b.grad)
    with torch.no_grad():  # fp32 (validation): the exact weights, not the bf16 copy
        assert torch.equal(lora(x), qlora(x))


@pytest.fixture(scope="module")
def smollm2_qlora(smollm2_path: Path):
    return load_quantized_base(smollm2_path)


def test_smollm2_qlora_base_keeps_its_blocks(smollm2_qlora, smollm2: GGUFFile) -> None:
    model = smollm2_qlora
    wq = model.blocks[3].attn.wq
    assert isinstance(wq, QuantLinear) and wq.ggml_type == "Q4_1"
    ref = smollm2.tensor("blk.3.attn_q.weight")
    assert wq.dequantize().numpy().view(np.uint32).tobytes() == ref.view(np.uint32).tobytes()
    quant_bytes = sum(b.numel() * b.element_size() for b in model.buffers())
    names = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
    stored = sum(smollm2.tensor_info(f"blk.{i}.{n}.weight").n_bytes for i in range(30) for n in names)
    stored += smollm2.tensor_info("token_embd.weight").n_bytes  # the Q8_0 token table (and tied head)
    assert isinstance(model.tok_embd, QuantEmbedding) and model.tok_embd.ggml_type == "Q8_0"
    assert quant_bytes == stored  # the blocks as the file holds them, nothing dense


def test_smollm2_qlora_step0_equals_base(smollm2_qlora) -> None:
    model = smollm2_qlora
    x = torch.tensor([[504, 8572, 1278, 335, 14801, 288, 2523, 260]])
    with torch.no_grad():
        base = model(x)
    attach_lora(model, LoraConfig(rank=8, alpha=16, targets=("q", "k"), dropout=0.0))
    try:
        assert sum(p.numel() for p in model.parameters() if p.requires_grad) == 30 * 8 * (576 + 576 + 576 + 192)
        with torch.no_grad():
            assert torch.equal(model(x), base)
    finally:  # leave the module fixture as it was
        for path, m in lora_layers(model).items():
            parent, attr = path.rsplit(".", 1)
            setattr(model.get_submodule(parent), attr, m.base)
    assert not any(isinstance(m, LoRALinear) for m in model.modules())
