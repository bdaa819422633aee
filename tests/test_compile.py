"""`train.compile` (auto | true | false): the forward without a graph break, when it compiles (each block),
and the eager fallback when compilation fails."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from pipeline.config import TrainConfig
from pipeline.errors import ConfigError
from pipeline.models.gpt2 import GPT2
from pipeline.models.llama import Llama
from pipeline.models.transformer import TransformerConfig, init_weights
from pipeline.training.runtime import CompiledOrEager, compile_wanted, speed_switches

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


def test_each_block_compiles_in_place() -> None:
    """train.compile=true: each block's call goes through `CompiledOrEager` (as nn.Module.compile would set it),
    the parameter names unchanged; false: plain modules."""
    on, off = Llama(CFG), Llama(CFG)
    speed_switches(on, TrainConfig(compile="true"), CPU)
    speed_switches(off, TrainConfig(compile="false"), CPU)
    assert all(isinstance(b._compiled_call_impl, CompiledOrEager) for b in on.blocks)
    assert all(b._compiled_call_impl is None for b in off.blocks)
    assert list(on.state_dict()) == list(off.state_dict())


def test_a_failed_compilation_runs_eagerly_with_a_warning(caplog) -> None:
    """A compile error (here the one dynamo raises for an internal failure) makes that call, and every later
    one, the eager function's, with one warning; an error of the function itself is not swallowed."""
    calls = []

    def fn(x: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        if x.sum() < 0:
            raise ValueError("the model's own error")
        return x * 2

    run = CompiledOrEager(fn, torch.nn.Identity())

    def broken(*args):
        raise torch._dynamo.exc.InternalTorchDynamoError("no C compiler found")

    run.compiled = broken
    assert torch.equal(run(torch.ones(2)), torch.full((2,), 2.0))
    assert run.compiled is None and "Identity runs eagerly (InternalTorchDynamoError" in caplog.text
    assert torch.equal(run(torch.ones(2)), torch.full((2,), 2.0)) and len(calls) == 2
    with pytest.raises(ValueError, match="own error"):
        run(-torch.ones(2))


@pytest.mark.slow
def test_the_compiled_forward_trains_like_the_eager_one() -> None:
    """An fp32 step through the compiled blocks: the eager loss and gradients to 1e-5."""
    torch.manual_seed(0)
    idx, tgt = (torch.randint(0, CFG.vocab_size, (2, 32)) for _ in range(2))
    results = []
    for compiled in (False, True):
        model = Llama(CFG)
        init_weights(model, 0.02, 0)
        if compiled:
            speed_switches(model, TrainConfig(compile="true"), CPU)
        loss = model.loss(idx, tgt)
        results.append((loss.detach(), torch.autograd.grad(loss, list(model.parameters()))))
    (a, ga), (b, gb) = results
    assert torch.allclose(a, b, atol=1e-5)
    assert all(torch.allclose(x, y, atol=1e-5) for x, y in zip(ga, gb))
