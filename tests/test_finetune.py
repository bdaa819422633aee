"""Fine-tuning through the stage functions on a tiny base GGUF with the SmolLM2 tokenizer: instruct
packing, lora/qlora/full realize, the one training loop (response-only loss, segment-masked
packing, frozen base, adapter-only optimizer, resume), the three exports, and evaluate's base vs
tuned numbers. The real SmolLM2 runs through DVC in test_e2e."""

from __future__ import annotations

import copy
import json
import shutil
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from pipeline.config import (
    DataConfig,
    EvaluateConfig,
    LoraConfig,
    OptimConfig,
    PipelineConfig,
    RecipeConfig,
    TrainConfig,
)
from pipeline.data.pack import run_pack
from pipeline.data.packed import load_meta, load_rows, load_split
from pipeline.errors import ConfigError, DataError, GGUFError
from pipeline.evaluate.evaluate_text import run_evaluate
from pipeline.export.exporter import ExportPlan, run_export
from pipeline.finetune.adapters import read_adapter_gguf, read_peft_adapter
from pipeline.finetune.lora import lora_layers
from pipeline.finetune.quant import QuantLinear, dequantize_model
from pipeline.gguf.reader import GGUFFile
from pipeline.gguf.writer import write_gguf
from pipeline.inference.generate import load_for_generation
from pipeline.init.realize import realize_finetune
from pipeline.modeldir import load_model_dir, read_spec
from pipeline.models.gpt2 import GPT2
from pipeline.models.llama import Llama
from pipeline.models.llama_gguf import export_llama, gguf_tensors, llama_metadata
from pipeline.models.ops.losses import IGNORE_INDEX
from pipeline.models.registry import build_model, load_gguf
from pipeline.models.transformer import TransformerConfig, init_weights
from pipeline.tokenizer.pretokenizers import donor_tokenizer_metadata
from pipeline.training.loop import TrainJob
from pipeline.training.resume import plan_checkpoints
from pipeline.training.trainer import TrainInputs, run_train
from pipeline.training.validation import validation_loss
from tests.helpers import masked_cross_entropy

CFG = TransformerConfig(vocab_size=49152, d_model=64, n_layer=2, n_head=4, n_kv_head=2, d_ff=128, context_length=128)


@dataclass
class Base:
    dir: Path
    f32: Path
    q8: Path
    jsonl: Path


def examples(n: int) -> list[dict]:
    out = []
    for i in range(n):
        if i % 3 == 0:
            out.append(
                {"messages": [{"role": "user", "content": f"Name {i}?"}, {"role": "assistant", "content": "Ok."}]}
            )
        else:
            out.append({"prompt": f"What is {i} plus {i}?", "response": f"It is {2 * i}."})
    return out


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory, smollm2: GGUFFile) -> Base:
    d = tmp_path_factory.mktemp("finetune")
    model = Llama(CFG)
    init_weights(model, 0.05, 0)
    tok_meta = donor_tokenizer_metadata(smollm2)  # SmolLM2's tokenizer and chat template
    f32 = export_llama(model, d / "base.gguf", tok_meta, {"general.name": "tiny-base"}, "f32")
    meta = {"general.type": "model", **llama_metadata(CFG, "f32"), **tok_meta}
    q8 = write_gguf(d / "base-q8.gguf", "llama", meta, gguf_tensors(model), ggml_type="Q8_0")
    jsonl = d / "train.jsonl"
    jsonl.write_text("".join(json.dumps(e) + "\n" for e in examples(24)))
    return Base(d, f32, q8, jsonl)


def data_cfg(base: Base, **kw) -> DataConfig:
    return DataConfig(**{"source": "instruct", "path": str(base.jsonl), "val_fraction": 0.25, "max_seq_len": 64, **kw})


def tcfg(**kw) -> TrainConfig:
    defaults = dict(steps=4, batch_size=2, seq_len=64, eval_every=2, log_every=1, checkpoint_every=2, threads=1)
    return TrainConfig(**{**defaults, **kw})


RECIPES = {
    "lora": RecipeConfig(name="lora", init="base", trainable="lora", lora=LoraConfig(rank=4, alpha=8.0, dropout=0.0)),
    "qlora": RecipeConfig(
        name="qlora", init="base", trainable="lora", quantized=True, lora=LoraConfig(rank=4, targets=["q", "k", "v"])
    ),
    "full": RecipeConfig(name="full-finetune", init="base", trainable="all"),
}
OPTIM = {"lora": OptimConfig(lr=1e-2, warmup_steps=1), "full": OptimConfig(lr=1e-3, warmup_steps=1)}


@dataclass
class Run:
    dir: Path
    base_path: Path
    packed: Path
    result: object


def run_recipe(root: Path, base_path: Path, packed: Path, recipe: str, **train_kw) -> Run:
    init, out = root / "init", root / "train"
    if not init.exists():
        realize_finetune(RECIPES[recipe], base_path, load_meta(packed).vocab_size, init)
    t = tcfg(**train_kw)
    optim = OPTIM["full" if recipe == "full" else "lora"]
    plan = plan_checkpoints(t, optim, 0, init, packed, root / "checkpoints")
    result = run_train(TrainInputs(init, packed, out), TrainJob(t, optim, 0, plan=plan))
    return Run(root, base_path, packed, result)


@pytest.fixture(scope="module")
def packed(tmp_path_factory: pytest.TempPathFactory, base: Base) -> Path:
    """The instruct rows every recipe trains on (packed once: the 49k-token tokenizer takes seconds)."""
    out = tmp_path_factory.mktemp("packed") / "packed"
    run_pack(data_cfg(base), base.f32, out)
    return out


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory: pytest.TempPathFactory, base: Base, packed: Path) -> Run:
    return run_recipe(tmp_path_factory.mktemp("lora"), base.f32, packed, "lora")


# ----- the model side: response-only loss, packing without cross-example attention -----


def test_model_loss_ignores_prompt_targets_and_equals_the_masked_cross_entropy() -> None:
    small = TransformerConfig(vocab_size=50, d_model=32, n_layer=1, n_head=2, n_kv_head=1, d_ff=64, context_length=32)
    model = Llama(small)
    init_weights(model, 0.1, 0)
    x = torch.randint(0, 50, (2, 12), generator=torch.Generator().manual_seed(0))
    y = torch.randint(0, 50, (2, 12), generator=torch.Generator().manual_seed(1))
    y[:, :5] = IGNORE_INDEX  # the prompt
    with torch.no_grad():
        plain = model.loss(x, y)
        reference = masked_cross_entropy(model(x), y)
    chunked = model.loss(x, y)  # the grad path: chunked head + CE on the labelled rows only
    torch.testing.assert_close(plain, reference)
    torch.testing.assert_close(chunked.detach(), reference, atol=1e-5, rtol=1e-5)
    other_prompt = x.clone()
    other_prompt[:, 0] = (x[:, 0] + 1) % 50  # a prompt token: it is input, never a target
    y_prompt = y.clone()
    y_prompt[:, :5] = IGNORE_INDEX
    with torch.no_grad():
        assert model.loss(x, y_prompt).item() == plain.item()
        y_resp = y.clone()
        y_resp[0, 8] = (y[0, 8] + 1) % 50
        assert model.loss(x, y_resp).item() != plain.item()


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_packed_row_loss_equals_each_example_alone(arch: str) -> None:
    """Attention and positions stay inside each packed example: RoPE is relative, gpt2's learned
    positions restart at 0 per example."""
    small = TransformerConfig(
        vocab_size=50, d_model=32, n_layer=2, n_head=2, n_kv_head=1 if arch == "llama" else 2, d_ff=64,
        context_length=32, arch=arch,
    )  # fmt: skip
    model = build_model(small).double()
    init_weights(model, 0.1, 0)
    g = torch.Generator().manual_seed(0)
    a, b = torch.randint(0, 50, (7,), generator=g), torch.randint(0, 50, (9,), generator=g)
    ya, yb = torch.randint(0, 50, (7,), generator=g), torch.randint(0, 50, (9,), generator=g)
    ya[:3] = IGNORE_INDEX
    yb[:4] = IGNORE_INDEX
    x = torch.cat([a, b, torch.zeros(4, dtype=torch.long)])[None]
    y = torch.cat([ya, yb, torch.full((4,), IGNORE_INDEX)])[None]
    seg = torch.tensor([[1] * 7 + [2] * 9 + [0] * 4])
    with torch.no_grad():
        packed = model.loss(x, y, seg).item()
        alone_a, alone_b = model.loss(a[None], ya[None]).item(), model.loss(b[None], yb[None]).item()
        unmasked = model.loss(x, y).item()
    expected = (alone_a * 4 + alone_b * 5) / 9
    assert abs(packed - expected) < 1e-6  # fp32 softmax and RoPE angles
    assert abs(unmasked - expected) > 1e-4  # without the mask the second example sees the first


# ----- the stages' library functions -----


def test_instruct_pack_writes_rows_and_counts_truncation(tmp_path: Path, base: Base) -> None:
    meta, metrics = run_pack(data_cfg(base), base.f32, tmp_path / "packed")
    assert meta.format == "instruct" and meta.seq_len == 64 and meta.vocab_size == CFG.vocab_size
    assert metrics["examples_train"] + metrics["examples_val"] == 24 and metrics["examples_val"] == 6
    assert metrics["chat_template"] == 1.0 and metrics["truncated_train"] == 0
    train = load_rows(tmp_path / "packed" / "train.npz")
    assert train.input_ids.shape[1] == 64 and (train.labels != IGNORE_INDEX).sum() == metrics["label_tokens_train"]
    assert len((tmp_path / "packed" / "val.jsonl").read_text().splitlines()) == 6
    _, short = run_pack(data_cfg(base, max_seq_len=40, pack=False), base.f32, tmp_path / "short")
    assert short["truncated_train"] > 0  # the chat template's default system prompt alone is ~30 tokens


def test_malformed_instruct_line_is_named_and_nothing_is_written(tmp_path: Path, base: Base) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a", "response": "b"}\n{"prompt": "c"}\n')
    with pytest.raises(DataError, match=r"bad\.jsonl line 2"):
        run_pack(replace(data_cfg(base), path=str(bad)), base.f32, tmp_path / "packed")
    assert not (tmp_path / "packed").exists()


def test_lora_trains_only_adapters_and_leaves_the_base_bit_identical(lora_run: Run) -> None:
    result = lora_run.result
    trained = load_model_dir(lora_run.dir / "train")
    base, _ = load_gguf(lora_run.base_path)
    base_state = base.state_dict()
    assert any(isinstance(m, QuantLinear) for m in trained.modules())  # lora keeps the base in its file's blocks
    for name, t in dequantize_model(copy.deepcopy(trained)).state_dict().items():
        if ".lora_" not in name:
            assert torch.equal(t, base_state[name.replace(".base.", ".")]), name
    assert all(m.lora_B.abs().sum() > 0 for m in lora_layers(trained).values())  # adapters moved off zero
    names = set(result.optimizer_state["state"])
    assert names and all(".lora_" in n for n in names)  # Adam moments only for adapter tensors
    saved = load_file(str(lora_run.dir / "train" / "adapter.safetensors"))
    assert set(saved) == {n for n, p in trained.named_parameters() if p.requires_grad}
    assert not (lora_run.dir / "train" / "model.safetensors").exists()  # the base is not copied
    rows = [h for h in result.history if "epoch" in h]
    assert rows and rows[-1]["epoch"] == pytest.approx(4 * 2 / len(load_rows(lora_run.packed / "train.npz").input_ids))
    assert all(h["grad_norm"] > 0 for h in result.history)
    assert result.initial_val_loss is not None and result.final_val_loss < result.initial_val_loss


def test_lora_step_zero_equals_the_base(lora_run: Run) -> None:
    init = load_model_dir(lora_run.dir / "init").eval()
    base, _ = load_gguf(lora_run.base_path)
    x = torch.randint(0, CFG.vocab_size, (1, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(init(x), base(x))


def test_lora_resume_equals_an_uninterrupted_run(tmp_path: Path, lora_run: Run) -> None:
    # resume the uninterrupted run's own step-2 checkpoint and finish it in a new directory
    ckpt_root = next((lora_run.dir / "checkpoints").iterdir())
    step2 = ckpt_root / "step-00000002"
    assert step2.is_dir()
    t = tcfg(resume=str(step2))
    plan = plan_checkpoints(t, OPTIM["lora"], 0, lora_run.dir / "init", lora_run.packed, tmp_path / "ck2")
    inputs = TrainInputs(lora_run.dir / "init", lora_run.packed, tmp_path / "resumed")
    resumed = run_train(inputs, TrainJob(t, OPTIM["lora"], 0, plan=plan))
    a = load_file(str(tmp_path / "resumed" / "adapter.safetensors"))
    b = load_file(str(lora_run.dir / "train" / "adapter.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    # every logged number after the resume point too, per-epoch perplexity included (not the timing)
    def logged(history: list[dict]) -> list[dict]:
        return [{k: v for k, v in h.items() if k != "tokens_per_second"} for h in history if h["step"] > 2]

    assert logged(resumed.history) == logged(lora_run.result.history)


def test_epoch_perplexity_survives_a_resume_mid_epoch(tmp_path: Path, base: Base, packed: Path) -> None:
    """The epoch in progress at a checkpoint keeps its train losses: its perplexity after a resume
    is the uninterrupted run's."""
    whole = run_recipe(
        tmp_path / "whole", base.f32, packed, "lora", steps=12, checkpoint_every=4, eval_every=12, keep_checkpoints=3
    )
    ends = [h for h in whole.result.history if "epoch_train_ppl" in h]
    assert ends and 4 < ends[0]["step"] < 12  # an epoch ends after the step-4 checkpoint
    step4 = next((tmp_path / "whole" / "checkpoints").iterdir()) / "step-00000004"
    t = tcfg(steps=12, checkpoint_every=4, eval_every=12, resume=str(step4))
    plan = plan_checkpoints(t, OPTIM["lora"], 0, tmp_path / "whole" / "init", packed, tmp_path / "ck")
    resumed = run_train(
        TrainInputs(tmp_path / "whole" / "init", packed, tmp_path / "resumed"), TrainJob(t, OPTIM["lora"], 0, plan=plan)
    )
    again = [h for h in resumed.history if "epoch_train_ppl" in h]
    assert [h["epoch_train_ppl"] for h in again] == [h["epoch_train_ppl"] for h in ends]


def test_the_card_names_the_adapters_base_file(lora_run: Run, tmp_path: Path) -> None:
    """The card said `llama-cli -m base.gguf --lora adapter.gguf`, a file name no one has."""
    donor = tmp_path / "My-Base-1M.Q8_0.gguf"
    shutil.copyfile(lora_run.base_path, donor)
    run_export(lora_run.dir / "train", donor, tmp_path / "export", ExportPlan("f32"), {})
    card = (tmp_path / "export" / "README.md").read_text()
    assert "llama-cli -m My-Base-1M.Q8_0.gguf --lora adapter.gguf" in card and "base.gguf" not in card


def test_the_adapter_gguf_carries_the_models_name_and_base_model(lora_run: Run, tmp_path: Path) -> None:
    """adapter.gguf had no general.name nor general.base_model.*: it now has the merged model's, as
    convert_lora_to_gguf.py writes them, and stays an adapter whatever the provenance keys say."""
    run_export(
        lora_run.dir / "train", lora_run.base_path, tmp_path / "export", ExportPlan("f32"), {"general.type": "model"}
    )
    model = GGUFFile(tmp_path / "export" / "model.gguf").metadata
    adapter = GGUFFile(tmp_path / "export" / "adapter.gguf").metadata
    base_keys = {k: v for k, v in model.items() if k.startswith("general.base_model.")}
    assert model["general.base_model.count"] == 1 and "general.base_model.0.name" in base_keys
    assert {k: adapter.get(k) for k in base_keys} == base_keys
    assert adapter["general.name"] == model["general.name"] and adapter["general.name"]
    assert (adapter["general.type"], adapter["adapter.type"], adapter["adapter.lora.alpha"]) == ("adapter", "lora", 8.0)


def test_lora_exports_and_evaluate_reports_base_and_tuned(lora_run: Run, base: Base) -> None:
    out = lora_run.dir / "export"
    metrics = run_export(lora_run.dir / "train", lora_run.base_path, out, ExportPlan("f32"), {"general.name": "tuned"})
    named = {p.name for p in out.iterdir()} - {"model.gguf", "adapter.gguf", "peft", "README.md"}
    assert len(named) == 1 and named.pop().endswith("-F32.gguf")  # the conventional name, a link to model.gguf
    assert metrics["adapter_bytes"] < metrics["file_bytes"] / 10
    trained = load_model_dir(lora_run.dir / "train")
    adapter = read_adapter_gguf(out / "adapter.gguf")
    assert adapter.rank == 4 and adapter.alpha == 8.0 and adapter.targets == ("q", "v")
    for name, t in adapter.state.items():
        assert torch.equal(t, dict(trained.named_parameters())[name].detach())
    base_name = json.loads((out / "peft" / "adapter_config.json").read_text())["base_model_name_or_path"]
    assert base_name == "base" and str(lora_run.base_path.parent) not in base_name  # portable: no local path
    peft = read_peft_adapter(out / "peft", trained.cfg)
    assert all(torch.equal(t, adapter.state[n]) for n, t in peft.state.items())
    cfg = PipelineConfig(
        data=data_cfg(base),
        recipe=RECIPES["lora"],
        train=TrainConfig(seq_len=64, batch_size=2, device="cpu"),
        evaluate=EvaluateConfig(prompts=["a", "b"], max_new_tokens=3),
    )
    metrics, samples = run_evaluate(out / "model.gguf", lora_run.packed, lora_run.dir / "train", cfg, base.f32)
    assert metrics["val_loss_abs_diff"] < 1e-3  # the merged GGUF reproduces base+adapter
    assert metrics["base_val_loss"] == pytest.approx(lora_run.result.initial_val_loss, abs=1e-5)
    assert metrics["val_loss_improvement"] == pytest.approx(metrics["base_val_loss"] - metrics["val_loss"])
    assert len(samples) == 2 and {"prompt", "reference", "tuned", "base"} <= set(samples[0])


def test_generate_applies_an_adapter_on_its_base_as_llama_cpp_does(tmp_path: Path, lora_run: Run, base: Base) -> None:
    """`generate lora=adapter.gguf` (or a PEFT dir) on the base computes what the merged export does."""
    out = tmp_path / "export"
    run_export(lora_run.dir / "train", lora_run.base_path, out, ExportPlan("f32"), {})
    x = torch.randint(0, CFG.vocab_size, (1, 16), generator=torch.Generator().manual_seed(0))
    merged, _, _ = load_for_generation(str(out / "model.gguf"))
    plain, _, _ = load_for_generation(str(base.f32))
    with torch.no_grad():
        want = merged.eval()(x)
        assert (plain.eval()(x) - want).abs().max() > 1e-5  # the adapter changes the model
        for adapter in (out / "adapter.gguf", out / "peft"):
            adapted, _, _ = load_for_generation(str(base.f32), lora=str(adapter))
            torch.testing.assert_close(adapted.eval()(x), want, atol=1e-4, rtol=0)
    with pytest.raises(ConfigError, match="lora="):
        load_for_generation(str(base.f32), lora=str(tmp_path / "missing.gguf"))


def test_qlora_keeps_the_quantized_blocks_and_trains(tmp_path: Path, base: Base, packed: Path) -> None:
    run = run_recipe(tmp_path, base.q8, packed, "qlora", steps=2, checkpoint_every=0)
    model = load_model_dir(tmp_path / "train")
    quant = [m for m in model.modules() if isinstance(m, QuantLinear)]
    assert len(quant) == CFG.n_layer * 7 and all(m.ggml_type == "Q8_0" for m in quant)
    assert read_spec(tmp_path / "train").mode == "qlora"
    assert set(run.result.optimizer_state["state"]) == {n for n, p in model.named_parameters() if p.requires_grad}
    trained_b = [p for n, p in model.named_parameters() if n.endswith("lora_B")]  # B starts at 0: step 0 is the base
    assert trained_b and all(p.abs().max() > 0 for p in trained_b)
    assert run.result.final_val_loss != run.result.initial_val_loss  # the adapters moved the held-out loss
    reloaded = validation_loss(model, load_rows(packed / "val.npz"), 64, 2, torch.device("cpu"))
    assert reloaded == pytest.approx(run.result.kept_val_loss, abs=1e-5)  # the saved directory is what trained
    run_export(tmp_path / "train", run.base_path, tmp_path / "export", ExportPlan("q8_0"), {"general.name": "merged"})
    assert GGUFFile(tmp_path / "export" / "model.gguf").raw_tensor("blk.0.attn_q.weight")[1] == "Q8_0"


def test_full_finetune_trains_every_weight(tmp_path: Path, base: Base, packed: Path) -> None:
    run = run_recipe(tmp_path, base.f32, packed, "full", steps=2, checkpoint_every=0)
    trained = load_model_dir(tmp_path / "train")
    before, _ = load_gguf(base.f32)
    changed = [n for n, t in before.state_dict().items() if not torch.equal(t, trained.state_dict()[n])]
    assert len(changed) == len(before.state_dict())
    assert (tmp_path / "train" / "model.safetensors").exists()
    assert run.result.final_val_loss < run.result.initial_val_loss - 0.01  # held-out loss below the base's
    run_export(tmp_path / "train", run.base_path, tmp_path / "export", ExportPlan("f32"), {"general.name": "full"})
    assert not (tmp_path / "export" / "adapter.gguf").exists()
    again, _ = load_gguf(tmp_path / "export" / "model.gguf")
    assert all(torch.equal(t, again.state_dict()[n]) for n, t in trained.state_dict().items())


def test_lora_on_running_text(tmp_path: Path, base: Base) -> None:
    """recipe=lora with text data: continued pre-training through adapters, windows of train.seq_len."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n---\n".join(f"Document {i}: the for statement iterates over items." for i in range(40)))
    run_pack(DataConfig(source="text", path=str(corpus)), base.f32, tmp_path / "packed")
    run = run_recipe(tmp_path, base.f32, tmp_path / "packed", "lora", steps=2, seq_len=16, checkpoint_every=0)
    assert run.result.initial_val_loss is None  # running text: no step-0 validation
    assert (tmp_path / "train" / "adapter.safetensors").exists()
    plain, _ = load_gguf(base.f32)  # the base alone on the same val windows: the adapters must beat it
    before = validation_loss(plain.eval(), load_split(tmp_path / "packed", "val"), 16, 2, torch.device("cpu"))
    assert run.result.final_val_loss < before - 0.01


# ----- bad input -----


def test_recipe_config_errors_name_the_key() -> None:
    with pytest.raises(ConfigError, match="recipe.init"):
        RecipeConfig(init="pca", trainable="lora")
    with pytest.raises(ConfigError, match="recipe.quantized"):
        RecipeConfig(init="base", trainable="all", quantized=True)
    with pytest.raises(ConfigError, match="recipe.lora.rank"):
        LoraConfig(rank=0)
    with pytest.raises(ConfigError, match="recipe.lora.targets"):
        LoraConfig(targets=["q", "attn"])
    with pytest.raises(ConfigError, match="data.max_seq_len"):
        DataConfig(source="instruct", max_seq_len=1)
    with pytest.raises(ConfigError, match="data.max_seq_len"):
        PipelineConfig(data=DataConfig(source="instruct", max_seq_len=4096))  # > llama-tiny's context
    PipelineConfig(data=DataConfig(source="instruct", max_seq_len=4096), recipe=RecipeConfig(init="base"))


def test_rank_wider_than_a_layer_is_named(tmp_path: Path, base: Base) -> None:
    recipe = replace(RECIPES["lora"], lora=LoraConfig(rank=65))
    with pytest.raises(ConfigError, match="recipe.lora.rank"):
        realize_finetune(recipe, base.f32, CFG.vocab_size, tmp_path / "init")
    assert not (tmp_path / "init").exists()


def test_unsupported_base_architecture_is_named(tmp_path: Path, smollm2: GGUFFile) -> None:
    from pipeline.models.gpt2_gguf import export_gpt2

    small = replace(CFG, arch="gpt2", n_kv_head=4)
    path = export_gpt2(GPT2(small), tmp_path / "gpt2.gguf", donor_tokenizer_metadata(smollm2), {}, "f32")
    with pytest.raises(GGUFError, match=r"general\.architecture.*recipe=lora"):
        realize_finetune(RECIPES["lora"], path, CFG.vocab_size, tmp_path / "init")


def test_changed_base_file_is_refused(tmp_path: Path, base: Base) -> None:
    copy = tmp_path / "base.gguf"
    copy.write_bytes(base.f32.read_bytes())
    realize_finetune(RECIPES["lora"], copy, CFG.vocab_size, tmp_path / "init")
    with open(copy, "r+b") as f:
        f.seek(-4, 2)
        f.write(b"\x00\x00\x00\x40")  # output_norm ends in 1.0 (0x3f800000): make it 2.0
    with pytest.raises(ConfigError, match="fingerprint"):
        load_model_dir(tmp_path / "init")


def test_vocab_mismatch_between_data_and_base_is_named(tmp_path: Path, base: Base) -> None:
    with pytest.raises(ConfigError, match="packed data's vocab"):
        realize_finetune(RECIPES["lora"], base.f32, 32000, tmp_path / "init")


def test_instruct_rows_longer_than_the_context_are_named(tmp_path: Path, base: Base) -> None:
    packed = tmp_path / "packed"
    run_pack(data_cfg(base, max_seq_len=256), base.f32, packed)  # the tiny base's context is 128
    realize_finetune(RECIPES["lora"], base.f32, CFG.vocab_size, tmp_path / "init")
    with pytest.raises(ConfigError, match="data.max_seq_len"):
        run_train(TrainInputs(tmp_path / "init", packed, tmp_path / "train"), TrainJob(tcfg(), OPTIM["lora"], 0))
    assert np.load(packed / "train.npz")["input_ids"].shape[1] == 256
