"""recipe.init=subclone: calibration, exact rotation and transfer at full width, smaller students,
the stage functions end to end on a tiny donor GGUF, and one-line errors for students that do not fit."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from pipeline.config import ModelConfig, RecipeConfig, SubcloneConfig
from pipeline.data.packed import PackMeta, write_meta, write_tokens
from pipeline.donor.calibrate import CALIBRATION_FILE, Calibration, calibrate, check_student, run_calibration, windows
from pipeline.errors import ConfigError, GGUFError, PipelineError
from pipeline.init.realize import run_realize
from pipeline.init.subclone import fit_gain, select_heads, select_layers, subclone
from pipeline.modeldir import load_model_dir, read_realize
from pipeline.models.llama import Llama
from pipeline.models.llama_gguf import load_llama
from pipeline.models.transformer import TransformerConfig
from tests.conftest import write_tiny_gguf, write_tiny_llama_gguf

pytestmark = pytest.mark.usefixtures("one_thread")
VOCAB = 64


@pytest.fixture(scope="module")
def donor(tmp_path_factory: pytest.TempPathFactory) -> tuple[Llama, Calibration, Path]:
    path = write_tiny_llama_gguf(tmp_path_factory.mktemp("donor") / "tiny.gguf", vocab=VOCAB)
    model, _ = load_llama(path)
    ids = torch.from_numpy(np.random.default_rng(0).integers(0, VOCAB, (8, 32)))
    return model, calibrate(model, ids, outlier_factor=3.0, bf16=False), path  # 3x the mean share of 1/32


def student_cfg(donor: Llama, **kw) -> TransformerConfig:
    return replace(donor.cfg, **kw)


def tokens() -> torch.Tensor:
    return torch.from_numpy(np.random.default_rng(1).integers(0, VOCAB, (2, 24)))


def max_logit_gap(a: Llama, b: Llama) -> float:
    with torch.no_grad():
        return float((a(tokens()) - b(tokens())).abs().max())


def test_full_width_untied_student_reproduces_the_donor(donor) -> None:
    model, calib, _ = donor
    assert calib.basis.shape == (32, 32) and np.allclose(calib.basis.T @ calib.basis, np.eye(32), atol=1e-5)
    for rule in ("importance", "first", "even"):
        student, sel = subclone(model, calib, student_cfg(model, tie_embeddings=False), rule)
        assert sel.layers == (0, 1, 2, 3)
        assert max_logit_gap(student, model) < 1e-4


def test_any_rotation_with_folded_norms_leaves_the_logits_unchanged(donor) -> None:
    model, calib, _ = donor
    q, _ = torch.linalg.qr(torch.randn(32, 32, generator=torch.Generator().manual_seed(3), dtype=torch.float64))
    student, _ = subclone(model, calib, student_cfg(model, tie_embeddings=False), "first", q.float().numpy())
    assert not torch.allclose(student.tok_embd.weight, model.tok_embd.weight, atol=1e-2)  # really rotated
    assert max_logit_gap(student, model) < 1e-4


def test_tied_head_is_exact_on_the_coordinate_axes(donor) -> None:
    """With no rotation, the fitted final-norm gain is the donor's own: the tied student is exact."""
    model, calib, _ = donor
    student, _ = subclone(model, calib, student_cfg(model), "first", np.eye(32, dtype=np.float32))
    assert torch.allclose(student.norm.weight, model.norm.weight, atol=1e-4)
    assert max_logit_gap(student, model) < 1e-4


def test_outlier_coordinates_stay_axes(donor) -> None:
    _, calib, _ = donor
    axes = np.flatnonzero(calib.basis.max(0) > 1 - 1e-6)
    assert list(axes) == [0, 1, 2]  # the helper's three massive coordinates come first, unrotated
    assert sorted(int(np.argmax(calib.basis[:, j])) for j in axes) == [0, 1, 2]
    assert 0.5 < calib.kept_fraction(3) < 1 and calib.kept_fraction(32) == pytest.approx(1.0)
    assert np.allclose(calib.position_energy.sum(1), 1.0, atol=1e-5)


@pytest.mark.parametrize(
    "shape",
    [
        dict(d_model=16, n_head=2, n_kv_head=1, n_layer=2, d_ff=24),  # 2 of 4 heads, a whole kv group
        dict(d_model=24, n_head=3, n_kv_head=3, n_layer=3, d_ff=48),  # 3 kv heads copied from 2
        dict(d_model=32, n_head=4, n_kv_head=2, n_layer=1, d_ff=8),
    ],
)
def test_smaller_students_have_their_shapes_and_a_finite_loss(donor, shape: dict) -> None:
    model, calib, _ = donor
    for rule in ("circuit", "importance", "even", "first", "first_last"):
        student, sel = subclone(model, calib, student_cfg(model, **shape), rule)
        for name, p in Llama(student.cfg).named_parameters():
            assert student.get_parameter(name).shape == p.shape, name
        assert len(sel.layers) == shape["n_layer"] and all(len(n) == shape["d_ff"] for n in sel.neurons)
        x = tokens()
        assert torch.isfinite(student.loss(x[:, :-1], x[:, 1:]))


def test_layer_rules() -> None:
    influence = np.array([0.9, 0.1, 0.05, 0.3, 0.02, 0.6])
    assert select_layers(influence, 3, "importance") == (0, 3, 5)
    assert select_layers(influence, 3, "even") == (0, 2, 5)  # round(2.5) is 2: numpy rounds half to even
    assert select_layers(influence, 3, "first") == (0, 1, 2)
    assert select_layers(influence, 3, "first_last") == (0, 1, 5)
    assert select_layers(influence, 3, "1, 2,4") == (1, 2, 4)  # listed: the influence plays no part
    assert select_layers(influence, 3, "circuit", (2, 4)) == (0, 2, 4), "the circuit in place of the least influential"
    assert select_layers(influence, 3, "circuit", (2,), copying=(3,)) == (0, 2, 3), "a layer with a copy head stays"
    assert select_layers(influence, 3, "importance", (2, 4)) == (0, 3, 5), "only the circuit rule keeps it"


@pytest.mark.parametrize(
    ("listed", "fix"), [("1,2", "list 3 layers, or set model.n_layer=2"), ("1,2,6", "list layers below 6")]
)
def test_a_layer_list_that_does_not_fit_names_the_fix(listed: str, fix: str) -> None:
    with pytest.raises(ConfigError, match=f"config key recipe.subclone.layers: expected 3 donor layer .* fix: {fix}"):
        select_layers(np.ones(6), 3, listed)


def test_heads_keep_their_own_kv_group() -> None:
    energy = np.array([1.0, 5.0, 2.0, 0.5, 4.0, 3.0, 0.1, 0.2, 0.3])  # 3 kv groups of 3 query heads
    assert select_heads(energy, 3, 6, 2) == ((0, 1, 2, 3, 4, 5), (0, 1)), "the two strongest whole groups"
    q, kv = select_heads(energy, 3, 3, 3)  # one query head per kv head: the 3 strongest heads, any group
    assert q == (1, 4, 5) and kv == (0, 1, 1)
    assert select_heads(energy, 3, 6, 2, keep=7) == ((0, 1, 2, 6, 7, 8), (0, 2)), "the copy head's group first"
    assert select_heads(energy, 3, 3, 3, keep=6) == ((1, 4, 6), (0, 1, 2))


def packed_dir(root: Path, train: int = 4000, val: int = 600) -> Path:
    rng = np.random.default_rng(2)
    root.mkdir()
    tokens_ = {"train": train, "val": val}
    for split, n in tokens_.items():
        write_tokens(root, split, rng.integers(0, VOCAB, n).astype(np.uint16))
    write_meta(
        root, PackMeta(VOCAB, "uint16", "t" * 64, "c" * 64, "text", None, None, {"train": 1, "val": 1}, tokens_, VOCAB)
    )
    return root


def test_donor_and_realize_stages_end_to_end(tmp_path: Path, donor) -> None:
    model, _, path = donor
    packed = packed_dir(tmp_path / "packed")
    settings = SubcloneConfig(calib_tokens=512, calib_seq_len=64, head_fit_tokens=256, head_fit_iters=5)
    mcfg = ModelConfig(d_model=16, n_layer=2, n_head=2, n_kv_head=1, d_ff=24, rope_theta=1e5, tie_embeddings=True)
    calib, metrics = run_calibration(path, packed, mcfg, settings, tmp_path / "donor")
    assert (tmp_path / "donor" / CALIBRATION_FILE).is_file() and metrics["calibration_tokens"] == 512
    assert json.loads((tmp_path / "donor" / "meta.json").read_text())["layers"] == 4
    assert 0 < metrics["explained_variance_total"] < 1
    recipe = RecipeConfig(name="subclone", init="subclone", subclone=settings)
    out = run_realize(recipe, mcfg, 0, path, packed, tmp_path / "donor", tmp_path / "init", seq_len=32)
    assert np.isfinite(out["step0_val_loss"]) and 0 < out["parameter_fraction"] < 1
    assert out["head_fit_loss_after"] <= out["head_fit_loss_before"]
    assert out["residual_variance_kept"] == pytest.approx(calib.kept_fraction(16))
    record = read_realize(tmp_path / "init")
    assert record["init"] == "subclone" and len(record["subclone"]["selection"]["layers"]) == 2
    loaded = load_model_dir(tmp_path / "init")
    assert loaded.cfg.d_model == 16 and loaded.cfg.rope_theta == model.cfg.rope_theta


@pytest.mark.parametrize(
    ("change", "needles"),
    [
        (dict(d_model=40, n_head=5), ("model.d_model", "at most the donor's 32", "40")),
        (dict(n_layer=5), ("model.n_layer", "at most the donor's 4", "5", "donor.student.deep.n_layer<=4")),
        (dict(d_ff=64), ("model.d_ff", "48", "64")),
        (dict(d_model=24, n_head=2, n_kv_head=1), ("model.n_head", "head size 8", "24/2 = 12", "n_head=3")),
        (dict(n_kv_head=1), ("model.n_kv_head", "group size 2", "groups of 4")),
        (dict(rope_theta=10000.0), ("model.rope_theta", "100000", "10000.0", "set model.rope_theta=100000")),
        (dict(norm_eps=1e-6), ("model.norm_eps", "1e-05")),
        (dict(vocab_size=65), ("donor.path", "65 tokens")),
    ],
)
def test_students_that_do_not_fit_fail_on_one_line(donor, change: dict, needles: tuple[str, ...]) -> None:
    model, _, _ = donor
    with pytest.raises(ConfigError) as err:
        check_student(student_cfg(model, **change), model.cfg)
    msg = str(err.value)
    assert "\n" not in msg and "expected" in msg and "fix:" in msg
    for needle in needles:
        assert needle in msg, msg


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        (dict(d_model=40, n_head=5), r"model.d_model: expected at most the donor's 32, found 40"),
        (dict(rope_theta=1e4), r"model.rope_theta: expected the donor's 100000, found 10000"),
    ],
)
def test_a_student_that_does_not_fit_fails_in_the_donor_stage_leaving_nothing(
    tmp_path: Path, donor, change: dict, needle: str
) -> None:
    """Every key of the student is checked before calibrating, not only its width: a wrong rope_theta
    used to surface in realize, after calibration and the teach cache."""
    _, _, path = donor
    packed = packed_dir(tmp_path / "packed")
    shape = dict(d_model=16, n_layer=2, n_head=2, n_kv_head=1, d_ff=24, rope_theta=1e5) | change
    with pytest.raises(ConfigError, match=needle):
        run_calibration(path, packed, ModelConfig(**shape), SubcloneConfig(calib_tokens=256), tmp_path / "d")
    assert not (tmp_path / "d").exists()


@pytest.mark.parametrize(
    ("train", "calib_seq_len", "needle"),
    [
        (
            4000,
            129,
            r"calib_seq_len: expected at most 128 \(the train split has 4000 tokens, the donor's context_length "
            r"is 128\), found 129; fix: set recipe.subclone.calib_seq_len=128$",
        ),
        (100, 200, r"calib_seq_len: expected at most 100 .*found 200; fix: set .*calib_seq_len=100, or pack a larger"),
        (  # the donor fits one window of 100 but realize's head fit needs 101: refused here, not a stage later
            100,
            100,
            r"calib_seq_len: expected at most 99 \(.*the head fit reads one token more\), found 100; fix: set "
            r"recipe.subclone.calib_seq_len=99, or pack a larger corpus$",
        ),
    ],
)
def test_calibration_windows_that_do_not_fit_the_donor_or_the_split_fail_on_one_line(
    tmp_path: Path, donor, train: int, calib_seq_len: int, needle: str
) -> None:
    """They were a ValueError from the donor's forward, or numpy's "all input arrays must have the same shape"."""
    _, _, path = donor
    packed = packed_dir(tmp_path / "packed", train=train)
    mcfg = ModelConfig(d_model=16, n_layer=2, n_head=2, n_kv_head=1, d_ff=24, rope_theta=1e5)
    with pytest.raises(ConfigError, match=needle):
        run_calibration(path, packed, mcfg, SubcloneConfig(calib_seq_len=calib_seq_len), tmp_path / "d")
    assert not (tmp_path / "d").exists()


def test_a_donor_of_another_architecture_names_the_recipes_that_take_it(tmp_path: Path) -> None:
    """It said "expected llama (supported architectures: llama, gpt2, vit), found 'gpt2'"; fix: a supported one."""
    path = write_tiny_gguf(tmp_path / "gpt2.gguf", vocab=VOCAB, width=16, arch="gpt2", model=True)
    mcfg = ModelConfig(d_model=16, n_layer=1, n_head=2, n_kv_head=2, d_ff=32)
    with pytest.raises(GGUFError) as err:
        run_calibration(path, packed_dir(tmp_path / "packed"), mcfg, SubcloneConfig(), tmp_path / "d")
    said = str(err.value)
    assert "general.architecture: expected one of llama, qwen2, qwen3, gemma3 (recipe.init=subclone" in said
    assert "found 'gpt2'; fix: use a donor of a supported architecture, or" in said and "recipe=warm-start" in said
    assert "\n" not in said
    assert not (tmp_path / "d").exists()


def test_realize_refuses_a_val_split_shorter_than_a_window(tmp_path: Path, donor) -> None:
    """The step-0 val loss over no window was a ZeroDivisionError."""
    _, _, path = donor
    packed = packed_dir(tmp_path / "packed", val=20)
    settings = SubcloneConfig(calib_tokens=256, calib_seq_len=64, head_fit_tokens=0)
    mcfg = ModelConfig(d_model=16, n_layer=2, n_head=2, n_kv_head=1, d_ff=24, rope_theta=1e5)
    run_calibration(path, packed, mcfg, settings, tmp_path / "donor")
    recipe = RecipeConfig(name="subclone", init="subclone", subclone=settings)
    with pytest.raises(ConfigError, match=r"train.seq_len: expected at most 19 \(the val split has 20 tokens\)"):
        run_realize(recipe, mcfg, 0, path, packed, tmp_path / "donor", tmp_path / "init", seq_len=32)
    assert not (tmp_path / "init").exists()


def test_realize_without_calibration_names_the_file(tmp_path: Path, donor) -> None:
    _, _, path = donor
    packed = packed_dir(tmp_path / "packed")
    recipe = RecipeConfig(name="subclone", init="subclone")
    mcfg = ModelConfig(d_model=16, n_layer=2, n_head=2, n_kv_head=1, d_ff=24, rope_theta=1e5)
    with pytest.raises(PipelineError, match=r"calibration.safetensors: expected the donor calibration"):
        run_realize(recipe, mcfg, 0, path, packed, tmp_path / "nodonor", tmp_path / "init")
    assert not (tmp_path / "init").exists()


@pytest.mark.parametrize(
    ("kw", "key"),
    [
        (dict(calib_tokens=0), "recipe.subclone.calib_tokens"),
        (dict(calib_seq_len=1), "recipe.subclone.calib_seq_len"),
        (dict(outlier_factor=0.5), "recipe.subclone.outlier_factor"),
        (dict(layers="random"), "recipe.subclone.layers"),
        (dict(layers="3,1,2"), "recipe.subclone.layers"),  # listed layers ascend
        (dict(layers="1,,2"), "recipe.subclone.layers"),
        (dict(head_fit_tokens=-1), "recipe.subclone.head_fit_tokens"),
        (dict(head_fit_iters=0), "recipe.subclone.head_fit_iters"),
    ],
)
def test_bad_subclone_settings_name_the_key(kw: dict, key: str) -> None:
    with pytest.raises(ConfigError, match=f"config key {key}: expected"):
        SubcloneConfig(**kw)


def test_gain_fit_lowers_the_loss_and_touches_only_the_final_norm(donor) -> None:
    model, calib, _ = donor
    student, _ = subclone(model, calib, student_cfg(model, d_model=16, n_head=2, n_kv_head=1, n_layer=1), "first")
    before = {k: v.clone() for k, v in student.state_dict().items()}
    ids = torch.from_numpy(np.random.default_rng(2).integers(0, VOCAB, (6, 33)))
    with torch.no_grad():
        start = float(student.loss(ids[:, :-1], ids[:, 1:]))
    fitted_before, fitted_after = fit_gain(student, ids, iters=10)
    with torch.no_grad():
        end = float(student.loss(ids[:, :-1], ids[:, 1:]))
    assert fitted_before == pytest.approx(start, abs=0.05)  # the fit's head runs in bf16
    assert fitted_after < fitted_before and end < start
    changed = [k for k, v in student.state_dict().items() if not torch.equal(v, before[k])]
    assert changed == ["norm.weight"]


def test_windows_spread_over_the_split() -> None:
    ids = windows(np.arange(1000), 300, 100)
    assert ids.shape == (3, 100) and ids[0, 0] == 0 and ids[-1, -1] == 999


def test_real_donor_subclone(smollm2_path: Path) -> None:
    """SmolLM2: three massive residual coordinates stay axes; a full-width untied student is the donor."""
    model, _ = load_llama(smollm2_path)
    text = torch.tensor([[1, 504, 3458, 282, 253, 1326, 28, 314, 260, 1345, 4098, 30, 378, 314, 2047, 29]])
    calib = calibrate(model, text.repeat(2, 1), bf16=False)
    assert int((calib.basis.max(0) > 1 - 1e-6).sum()) == 3
    full, _ = subclone(model, calib, replace(model.cfg, tie_embeddings=False), "first")
    with torch.no_grad():
        gap = float((full(text) - model(text)).abs().max())
    assert gap < 1e-3, gap  # measured 1.0e-4 (logits of up to ~30, fp32 through 30 blocks)
    small, sel = subclone(
        model, calib, replace(model.cfg, d_model=384, n_head=6, n_kv_head=2, n_layer=4, d_ff=512), "importance"
    )
    assert sel.layers[0] == 0 and small.tok_embd.weight.shape == (49152, 384)
    assert torch.isfinite(small.loss(text[:, :-1], text[:, 1:]))
