"""`train.compile` (auto | true | false): the whole forward as one graph without a graph break, when it
compiles, the eager fallback when compilation fails, and the plain model handed on after training."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from pipeline.config import TrainConfig
from pipeline.errors import ConfigError
from pipeline.models.gpt2 import GPT2
from pipeline.models.llama import Llama
from pipeline.models.transformer import TransformerConfig, init_weights
from pipeline.training.runtime import CompiledOrEager, compile_wanted, eager_after, speed_switches

CFG = TransformerConfig(vocab_size=300, d_model=64, n_layer=2, n_head=4, n_kv_head=2, d_ff=128, context_length=64)
CPU, CUDA = torch.device("cpu"), torch.device("cuda")  # names only: nothing here runs on CUDA


@pytest.mark.parametrize("arch", [Llama, GPT2])
@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_the_whole_forward_is_one_graph_without_a_break(arch: type, precision: str) -> None:
    """torch._dynamo.explain over `hidden` with gradients on (a training step's forward): one graph."""
    model = arch(replace(CFG, arch="gpt2") if arch is GPT2 else CFG)
    init_weights(model, 0.02, 0)
    idx = torch.randint(0, CFG.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
        explained = torch._dynamo.explain(model.hidden)(idx)
    assert explained.graph_break_count == 0, [str(r.reason)[:200] for r in explained.break_reasons]
    assert explained.graph_count == 1


@pytest.mark.parametrize(
    ("value", "device", "wanted"),
    [("auto", CUDA, True), ("auto", CPU, False), ("true", CPU, True), ("false", CUDA, False)],
)
def test_auto_compiles_where_cuda_is(value: str, device: torch.device, wanted: bool) -> None:
    assert compile_wanted(TrainConfig(compile=value), device) is wanted


@pytest.mark.parametrize(("given", "kept"), [(True, "true"), (False, "false"), ("AUTO", "auto")])
def test_a_bool_from_the_command_line_reads_as_its_switch(given: object, kept: str) -> None:
    tcfg = TrainConfig(compile=given, cuda_graph=given)
    assert tcfg.compile == tcfg.cuda_graph == kept


def test_another_value_is_refused_naming_the_key() -> None:
    with pytest.raises(ConfigError, match="train.cuda_graph.*one of auto, true, false"):
        TrainConfig(cuda_graph="sometimes")


def test_windows_compile_the_whole_forward_and_packed_rows_each_block() -> None:
    """One process on token windows: `hidden` becomes one compiled callable, the blocks stay plain modules;
    packed rows (or several processes): each block compiles instead. After the run, the plain method."""
    tcfg = TrainConfig(compile="true")
    whole, blocks = Llama(CFG), Llama(CFG)
    speed_switches(whole, tcfg, CPU, windows=True)
    speed_switches(blocks, tcfg, CPU, windows=False)
    assert isinstance(vars(whole).get("hidden"), CompiledOrEager)
    assert all(getattr(b, "_compiled_call_impl", None) is None for b in whole.blocks)
    assert "hidden" not in vars(blocks) and all(b._compiled_call_impl is not None for b in blocks.blocks)
    with eager_after(whole):
        pass
    assert "hidden" not in vars(whole) and whole.hidden.__func__ is Llama.hidden


def test_a_failed_compilation_runs_eagerly_with_a_warning(caplog) -> None:
    """A compile error (here the one dynamo raises for an internal failure) makes that call, and every later
    one, the eager function's, with one warning; an error of the function itself is not swallowed."""
    calls = []

    def fn(x: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        if x.sum() < 0:
            raise ValueError("the model's own error")
        return x * 2

    run = CompiledOrEager(fn, "the test function")

    def broken(*args):
        raise torch._dynamo.exc.InternalTorchDynamoError("no C compiler found")

    run.compiled = broken
    assert torch.equal(run(torch.ones(2)), torch.full((2,), 2.0))
    assert run.compiled is None and "the test function runs eagerly (InternalTorchDynamoError" in caplog.text
    assert torch.equal(run(torch.ones(2)), torch.full((2,), 2.0)) and len(calls) == 2
    with pytest.raises(ValueError, match="own error"):
        run(-torch.ones(2))


@pytest.mark.slow
def test_the_compiled_forward_trains_like_the_eager_one() -> None:
    """Two fp32 steps through the compiled whole forward: the eager losses and gradients to 1e-5."""
    torch.manual_seed(0)
    idx, tgt = (torch.randint(0, CFG.vocab_size, (2, 32)) for _ in range(2))
    results = []
    for compiled in (False, True):
        model = Llama(CFG)
        init_weights(model, 0.02, 0)
        if compiled:
            speed_switches(model, TrainConfig(compile="true"), CPU, windows=True)
        loss = model.loss(idx, tgt)
        results.append((loss.detach(), torch.autograd.grad(loss, list(model.parameters()))))
    (a, ga), (b, gb) = results
    assert torch.allclose(a, b, atol=1e-5)
    assert all(torch.allclose(x, y, atol=1e-5) for x, y in zip(ga, gb))
