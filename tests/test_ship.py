"""Ship-ready exports: every export type runs in llama.cpp close to f32 and loads in our reader,
K-quants come from llama.cpp's quantizer, names and `general.*` keys follow llama.cpp's convention,
a model card sits beside the file, and evaluate's llama.cpp parity check passes quantized files
and fails a file llama.cpp reads differently from us."""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from pipeline.config import EXPORT_TYPES, ExportConfig
from pipeline.errors import ConfigError, PipelineError
from pipeline.evaluate.parity import compare, llamacpp_logprobs, llamacpp_parity
from pipeline.export.card import article
from pipeline.export.exporter import CARD, MODEL_GGUF, ExportPlan, run_export
from pipeline.export.naming import ShipInfo, data_label, donor_identity
from pipeline.gguf.header import Field
from pipeline.gguf.reader import GGUFFile
from pipeline.gguf.writer import write_model_gguf
from pipeline.modeldir import TrainState, save_model_dir
from pipeline.models.llama import Llama
from pipeline.models.llama_gguf import export_llama, gguf_tensors, llama_metadata, load_llama
from pipeline.models.registry import export_gguf
from pipeline.models.transformer import TransformerConfig, init_weights
from pipeline.tokenizer.pretokenizers import donor_tokenizer_metadata
from stages._run.typed import typed_config
from stages.compose import compose_config
from tests.conftest import write_tiny_gguf

pytestmark = pytest.mark.usefixtures("one_thread")
CFG = TransformerConfig(vocab_size=256, d_model=256, n_layer=2, n_head=4, n_kv_head=2, d_ff=512, context_length=128)
WINDOWS = [np.random.default_rng(s).integers(0, 256, 64).tolist() for s in range(2)]
# export type -> (ggml types its matrices get, bound on mean KL(f32 model || llama.cpp on the file));
# measured: q8_0 2e-4, q6_k 1.6e-3, q5_k_m 4e-3, q5_1/q5_0 5e-3, q4_k_m 1.4e-2, q4_1 1.9e-2, q4_0 2.2e-2
TYPES = {
    "q8_0": ({"Q8_0"}, 2e-3),
    "q5_1": ({"Q5_1", "Q8_0"}, 2e-2),
    "q5_0": ({"Q5_0", "Q8_0"}, 2e-2),
    "q4_1": ({"Q4_1", "Q8_0"}, 6e-2),
    "q4_0": ({"Q4_0", "Q8_0"}, 6e-2),
    "q6_k": ({"Q6_K"}, 1e-2),
    "q5_k_m": ({"Q5_K", "Q6_K"}, 2e-2),
    "q4_k_m": ({"Q4_K", "Q6_K"}, 6e-2),
}


@pytest.fixture(scope="module")
def tok_meta(tmp_path_factory) -> dict:
    """A 256-token byte-level BPE tokenizer llama.cpp loads (pre-tokenizer `default`)."""
    path = write_tiny_gguf(tmp_path_factory.mktemp("tok") / "tok.gguf", vocab=256, width=16, model=True)
    meta = donor_tokenizer_metadata(GGUFFile(path))
    meta["tokenizer.ggml.pre"] = Field("default", 8)
    return meta


@pytest.fixture(scope="module")
def model() -> Llama:
    m = Llama(CFG)
    init_weights(m, 0.05, 0)
    return m.eval()


def test_export_types_choices_and_unknown_type() -> None:
    assert {*TYPES, "f32", "f16", "bf16"} == set(EXPORT_TYPES)
    with pytest.raises(ConfigError) as err:
        ExportConfig(dtype="q3_k")
    message = str(err.value)
    assert (
        message.startswith("config key export.dtype:")
        and "q4_k_m" in message
        and "q4_0" in message
        and "\n" not in message
    )


@pytest.mark.parametrize("dtype", list(TYPES))
def test_each_type_runs_in_llamacpp_close_to_f32(tmp_path: Path, model: Llama, tok_meta: dict, dtype: str) -> None:
    pytest.importorskip("llama_cpp")
    types, bound = TYPES[dtype]
    path = export_llama(model, tmp_path / "m.gguf", tok_meta, {}, dtype)
    ours, g = load_llama(path)
    matrices = {g.tensor_info(n).ggml_type for n in g.tensor_names() if len(g.tensor_info(n).shape) == 2}
    assert matrices == types
    theirs = llamacpp_logprobs(path, WINDOWS)
    vs_f32, parity = compare(model, WINDOWS, theirs), compare(ours, WINDOWS, theirs)
    print(f"{dtype}: KL vs f32 {vs_f32.mean_kl:.1e} (top-1 {vs_f32.top1_agreement:.0%}), vs ours {parity.mean_kl:.1e}")
    assert 0 < vs_f32.mean_kl < bound
    assert parity.mean_kl < 1e-3 and parity.mean_kl < vs_f32.mean_kl  # both sides read the same quantized weights


def test_k_quant_without_llamacpp_is_one_named_line(monkeypatch: pytest.MonkeyPatch) -> None:
    class Hide:
        def find_spec(self, name, path=None, target=None):
            if name == "llama_cpp":
                raise ModuleNotFoundError(name)

    monkeypatch.delitem(sys.modules, "llama_cpp", raising=False)
    monkeypatch.setattr(sys, "meta_path", [Hide(), *sys.meta_path])
    assert ExportConfig(dtype="q4_k_m").dtype == "q4_k_m"  # the schema checks values only, not what is installed
    with pytest.raises(ConfigError) as err:  # every stage checks what the values need, before it runs
        typed_config(compose_config(["export.dtype=q4_k_m"]))
    message = str(err.value)
    assert message.startswith("config key export.dtype:") and "make llamacpp" in message and "\n" not in message
    assert typed_config(compose_config(["export.dtype=q4_0"])).export.dtype == "q4_0"  # gguf-py's own types


def test_export_is_named_by_convention_with_keys_and_card(tmp_path: Path, smollm2: GGUFFile) -> None:
    cfg = TransformerConfig(vocab_size=49152, d_model=64, n_layer=2, n_head=4, n_kv_head=2, d_ff=128, context_length=64)
    m = Llama(cfg)
    init_weights(m, 0.05, 0)
    (tmp_path / "train").mkdir()
    state = TrainState(10, 1000, 3.5, 3.25, 64, 2, mlflow_run_id="abc", initial_val_loss=9.5, kept_step=8)
    save_model_dir(tmp_path / "train", m, train_state=state)
    ship = ShipInfo("lora", "pydoc", finetune=True, version="v1.0", tags=("smollm-pipeline",))
    run_export(tmp_path / "train", smollm2.path, tmp_path / "export", ExportPlan("q8_0", ship), {"pipeline.x": "y"})
    out = tmp_path / "export"
    named = out / "SmolLM2-3.2M-Instruct-lora-pydoc-v1.0-Q8_0.gguf"
    assert {p.name for p in out.iterdir()} == {MODEL_GGUF, CARD, named.name}
    assert os.stat(named).st_ino == os.stat(out / MODEL_GGUF).st_ino  # a hard link: one file on disk
    meta = GGUFFile(named).metadata
    assert meta["general.basename"] == "SmolLM2" and meta["general.size_label"] == "3.2M"
    assert meta["general.finetune"] == "Instruct-lora-pydoc" and meta["general.version"] == "v1.0"
    assert meta["general.license"] == "apache-2.0" and meta["general.tags"] == ["smollm-pipeline"]
    assert meta["general.base_model.0.organization"] == "HuggingFaceTB" and meta["pipeline.x"] == "y"
    assert meta["general.base_model.0.repo_url"] == "https://huggingface.co/HuggingFaceTB/SmolLM2-135M-Instruct"
    assert meta["general.file_type"] == 7 and meta["tokenizer.ggml.pre"] == smollm2.metadata["tokenizer.ggml.pre"]
    text = (out / CARD).read_text()
    front = yaml.safe_load(text.split("---\n")[1])
    assert front["base_model"] == "HuggingFaceTB/SmolLM2-135M-Instruct" and front["library_name"] == "gguf"
    assert front["license"] == "apache-2.0" and front["datasets"] == ["pydoc"]
    values = {r["name"]: r["value"] for r in front["model-index"][0]["results"][0]["metrics"]}
    assert values["validation loss (nats/token) of the exported weights"] == 3.25  # the kept weights' val loss
    assert f"llama-server -m {named.name}" in text and f'gguf_file="{named.name}"' in text
    commands = [line.split("#")[0].strip() for line in text.split("```bash\n")[1].split("```")[0].splitlines()]
    server = commands.index(f"python -m llama_cpp.server --model {named.name}")  # needs the [server] extra
    assert "pip install 'llama-cpp-python[server]'" in commands[:server]
    assert " -md " not in text  # a fine-tune is no draft model: it does not claim to draft for its base


def test_a_students_card_says_how_it_drafts_for_its_donor(tmp_path: Path, smollm2: GGUFFile) -> None:
    cfg = TransformerConfig(vocab_size=49152, d_model=64, n_layer=2, n_head=4, n_kv_head=2, d_ff=128, context_length=64)
    m = Llama(cfg)
    init_weights(m, 0.05, 0)
    (tmp_path / "train").mkdir()
    save_model_dir(tmp_path / "train", m)
    run_export(tmp_path / "train", smollm2.path, tmp_path / "export", ExportPlan("f32", ShipInfo("subclone")), {})
    text = (tmp_path / "export" / CARD).read_text()
    named = next(p.name for p in (tmp_path / "export").iterdir() if p.name not in (MODEL_GGUF, CARD))
    assert f"llama-server -m {smollm2.path.name} -md {named} --draft-max 4" in text


def test_donor_identity_is_the_hub_name(smollm2: GGUFFile) -> None:
    """The packaged donor's keys say basename smollm2 and a run tag as finetune; its file name gives
    the hub repo's casing and variant, and the organization key the owner."""
    ident = donor_identity(smollm2)
    assert ident.model_id == "HuggingFaceTB/SmolLM2-135M-Instruct" and ident.variant == "Instruct"
    assert (ident.basename, ident.size_label, ident.license) == ("SmolLM2", "135M", "apache-2.0")


def _broken_export(path: Path, model: Llama, tok_meta: dict) -> Path:
    """`model` with attn_q/attn_k rows in Hugging Face's order: the classic converter bug, which
    our reader (copying GGUF tensors as they are) and llama.cpp both load without complaint."""
    tensors = gguf_tensors(model)

    def to_hf(w: np.ndarray, heads: int) -> np.ndarray:
        out, d = w.shape
        return w.reshape(heads, out // heads // 2, 2, d).transpose(0, 2, 1, 3).reshape(out, d)

    for i in range(model.cfg.n_layer):
        tensors[f"blk.{i}.attn_q.weight"] = to_hf(tensors[f"blk.{i}.attn_q.weight"], model.cfg.n_head)
        tensors[f"blk.{i}.attn_k.weight"] = to_hf(tensors[f"blk.{i}.attn_k.weight"], model.cfg.n_kv_head)
    return write_model_gguf(path, "llama", llama_metadata(model.cfg, "f32"), tensors, tok_meta, {}, "f32")


def test_parity_passes_a_quantized_export_and_fails_a_broken_one(
    tmp_path: Path, tok_meta: dict, caplog: pytest.LogCaptureFixture
) -> None:
    pytest.importorskip("llama_cpp")
    model = Llama(CFG)
    init_weights(model, 0.1, 1)  # measured: q4_k_m KL 2.6e-3 (top-1 95%), broken 1.85 (top-1 6%)
    val = np.random.default_rng(0).integers(0, 256, 200).astype(np.uint16)  # a token stream, as pack writes
    q4 = export_llama(model, tmp_path / "q4.gguf", tok_meta, {}, "q4_k_m")
    with caplog.at_level(logging.INFO, logger="pipeline.evaluate.parity"):
        metrics = llamacpp_parity(q4, load_llama(q4)[0], val, 64, 2, 0.03)
    assert metrics["llamacpp_tokens"] == 128 and metrics["llamacpp_top1_agreement"] > 0.9
    assert metrics["llamacpp_mean_kl"] < 1e-2 and "top-1 agreement" in caplog.text
    broken = _broken_export(tmp_path / "broken.gguf", model, tok_meta)
    with pytest.raises(PipelineError) as err:
        llamacpp_parity(broken, model.eval(), val, 64, 2, 0.03)
    message = str(err.value)
    assert "evaluate.llamacpp_max_kl=0.03" in message and "fix:" in message and "\n" not in message
    print(message)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="pipeline.evaluate.parity"):
        assert llamacpp_parity(broken, model, val, 64, 0, 0.03) == {}
    assert "skipped (evaluate.llamacpp_windows=0)" in caplog.text


def test_val_windows_of_a_stream_are_evaluates_windows() -> None:
    from pipeline.evaluate.parity import val_windows

    val = np.arange(300, dtype=np.uint16)
    windows = val_windows(val, 64, 10)
    assert len(windows) == 4 and windows[1] == list(range(64, 128))
    assert torch.equal(torch.tensor(windows[0]), torch.arange(64))


def test_parity_on_a_file_llamacpp_cannot_load_is_one_line(tmp_path: Path, model: Llama) -> None:
    pytest.importorskip("llama_cpp")
    path = write_tiny_gguf(tmp_path / "tok.gguf", vocab=256, width=16, model=True)
    tiny = GGUFFile(path)  # its pre-tokenizer `gpt2`, copied verbatim (an export writes `gpt-2`): llama.cpp refuses it
    meta = {k: tiny.typed_field(k) for k in tiny.metadata if k.startswith("tokenizer.")}
    gguf = export_llama(model, tmp_path / "m.gguf", meta, {}, "f32")
    with pytest.raises(PipelineError) as err:
        llamacpp_parity(gguf, model, np.arange(100, dtype=np.uint16), 32, 1, 0.03)
    message = str(err.value)
    assert "expected a GGUF llama.cpp loads" in message and "llamacpp_windows=0" in message and "\n" not in message


def test_the_data_label_drops_a_compression_suffix_then_the_format() -> None:
    assert data_label("jsonl", "corpora/c.jsonl.gz") == "c" and data_label("text", "a.txt.zst") == "a"
    assert data_label("text", "my_notes.v2.txt") == "my-notes.v2" and data_label("dir", "docs/") == "docs"
    assert data_label("pydoc", "") == "pydoc"


def test_an_output_dir_that_cannot_be_written_is_one_named_line(tmp_path: Path, smollm2: GGUFFile) -> None:
    """A read-only models/ (or a file where the folder should be) ended the stage with a traceback."""
    cfg = TransformerConfig(vocab_size=49152, d_model=32, n_layer=1, n_head=2, n_kv_head=1, d_ff=64, context_length=32)
    (tmp_path / "train").mkdir()
    save_model_dir(tmp_path / "train", Llama(cfg))
    blocked = tmp_path / "models"
    blocked.write_text("a file, not a folder")
    outs = [blocked / "export"]
    if os.geteuid() != 0:  # root writes into a 0o555 folder anyway
        (tmp_path / "ro").mkdir(mode=0o555)
        outs.append(tmp_path / "ro" / "export")
    for out in outs:
        with pytest.raises(PipelineError) as err:
            run_export(tmp_path / "train", smollm2.path, out, ExportPlan(), {})
        message = str(err.value)
        assert message.startswith(f"{out}: expected an output path") and "fix: make" in message
        assert "\n" not in message and not out.exists()
    assert blocked.read_text() == "a file, not a folder"
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["train", "models", *(["ro"] if len(outs) > 1 else [])])


@pytest.mark.parametrize("missing", ["config.json", "model.safetensors"])
def test_a_train_dir_missing_a_file_names_the_stage_to_rerun(tmp_path: Path, smollm2: GGUFFile, missing: str) -> None:
    """The fix said 'run the stage that writes it' without naming it; export reads models/train."""
    cfg = TransformerConfig(vocab_size=49152, d_model=32, n_layer=1, n_head=2, n_kv_head=1, d_ff=64, context_length=32)
    train = tmp_path / "models" / "train"
    train.mkdir(parents=True)
    save_model_dir(train, Llama(cfg))
    (train / missing).unlink()
    with pytest.raises(PipelineError) as err:
        run_export(train, smollm2.path, tmp_path / "models" / "export", ExportPlan(), {})
    assert str(err.value) == (
        f"{train / missing}: expected a saved model file, found no such file; "
        "fix: the train stage writes it: re-run `dvc repro -f train`"
    )
    assert not (tmp_path / "models" / "export").exists()


def test_an_unknown_export_type_from_python_is_one_named_line(tmp_path: Path, smollm2: GGUFFile) -> None:
    """run_export / export_gguf with a type no export writes raised a bare KeyError('q3_k')."""

    cfg = TransformerConfig(vocab_size=49152, d_model=32, n_layer=1, n_head=2, n_kv_head=1, d_ff=64, context_length=32)
    (tmp_path / "train").mkdir()
    save_model_dir(tmp_path / "train", Llama(cfg))
    for call in (
        lambda: run_export(tmp_path / "train", smollm2.path, tmp_path / "export", ExportPlan("q3_k"), {}),
        lambda: export_gguf(Llama(cfg), tmp_path / "m.gguf", {}, {}, "q3_k"),
    ):
        with pytest.raises(PipelineError) as err:
            call()
        assert str(err.value).startswith("export.dtype: expected one of f32, ") and "found 'q3_k'" in str(err.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["train"]


@pytest.mark.parametrize(
    ("label", "word"),
    [("11M", "an"), ("8.4B", "an"), ("18M", "an"), ("80M", "an"), ("135M", "a"), ("1.7B", "a"), ("110M", "a")],
)
def test_the_card_reads_its_size_label_aloud(label: str, word: str) -> None:
    """The card said "a 11M student model"."""
    assert article(label) == word
