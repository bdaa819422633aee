"""The ViT-Tiny image recipe on tiny configs: shapes, determinism from the seed, bit-exact resume through
the one training loop, the GGUF round trip (logits equal), and one-line errors for bad image input."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from pipeline.config import DataConfig, ModelConfig, OptimConfig, PipelineConfig, RecipeConfig, TrainConfig
from pipeline.data.images import pack_images, read_image
from pipeline.data.packed import load_data, load_images
from pipeline.errors import ConfigError, DataError
from pipeline.gguf.reader import GGUFFile
from pipeline.init.realize import run_realize
from pipeline.modeldir import load_model_dir
from pipeline.models.registry import export_gguf, load_gguf
from pipeline.models.vit import ViT
from pipeline.training import checkpoint as ckpt
from pipeline.training.loop import TrainJob, train
from pipeline.training.resume import plan_checkpoints
from pipeline.training.validation import classify

pytestmark = pytest.mark.usefixtures("one_thread")

TINY = ModelConfig(arch="vit", d_model=16, n_layer=2, n_head=2, n_kv_head=2, d_ff=32, patch_size=4, n_classes=3)
TCFG = TrainConfig(steps=8, batch_size=4, eval_every=4, log_every=1, checkpoint_every=2, keep_checkpoints=3)
RECIPE = RecipeConfig(name="vit-tiny", init="scratch")
OPTIM = OptimConfig(lr=3e-3, warmup_steps=2)


def write_image_folder(root: Path, classes: int = 3, per_class: int = 6, size: int = 10) -> Path:
    """Seeded PNGs in one sub-folder per class: each class a bright square in its own corner."""
    rng = np.random.default_rng(0)
    for c in range(classes):
        (root / f"class{c}").mkdir(parents=True)
        for i in range(per_class):
            img = rng.integers(0, 60, (size, size), dtype=np.uint8)
            y, x = divmod(c, 2)
            img[y * 5 : y * 5 + 5, x * 5 : x * 5 + 5] = 250
            Image.fromarray(img).save(root / f"class{c}" / f"{i}.png")
    return root


@pytest.fixture(scope="module")
def project(tmp_path_factory) -> Path:
    """Packed tiny images (8x8 from 10x10 PNGs) and a realized tiny ViT."""
    root = tmp_path_factory.mktemp("vit")
    data = DataConfig(source="images", path=str(write_image_folder(root / "images")), image_size=8, val_fraction=0.25)
    pack_images(data, root / "packed")
    run_realize(RECIPE, TINY, 0, root, root / "packed", root / "donor", root / "init")
    return root


def test_pack_splits_resizes_and_normalizes(project: Path) -> None:
    train_split, val = load_images(project / "packed", "train"), load_images(project / "packed", "val")
    assert train_split.pixels.shape == (14, 1, 8, 8) and val.pixels.shape == (4, 1, 8, 8)
    assert abs(float(train_split.pixels.mean())) < 1e-5 and abs(float(train_split.pixels.std()) - 1) < 1e-4
    assert sorted(set(train_split.labels.tolist()) | set(val.labels.tolist())) == [0, 1, 2]


def test_shapes_and_determinism_from_the_seed(project: Path, tmp_path: Path) -> None:
    model = load_model_dir(project / "init")
    assert (
        isinstance(model, ViT) and model.cfg.n_patches == 4 and model.cfg.class_names == ("class0", "class1", "class2")
    )
    x = torch.from_numpy(np.array(load_images(project / "packed", "val").pixels))
    assert model.patch_embd(x).shape == (4, 4, 16)
    assert model(x).shape == (4, 3)
    assert model.pos_embd.shape == (1, 5, 16) and model.cls_token.shape == (1, 1, 16)
    again = tmp_path / "again"
    run_realize(RECIPE, TINY, 0, tmp_path, project / "packed", tmp_path, again)
    other = tmp_path / "other"
    run_realize(RECIPE, TINY, 1, tmp_path, project / "packed", tmp_path, other)
    same, differ = load_model_dir(again).state_dict(), load_model_dir(other).state_dict()
    for name, t in model.state_dict().items():
        assert torch.equal(t, same[name]), name
    assert not torch.equal(model.pos_embd, differ["pos_embd"])


def run(project: Path, tcfg: TrainConfig, ckpt_dir: Path):
    plan = plan_checkpoints(tcfg, OPTIM, 0, project / "init", project / "packed", ckpt_dir)
    model = load_model_dir(project / "init")
    data = load_data(project / "packed", "train"), load_data(project / "packed", "val")
    result = train(model, *data, TrainJob(tcfg, OPTIM, 0, plan=plan, progress=False))
    return model, result, plan


def test_resume_from_a_middle_checkpoint_is_bit_identical(project: Path, tmp_path: Path) -> None:
    full, full_result, plan = run(project, TCFG, tmp_path)
    assert [s for s, _ in ckpt.step_dirs(plan.root)] == [8, 6, 4]
    assert all("val_accuracy" in h for h in full_result.history if "val_loss" in h)
    for s in (8, 6):  # as if the process had died right after writing step 4
        ckpt.shutil.rmtree(plan.root / ckpt.step_name(s))
    resumed, result, _ = run(project, TCFG, tmp_path)
    assert result.resumed_from == 4
    for name, t in full.state_dict().items():
        assert torch.equal(t, resumed.state_dict()[name]), name
    assert [h["train_loss"] for h in result.history] == [h["train_loss"] for h in full_result.history]


def test_training_learns_the_tiny_set(project: Path, tmp_path: Path) -> None:
    """The one loop drives the ViT: more steps, the val loss falls below chance (ln 3)."""
    _, result, _ = run(project, replace(TCFG, steps=40, eval_every=40, checkpoint_every=0), tmp_path)
    assert result.history[0]["train_loss"] > result.kept_val_loss and result.kept_val_loss < np.log(3)


def test_gguf_round_trip_gives_equal_logits(project: Path, tmp_path: Path) -> None:
    model = load_model_dir(project / "init")
    path = export_gguf(model, tmp_path / "vit.gguf", {}, {"general.name": "t"}, "f32")
    back, g = load_gguf(path)
    assert g.architecture == "vit" and g.metadata["vit.patch_size"] == 4 and g.metadata["vit.class_count"] == 3
    assert g.metadata["vit.class_names"] == ["class0", "class1", "class2"] and len(g.metadata["vit.image_mean"]) == 1
    assert back.cfg == model.cfg
    val = load_images(project / "packed", "val")
    x = torch.from_numpy(np.array(val.pixels))
    with torch.no_grad():
        assert torch.equal(model(x), back(x))
    cpu = torch.device("cpu")
    assert classify(model, val, 2, cpu)[:2] == classify(back, val, 2, cpu)[:2]


def test_a_forged_key_is_a_named_error(project: Path, tmp_path: Path) -> None:
    from pipeline.errors import GGUFError
    from pipeline.gguf.writer import write_gguf

    model = load_model_dir(project / "init")
    path = export_gguf(model, tmp_path / "vit.gguf", {}, {}, "f32")
    g = GGUFFile(path)
    meta = {k: v for k, v in g.metadata.items() if not k.startswith("general.architecture")}
    meta["vit.patch_size"] = 3
    tensors = {n: g.tensor(n) for n in g.tensor_names()}
    write_gguf(tmp_path / "bad.gguf", "vit", meta, tensors)
    with pytest.raises(GGUFError, match="image_size: expected a multiple of patch_size"):
        load_gguf(tmp_path / "bad.gguf")


def test_a_folder_without_class_sub_folders_is_named(tmp_path: Path) -> None:
    (tmp_path / "flat").mkdir()
    Image.fromarray(np.zeros((4, 4), dtype=np.uint8)).save(tmp_path / "flat" / "a.png")
    with pytest.raises(DataError, match=r"data.path=.*flat: expected one sub-folder of images per class.*no sub"):
        pack_images(DataConfig(source="images", path=str(tmp_path / "flat")), tmp_path / "packed")
    assert not (tmp_path / "packed").exists()


def test_a_folder_of_one_class_is_named_before_anything_is_written(tmp_path: Path) -> None:
    """One class packed fine, then realize asked for model.n_classes=1, which the config refuses (>= 2)."""
    root = write_image_folder(tmp_path / "images", classes=1)
    with pytest.raises(DataError, match=r"images: expected at least 2 class sub-folders.*found 1 \(class0/\)"):
        pack_images(DataConfig(source="images", path=str(root)), tmp_path / "packed")
    assert not (tmp_path / "packed").exists()


def test_an_unreadable_image_is_named(tmp_path: Path) -> None:
    root = write_image_folder(tmp_path / "images")
    (root / "class1" / "broken.png").write_bytes(b"not a png at all")
    with pytest.raises(DataError, match=r"class1/broken.png: expected an image file Pillow can read") as e:
        pack_images(DataConfig(source="images", path=str(root)), tmp_path / "packed")
    assert "\n" not in str(e.value) and not (tmp_path / "packed").exists()


def test_images_in_nested_folders_count_for_their_class(tmp_path: Path) -> None:
    """class1/night/*.png belongs to class1 (they were skipped without a word); hidden folders do not count."""
    flat = write_image_folder(tmp_path / "flat")
    nested = write_image_folder(tmp_path / "nested")
    (nested / "class1" / "night").mkdir()
    for f in sorted((nested / "class1").glob("*.png"))[:4]:
        f.rename(nested / "class1" / "night" / f.name)
    (nested / "class2" / ".ipynb_checkpoints").mkdir()
    (nested / "class2" / ".ipynb_checkpoints" / "x.txt").write_text("not an image")
    a, _ = pack_images(DataConfig(source="images", path=str(flat)), tmp_path / "a")
    b, _ = pack_images(DataConfig(source="images", path=str(nested)), tmp_path / "b")
    assert b.documents == a.documents and sum(a.documents.values()) == 18
    assert sorted(load_images(tmp_path / "b", "train").labels.tolist()) == sorted(
        load_images(tmp_path / "a", "train").labels.tolist()
    )


@pytest.mark.parametrize("channels", [1, 3])
def test_16_bit_and_float_grey_images_keep_their_values(tmp_path: Path, channels: int) -> None:
    """A 16-bit PNG (microscopy, depth maps) came out all white and a float TIFF all black: Pillow's
    convert("L") clips at 255. Now each reads as the 8-bit image of the same picture does."""
    ramp = np.linspace(0.0, 1.0, 64, dtype=np.float32).reshape(8, 8)
    (tmp_path / "a").mkdir()
    Image.fromarray(np.round(ramp * 255).astype(np.uint8)).save(tmp_path / "a" / "8bit.png")
    Image.fromarray(np.round(ramp * 65535).astype(np.uint16)).save(tmp_path / "a" / "16bit.png")
    Image.fromarray(ramp, mode="F").save(tmp_path / "a" / "float.tif")
    assert Image.open(tmp_path / "a" / "16bit.png").mode.startswith("I")
    base, wide, flt = (read_image(tmp_path / "a" / n, 8, channels) for n in ("8bit.png", "16bit.png", "float.tif"))
    assert base.shape == wide.shape == flt.shape == (channels, 8, 8)
    assert np.abs(wide - base).max() < 1 / 255 and np.abs(flt - base).max() < 1 / 255
    Image.fromarray(ramp * 9, mode="F").save(tmp_path / "a" / "hdr.tif")
    with pytest.raises(DataError, match=r"hdr.tif: expected float pixels in \[0, 1\], found values from 0 to 9"):
        read_image(tmp_path / "a" / "hdr.tif", 8, channels)


def test_image_size_not_divisible_by_the_patch_size_names_the_key() -> None:
    with pytest.raises(ConfigError, match=r"config key data.image_size: expected a multiple of model.patch_size=4"):
        PipelineConfig(data=DataConfig(source="digits", image_size=10), model=TINY, recipe=RECIPE)


def test_classes_disagreeing_with_the_data_name_the_key(project: Path, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"config key model.n_classes: expected 3, the classes in the data"):
        run_realize(RECIPE, replace(TINY, n_classes=10), 0, tmp_path, project / "packed", tmp_path, tmp_path / "init")
    assert not (tmp_path / "init").exists()


def test_image_data_needs_the_vit_model() -> None:
    with pytest.raises(ConfigError, match=r"config key model.arch: expected vit for image data"):
        PipelineConfig(data=DataConfig(source="digits"), recipe=RECIPE)
