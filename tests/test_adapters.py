"""Adapter exports agree with our base+adapter: the merged GGUF, transformers+PEFT, and llama.cpp's
--lora on the base GGUF; adapters that do not fit a base fail with the tensor named."""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch

from pipeline.config import LoraConfig
from pipeline.errors import AdapterError, GGUFError
from pipeline.finetune.adapters import (
    apply_adapter,
    export_merged_gguf,
    read_adapter_gguf,
    read_peft_adapter,
    save_adapter_gguf,
    save_peft_adapter,
)
from pipeline.finetune.lora import attach_lora, lora_layers
from pipeline.finetune.model import load_base
from pipeline.gguf.reader import GGUFFile
from pipeline.gguf.writer import write_gguf
from pipeline.modeldir import save_model_dir
from pipeline.models.llama import Llama
from pipeline.models.llama_gguf import export_llama, gguf_tensors, llama_metadata, load_llama
from pipeline.models.transformer import TransformerConfig, init_weights
from pipeline.tokenizer.pretokenizers import donor_tokenizer_metadata

CFG = TransformerConfig(vocab_size=49152, d_model=64, n_layer=2, n_head=4, n_kv_head=2, d_ff=128, context_length=128)
ALL = ("q", "k", "v", "o", "gate", "up", "down")
RANK, ALPHA = 4, 8.0


pytestmark = pytest.mark.usefixtures("one_thread")


@dataclass
class Setup:
    dir: Path
    base_path: Path  # with the SmolLM2 tokenizer, for transformers and llama.cpp
    plain_path: Path  # the same weights without tokenizer metadata: quick for our own reader
    model: Llama  # base + adapter (non-trivial B)
    tok_meta: dict
    x: torch.Tensor


def randomize_b(model: torch.nn.Module, seed: int = 1, std: float = 0.5) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in lora_layers(model).values():
            m.lora_B.normal_(0.0, std, generator=g)


def logprobs(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(model(x).double(), -1)


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory, smollm2: GGUFFile) -> Setup:
    d = tmp_path_factory.mktemp("adapters")
    base = Llama(CFG)
    init_weights(base, 0.05, 0)
    tok_meta = donor_tokenizer_metadata(smollm2)
    base_path = export_llama(base, d / "base.gguf", tok_meta, {"general.name": "tiny-base"}, "f32")
    plain_path = export_llama(base, d / "plain.gguf", {}, {"general.name": "tiny-base"}, "f32")
    model, _ = load_base(plain_path, "lora")
    attach_lora(model, LoraConfig(rank=RANK, alpha=ALPHA, targets=ALL, dropout=0.0))
    randomize_b(model)
    model.eval()
    x = torch.randint(0, CFG.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    return Setup(d, base_path, plain_path, model, tok_meta, x)


def test_adapter_changes_the_model(setup: Setup) -> None:
    base, _ = load_llama(setup.plain_path)
    assert (logprobs(base, setup.x) - logprobs(setup.model, setup.x)).abs().max() > 0.5


def test_merged_export_equals_base_plus_adapter(setup: Setup) -> None:
    path = export_merged_gguf(setup.model, setup.dir / "merged.gguf", {}, {"general.name": "merged"})
    merged, g = load_llama(path)
    diff = (logprobs(merged, setup.x) - logprobs(setup.model, setup.x)).abs().max().item()
    assert diff < 1e-3
    assert g.metadata["general.type"] == "model" and lora_layers(setup.model)  # the source model is untouched


def test_gguf_adapter_layout_and_round_trip(setup: Setup) -> None:
    path = save_adapter_gguf(setup.model, setup.dir / "adapter.gguf", {"general.name": "tiny-lora"})
    g = GGUFFile(path)
    assert g.architecture == "llama"
    assert (g.metadata["general.type"], g.metadata["adapter.type"]) == ("adapter", "lora")
    assert g.metadata["adapter.lora.alpha"] == ALPHA
    assert len(g.tensor_names()) == 2 * 7 * CFG.n_layer
    info = {n: g.tensor_info(n) for n in g.tensor_names()}
    assert info["blk.0.attn_q.weight.lora_a"].shape == (RANK, 64)  # (r, in)
    assert info["blk.0.attn_k.weight.lora_b"].shape == (32, RANK)  # (out, r), GQA: 2 kv heads x 16
    assert info["blk.1.ffn_down.weight.lora_a"].shape == (RANK, 128)
    assert info["blk.1.ffn_up.weight.lora_b"].shape == (128, RANK)
    assert all(i.ggml_type == "F32" for i in info.values())
    adapter = read_adapter_gguf(path)
    assert (adapter.rank, adapter.alpha, adapter.targets) == (RANK, ALPHA, ALL)
    again, _ = load_llama(setup.plain_path)
    apply_adapter(again, adapter)
    assert torch.equal(logprobs(again, setup.x), logprobs(setup.model, setup.x))


@pytest.fixture(scope="module")
def hf_base(setup: Setup):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("peft")
    os.environ["HF_HUB_OFFLINE"] = "1"
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(setup.dir), gguf_file="base.gguf", dtype=torch.float32)
    return hf.eval()


def test_peft_loads_our_adapter_with_equal_logprobs(setup: Setup, hf_base) -> None:
    import peft

    out = save_peft_adapter(setup.model, setup.dir / "peft", base_model=str(setup.base_path))
    config = json.loads((out / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["peft_type"]) == (RANK, ALPHA, "LORA")
    assert config["target_modules"] == ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    model = peft.PeftModel.from_pretrained(hf_base, str(out)).eval()
    try:
        with torch.no_grad():
            theirs = torch.log_softmax(model(setup.x).logits.double(), -1)
        diff = (theirs - logprobs(setup.model, setup.x)).abs().max().item()
        assert diff < 1e-3
        # without the q/k row permutation the adapter would compute something else
        assert lora_layers(setup.model)["blocks.0.attn.wq"].lora_B.abs().sum() > 0
    finally:
        model.unload()


def test_exported_peft_adapter_loads_on_another_machine(setup: Setup, hf_base, tmp_path: Path) -> None:
    """The export names its base hub-style (from the donor's general.* keys and file name), never by a
    local path: the adapter dir copied elsewhere (the original deleted) loads in peft and in our loader."""
    import peft

    from pipeline.export.naming import donor_identity
    from pipeline.inference.generate import load_for_generation

    base_name = donor_identity(GGUFFile(setup.base_path)).model_id
    made = save_peft_adapter(setup.model, setup.dir / "peft-shipped", base_model=base_name)
    moved = tmp_path / "elsewhere" / "adapter"
    shutil.copytree(made, moved)
    shutil.rmtree(made)
    name = peft.PeftConfig.from_pretrained(str(moved)).base_model_name_or_path
    assert name == base_name and not Path(name).is_absolute() and str(setup.dir) not in name
    want = logprobs(setup.model, setup.x)
    model = peft.PeftModel.from_pretrained(hf_base, str(moved)).eval()
    try:
        with torch.no_grad():
            assert (torch.log_softmax(model(setup.x).logits.double(), -1) - want).abs().max().item() < 1e-3
    finally:
        model.unload()
    ours, _, _ = load_for_generation(str(setup.base_path), lora=str(moved))
    assert (logprobs(ours.eval(), setup.x) - want).abs().max().item() < 1e-4


def test_exported_weights_are_readable_by_others_as_any_written_file(setup: Setup, tmp_path: Path) -> None:
    """safetensors keeps its temp file's 0o600: a copied `peft/` (or model dir) was unreadable to a
    server run as another user. Both get the mode a plain open() gives, as the GGUFs beside them do."""

    mask = os.umask(0o022)
    try:
        peft_dir = save_peft_adapter(setup.model, tmp_path / "peft", base_model="org/base")
        (tmp_path / "dir").mkdir()
        save_model_dir(tmp_path / "dir", Llama(setup.model.cfg))
        for path in (peft_dir / "adapter_model.safetensors", tmp_path / "dir" / "model.safetensors"):
            assert path.stat().st_mode & 0o777 == 0o644, path
    finally:
        os.umask(mask)


def test_peft_saved_adapter_reads_back_into_ours(setup: Setup, hf_base, tmp_path: Path) -> None:
    import peft

    cfg = peft.LoraConfig(r=2, lora_alpha=6, target_modules=["q_proj", "k_proj", "down_proj"], lora_dropout=0.0)
    model = peft.get_peft_model(hf_base, cfg)
    try:
        g = torch.Generator().manual_seed(3)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0.0, 0.5, generator=g)
        model.eval()
        model.save_pretrained(str(tmp_path))
        with torch.no_grad():
            theirs = torch.log_softmax(model(setup.x).logits.double(), -1)
    finally:
        model.unload()
    adapter = read_peft_adapter(tmp_path, CFG)
    assert (adapter.rank, adapter.alpha, adapter.targets) == (2, 6.0, ("q", "k", "down"))
    ours, _ = load_llama(setup.plain_path)
    apply_adapter(ours, adapter)
    assert (logprobs(ours, setup.x) - theirs).abs().max().item() < 1e-3


def _greedy(llama_cpp, n: int, prompt: list[int], **kwargs) -> list[int]:
    llm = llama_cpp.Llama(n_ctx=64, n_threads=1, verbose=False, logits_all=True, **kwargs)
    llm.eval(prompt)
    out = []
    for _ in range(n):
        tok = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        out.append(tok)
        llm.eval([tok])
    return out


def test_llamacpp_base_plus_gguf_adapter_equals_merged(setup: Setup) -> None:
    llama_cpp = pytest.importorskip("llama_cpp")
    adapter = save_adapter_gguf(setup.model, setup.dir / "adapter_lc.gguf")
    merged = export_merged_gguf(setup.model, setup.dir / "merged_lc.gguf", setup.tok_meta, {})
    prompt = setup.x[0, :8].tolist()
    with_lora = _greedy(llama_cpp, 12, prompt, model_path=str(setup.base_path), lora_path=str(adapter))
    assert with_lora == _greedy(llama_cpp, 12, prompt, model_path=str(merged))
    assert with_lora != _greedy(llama_cpp, 12, prompt, model_path=str(setup.base_path))


def test_qlora_adapter_exports_match(setup: Setup) -> None:
    """A QLoRA run's adapter applies to the dequantized base exactly; its merge is dense and equal."""
    path = write_gguf(
        setup.dir / "q8.gguf",
        "llama",
        {"general.type": "model", **llama_metadata(CFG, "f32")},
        gguf_tensors(load_llama(setup.plain_path)[0]),
        ggml_type="Q8_0",
    )
    q, _ = load_base(path, "qlora")
    attach_lora(q, LoraConfig(rank=RANK, alpha=ALPHA, targets=("q", "v"), dropout=0.0))
    randomize_b(q, seed=5)
    adapter_path = save_adapter_gguf(q, setup.dir / "q_adapter.gguf")
    dense, _ = load_base(path, "lora")
    apply_adapter(dense, read_adapter_gguf(adapter_path))
    assert torch.equal(logprobs(dense, setup.x), logprobs(q, setup.x))
    merged, g = load_llama(export_merged_gguf(q, setup.dir / "q_merged.gguf", {}, {}))
    assert g.tensor_info("blk.0.ffn_up.weight").ggml_type == "F32"
    assert (logprobs(merged, setup.x) - logprobs(q, setup.x)).abs().max().item() < 1e-3


# ----- bad input -----


def test_adapter_on_base_with_other_shapes_names_the_tensor(setup: Setup, tmp_path: Path) -> None:
    adapter = read_adapter_gguf(save_adapter_gguf(setup.model, tmp_path / "a.gguf"))
    narrow = Llama(TransformerConfig(**{**CFG.__dict__, "d_model": 32, "d_ff": 64}))
    with pytest.raises(
        AdapterError, match=r"tensor blk\.0\.attn_q\.weight\.lora_a: expected shape \(4, 32\).*found shape \(4, 64\)"
    ):
        apply_adapter(narrow, adapter)
    shallow = Llama(TransformerConfig(**{**CFG.__dict__, "n_layer": 1}))
    with pytest.raises(AdapterError, match=r"tensor blk\.1\..*expected a layer index below the base's 1 layers"):
        apply_adapter(shallow, adapter)


def test_not_an_adapter_file_is_named(setup: Setup, tmp_path: Path) -> None:
    with pytest.raises(GGUFError, match=r"general.type: expected 'adapter', found 'model'"):
        read_adapter_gguf(setup.plain_path)
    with pytest.raises(AdapterError, match="adapter_config.json: expected a PEFT adapter file"):
        read_peft_adapter(tmp_path, CFG)


def spoil(peft_dir: Path, how: str) -> str:
    """Spoil a saved PEFT adapter one way; returns the part of the error line that names it."""
    weights, config = peft_dir / "adapter_model.safetensors", peft_dir / "adapter_config.json"
    if how == "garbage":
        weights.write_bytes(os.urandom(256))
        return "adapter_model.safetensors: expected LoRA weights in safetensors format, found not a readable"
    if how == "truncated":
        weights.write_bytes(weights.read_bytes()[:-100])
        return "adapter_model.safetensors: expected LoRA weights in safetensors format"
    if how == "config-list":
        config.write_text("[1, 2]")
        return "adapter_config.json: expected a JSON object, found list"
    if how == "config-bytes":
        config.write_bytes(b'{"peft_type": "LORA", "r": 4, "x": "\xff\xfe"}')
        return "adapter_config.json: expected a JSON object, found unreadable"
    if how == "alpha":
        config.write_text(json.dumps({**json.loads(config.read_text()), "lora_alpha": "8"}))
        return "adapter_config.json lora_alpha: expected a number >= 0, found '8'"
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(weights))
    name = next(n for n in sorted(tensors) if "layers.0.self_attn.q_proj.lora_A" in n)
    tensors[name] = torch.zeros(RANK, CFG.d_model + 8)  # wrong-shaped for this base (other in_features)
    save_file(tensors, str(weights))
    return f"tensor {name}: expected shape ({RANK}, {CFG.d_model})"


@pytest.mark.parametrize("how", ["garbage", "truncated", "config-list", "config-bytes", "alpha", "shape"])
def test_a_corrupt_or_foreign_peft_adapter_is_one_named_line(setup: Setup, tmp_path: Path, how: str) -> None:
    from pipeline.inference.generate import load_for_generation

    peft_dir = save_peft_adapter(setup.model, tmp_path / "peft", base_model=str(setup.base_path))
    named = spoil(peft_dir, how)
    with pytest.raises(AdapterError) as info:
        load_for_generation(str(setup.base_path), lora=str(peft_dir))
    assert named in str(info.value) and "\n" not in str(info.value), str(info.value)
    assert "fix: " in str(info.value)


@pytest.mark.slow
def test_generate_with_a_garbage_peft_adapter_exits_2_with_one_line(setup: Setup, tmp_path: Path) -> None:
    import subprocess
    import sys

    from tests.conftest import ROOT

    peft_dir = save_peft_adapter(setup.model, tmp_path / "peft", base_model=str(setup.base_path))
    named = spoil(peft_dir, "garbage")
    cmd = [sys.executable, "-m", "stages.generate", f"model_path={setup.base_path}", "prompt=hi", f"lora={peft_dir}"]
    cmd += [f"hydra.run.dir={tmp_path / 'run'}"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    (line,) = [x for x in proc.stderr.splitlines() if x.startswith("error:")]
    assert named in line
