"""export.imatrix: llama.cpp's importance matrix from our forward, its file, and the exports it calibrates."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from pipeline.config import ModelConfig, OptimConfig, TrainConfig
from pipeline.data.packed import PackMeta, write_meta, write_tokens
from pipeline.errors import ConfigError
from pipeline.export.corpus_imatrix import IMATRIX_GGUF, ImatrixSource, imatrix_source
from pipeline.export.exporter import ExportPlan, run_export
from pipeline.gguf.imatrix_format import Imatrix, quantize_gguf, read_imatrix, write_imatrix
from pipeline.gguf.quantize import llamacpp_quantize
from pipeline.gguf.reader import GGUFFile
from pipeline.gguf.writer import write_gguf
from pipeline.init.realize import realize
from pipeline.modeldir import load_model_dir, save_model_dir
from pipeline.models.imatrix import block_matmuls, collect_sums
from pipeline.models.registry import export_gguf, load_gguf
from pipeline.tokenizer.pretokenizers import donor_tokenizer_metadata
from pipeline.training.loop import TrainJob, train
from pipeline.training.qat import ggml_fake_quant, named_targets, use_imatrix
from pipeline.training.trainer import TrainInputs, run_train
from pipeline.training.validation import evaluate_loss
from stages._run.overrides import STAGE_PARAMS
from stages._run.typed import typed_config
from stages.compose import compose_config

llama_cpp = pytest.importorskip("llama_cpp")
pytestmark = pytest.mark.usefixtures("one_thread")
K_TINY = ModelConfig(d_model=256, n_layer=2, n_head=4, n_kv_head=2, d_ff=512, context_length=64)
CPU = torch.device("cpu")


def _imatrix(model: torch.nn.Module, seed: int = 0) -> Imatrix:
    ids = np.random.default_rng(seed).integers(0, 2000, (6, 32))
    sums, tokens = collect_sums(model, ids, 4, CPU)
    return Imatrix(sums, dict.fromkeys(sums, tokens), 6, 32, ["random"], {"pipeline.imatrix.tokens": tokens})


def test_the_statistics_are_llama_imatrixs() -> None:
    """One entry per block matmul (GGUF names), the sum of squared inputs per column over every token:
    q/k/v share theirs, as gate/up do; the forward hooks are gone afterwards."""
    model = realize(K_TINY, "scratch", 2048, 0)
    imx = _imatrix(model)
    names = {f"blk.{i}.{t}.weight" for i in range(2) for t in ("attn_q", "attn_k", "attn_v", "attn_output")}
    names |= {f"blk.{i}.{t}.weight" for i in range(2) for t in ("ffn_gate", "ffn_up", "ffn_down")}
    assert set(imx.sums) == names and set(imx.counts.values()) == {6 * 32}
    assert np.array_equal(imx.sums["blk.1.attn_q.weight"], imx.sums["blk.1.attn_v.weight"])
    assert np.array_equal(imx.sums["blk.0.ffn_gate.weight"], imx.sums["blk.0.ffn_up.weight"])
    assert imx.sums["blk.0.ffn_down.weight"].shape == (512,)
    x = {}
    handle = model.blocks[0].ffn.down.register_forward_pre_hook(lambda _m, a: x.setdefault("in", a[0]))
    with torch.no_grad():
        model.hidden(torch.as_tensor(np.random.default_rng(0).integers(0, 2000, (6, 32))[:4]))
    handle.remove()
    first4 = collect_sums(model, np.random.default_rng(0).integers(0, 2000, (6, 32))[:4], 4, CPU)[0]
    expected = x["in"].double().square().sum((0, 1)).float().numpy()
    np.testing.assert_allclose(first4["blk.0.ffn_down.weight"], expected, rtol=1e-6)
    assert all(not m._forward_pre_hooks for m in block_matmuls(model).values())


def test_the_imatrix_file_round_trips(tmp_path: Path) -> None:
    imx = _imatrix(realize(K_TINY, "scratch", 2048, 0))
    path = write_imatrix(tmp_path / "imatrix.gguf", imx)
    g = GGUFFile(path)
    assert g.metadata["general.type"] == "imatrix" and "general.architecture" not in g.metadata
    assert g.metadata["imatrix.datasets"] == ["random"] and g.metadata["imatrix.chunk_size"] == 32
    assert g.tensor_info("blk.0.attn_q.weight.in_sum2").shape == (1, 256)
    assert g.tensor_info("blk.0.attn_q.weight.counts").shape == (1, 1)
    back = read_imatrix(path)
    assert back.counts == imx.counts and back.chunk_count == 6 and back.extra == imx.extra
    assert all(np.array_equal(back.sums[n], imx.sums[n]) for n in imx.sums)
    w = back.weights()["blk.0.attn_q.weight"]
    assert np.array_equal(w, imx.sums["blk.0.attn_q.weight"] / np.float32(192))


@pytest.fixture(scope="module")
def f32_file(tmp_path_factory: pytest.TempPathFactory, smollm2: GGUFFile) -> tuple[torch.nn.Module, Path]:
    model = realize(K_TINY, "scratch", 49152, 0)
    path = tmp_path_factory.mktemp("imx") / "f32.gguf"
    return model, export_gguf(model, path, donor_tokenizer_metadata(smollm2), {"pipeline.x": 1}, "f32")


@pytest.mark.parametrize("dtype", ["q4_k_m", "q4_0"])
def test_without_an_imatrix_the_file_is_the_usual_one(f32_file, dtype: str, tmp_path: Path) -> None:
    """Tensor for tensor the bytes llama_model_quantize writes (K-quants) or our writer does (Q4_0),
    with the same metadata keys, values and value types."""
    _, f32 = f32_file
    src = GGUFFile(f32)
    if dtype == "q4_0":
        tensors = {n: src.tensor(n) for n in src.tensor_names()}
        meta = {k: src.typed_field(k) for k in src.metadata if k != "general.architecture"}
        ref_path = write_gguf(tmp_path / "ref.gguf", "llama", {**meta, "general.file_type": 2}, tensors, "q4_0")
    else:
        ref_path = llamacpp_quantize(f32, tmp_path / "ref.gguf", dtype)
    ref, mine = GGUFFile(ref_path), GGUFFile(quantize_gguf(f32, tmp_path / "mine.gguf", dtype, None))
    assert sorted(ref.tensor_names()) == sorted(mine.tensor_names())
    for name in ref.tensor_names():
        (a, ta, _), (b, tb, _) = ref.raw_tensor(name), mine.raw_tensor(name)
        assert ta == tb and np.asarray(a).tobytes() == np.asarray(b).tobytes(), name
    assert set(ref.metadata) == set(mine.metadata)
    for key in ref.metadata:
        assert ref.typed_field(key) == mine.typed_field(key), key


def test_an_imatrix_calibrates_the_export_and_llama_cpp_loads_it(f32_file, tmp_path: Path) -> None:
    """With column weights every quantized block tensor changes and its imatrix-weighted error falls;
    the tensors are QAT's fake quant with the same matrix; provenance is in llama.cpp's keys; llama.cpp
    loads and runs the file."""
    model, f32 = f32_file
    imx = _imatrix(model)
    plain = GGUFFile(quantize_gguf(f32, tmp_path / "plain.gguf", "q4_k_m", None))
    calibrated = GGUFFile(quantize_gguf(f32, tmp_path / "imx.gguf", "q4_k_m", imx, "imatrix.gguf"))
    src, weights = GGUFFile(f32), imx.weights()
    errors = []
    for name, w in weights.items():
        assert not np.array_equal(plain.tensor(name), calibrated.tensor(name)), name
        x = src.tensor(name)
        errors.append([float((w * (x - q.tensor(name)) ** 2).sum()) for q in (plain, calibrated)])
    errors = np.array(errors)
    assert (errors[:, 1] < errors[:, 0]).mean() > 0.9 and errors[:, 1].sum() < errors[:, 0].sum()
    assert np.array_equal(plain.tensor("token_embd.weight"), calibrated.tensor("token_embd.weight"))  # no entry
    for p, kind, name in named_targets(model, "q4_k_m"):
        assert torch.equal(
            ggml_fake_quant(p.detach(), kind, weights.get(name)), torch.from_numpy(calibrated.tensor(name))
        )
    meta = calibrated.metadata
    assert meta["quantize.imatrix.file"] == "imatrix.gguf" and meta["quantize.imatrix.dataset"] == "random"
    assert meta["quantize.imatrix.entries_count"] == 14 and meta["quantize.imatrix.chunks_count"] == 6
    assert meta["pipeline.imatrix.tokens"] == 192 and meta["general.file_type"] == 15
    llm = llama_cpp.Llama(model_path=str(tmp_path / "imx.gguf"), vocab_only=False, n_ctx=64, verbose=False)
    llm.eval([1, 2, 3, 4])
    assert np.isfinite(np.asarray(llm.scores[llm.n_tokens - 1])).all()


def test_qat_with_an_imatrix_trains_to_the_calibrated_file(smollm2: GGUFFile, tmp_path: Path) -> None:
    data = np.random.default_rng(0).integers(0, 2000, 6000).astype(np.uint16)
    model = realize(K_TINY, "scratch", 49152, 0)
    imx = _imatrix(model)
    use_imatrix(model, imx.weights())
    tcfg = TrainConfig(steps=4, batch_size=4, seq_len=32, eval_every=2, qat="q4_k_m", qat_start=0.5, keep_best=False)
    result = train(
        model, data[:5000], data[5000:], TrainJob(tcfg, OptimConfig(lr=3e-3, warmup_steps=1), 0, progress=False)
    )
    f32 = export_gguf(model, tmp_path / "f32.gguf", donor_tokenizer_metadata(smollm2), {}, "f32")
    exported, _ = load_gguf(quantize_gguf(f32, tmp_path / "q.gguf", "q4_k_m", imx))
    loss = evaluate_loss(exported, data[5000:], 32, 4, CPU)
    assert loss == pytest.approx(result.final_val_loss, abs=1e-5)


def test_imatrix_refusals_name_the_key() -> None:
    for overrides, key in (
        (["export.imatrix=-1"], "export.imatrix"),
        (["export.imatrix=4096"], "export.dtype"),  # f32: nothing to calibrate
        (["export.imatrix=8", "export.dtype=q4_0"], "export.imatrix"),  # under one train.seq_len window
        (["export.imatrix=4096", "export.dtype=q4_0", "preset=lora"], "export.imatrix"),  # instruct rows
        (["train.qat_imatrix=-1"], "train.qat_imatrix"),
        (["train.qat_imatrix=4096"], "train.qat_imatrix"),  # no train.qat to share it with
        (["train.qat_imatrix=4096", "train.qat=q8_0", "export.dtype=q8_0"], "train.qat_imatrix"),  # q8_0 takes none
        (["train.qat_imatrix=4096", "train.qat=q4_0", "export.dtype=q4_0", "export.imatrix=4096"], "export.imatrix"),
    ):
        with pytest.raises(ConfigError) as err:
            typed_config(compose_config(overrides))
        assert str(err.value).startswith(f"config key {key}:") and "\n" not in str(err.value), str(err.value)
    assert typed_config(compose_config(["export.imatrix=4096", "export.dtype=q4_k_m"])).export.imatrix == 4096
    qat = typed_config(compose_config(["train.qat_imatrix=4096", "train.qat=q4_k_m", "export.dtype=q4_k_m"]))
    assert qat.train.qat_imatrix == 4096 and qat.export.imatrix == 0


def test_export_takes_the_matrix_qat_trained_to_and_else_its_own(tmp_path: Path) -> None:
    """export.imatrix is export's own knob (train never reads it); a train directory holding QAT's
    matrix (train.qat_imatrix) is what the export calibrates with, whatever export.imatrix says."""
    cfg = typed_config(compose_config([]))
    qat_file = tmp_path / IMATRIX_GGUF
    assert imatrix_source(cfg, tmp_path, 0, qat_file) is None
    assert imatrix_source(cfg, tmp_path, 4096, qat_file) == ImatrixSource(
        tmp_path, 4096, cfg.train.seq_len, dataset="pydoc"
    )
    qat_file.write_bytes(b"")
    assert imatrix_source(cfg, tmp_path, 0, qat_file).reuse == qat_file
    assert not any(k.startswith("export") for k in STAGE_PARAMS["train"]) and "export" in STAGE_PARAMS["export"]


def test_the_stage_path_qat_and_export_share_one_matrix(smollm2_path: Path, tmp_path: Path) -> None:
    """train.qat + export.imatrix through run_train and run_export: the train directory keeps the matrix
    it trained with, export takes it, and the exported q4_k_m file holds the trained weights' fake quant."""
    rng = np.random.default_rng(0)
    packed = tmp_path / "packed"
    packed.mkdir()
    tokens = {"train": 4000, "val": 1000}
    for split, n in tokens.items():
        write_tokens(packed, split, rng.integers(0, 2000, n).astype(np.uint16))
    meta = PackMeta(49152, "uint16", "t" * 64, "c" * 64, "text", None, None, {"train": 1, "val": 1}, tokens, 2000)
    write_meta(packed, meta)
    (tmp_path / "init").mkdir()
    save_model_dir(tmp_path / "init", realize(K_TINY, "scratch", 49152, 0))
    src = ImatrixSource(packed, 256, 32, dataset="corpus")
    tcfg = TrainConfig(steps=2, batch_size=2, seq_len=32, eval_every=1, qat="q4_k_m", qat_start=0.5, device="cpu")
    run_train(
        TrainInputs(tmp_path / "init", packed, tmp_path / "train", imatrix=src), TrainJob(tcfg, OptimConfig(lr=1e-3), 0)
    )
    assert read_imatrix(tmp_path / "train" / IMATRIX_GGUF).extra["pipeline.imatrix.corpus_sha256"] == "c" * 64
    reuse = replace(src, reuse=tmp_path / "train" / IMATRIX_GGUF)
    run_export(tmp_path / "train", smollm2_path, tmp_path / "export", ExportPlan("q4_k_m", imatrix=reuse), {})
    shipped = (tmp_path / "export" / IMATRIX_GGUF).read_bytes()
    assert shipped == (tmp_path / "train" / IMATRIX_GGUF).read_bytes()
    g = GGUFFile(tmp_path / "export" / "model.gguf")
    assert g.metadata["quantize.imatrix.dataset"] == "corpus" and g.metadata["quantize.imatrix.chunks_count"] == 8
    trained = load_model_dir(tmp_path / "train")
    weights = read_imatrix(tmp_path / "train" / IMATRIX_GGUF).weights()
    for p, kind, name in named_targets(trained, "q4_k_m"):
        assert np.array_equal(ggml_fake_quant(p.detach(), kind, weights.get(name)).numpy(), g.tensor(name)), name
