"""recipe=vit-tiny end to end in a scratch git repo: `dvc exp run` of every stage on a handful of PNGs in
class folders (tiny ViT, a few steps), the stages that do not apply to images skipping with a log line,
evaluate equal to train in f32 with a confusion matrix as a DVC plot and an MLflow figure; and bad image
input stopping pack with one named line and exit 2."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from pipeline.gguf.reader import GGUFFile
from tests.scratch import make_project, mlflow_runs, ran, run, sh
from tests.test_vit import write_image_folder

pytestmark = pytest.mark.slow
TINY = (
    "-S recipe=vit-tiny -S data=images -S data.image_size=8 -S data.val_fraction=0.25 -S model.n_classes=3 "
    "-S model.d_model=16 -S model.n_head=2 -S model.n_layer=1 -S model.d_ff=32 -S train.steps=6 -S train.batch_size=4 "
    "-S train.eval_every=3 -S train.log_every=1 -S train.checkpoint_every=3 -S train.device=cpu"
).split()


@pytest.fixture(scope="module")
def project(tmp_path_factory) -> Path:
    return make_project(tmp_path_factory.mktemp("vit-project"))


@pytest.fixture(scope="module")
def images(tmp_path_factory) -> Path:
    return write_image_folder(tmp_path_factory.mktemp("vit-images") / "images")


@pytest.fixture(scope="module")
def exp_run(project: Path, images: Path) -> str:
    return sh(project, "dvc", "exp", "run", *TINY, "-S", f"data.path={images}", timeout=900)


def test_every_stage_runs_and_the_text_only_ones_say_they_skip(exp_run: str) -> None:
    assert ran(exp_run) == ["inputs", "pack", "donor", "teach", "realize", "train", "export", "evaluate", "report"]
    assert "pack: 18 images of 3 classes at 8px (train 14, val 4)" in exp_run
    assert "donor: skipped for image data (recipe=vit-tiny)" in exp_run
    assert "teach: skipped for image data" in exp_run
    assert "llama.cpp parity skipped (text only)" in exp_run


def test_evaluate_reproduces_train_and_plots_the_confusion(project: Path, exp_run: str) -> None:
    train = json.loads((project / "metrics" / "train.json").read_text())
    evaluate = json.loads((project / "metrics" / "evaluate.json").read_text())
    assert evaluate["val_accuracy"] == train["kept_val_accuracy"] == evaluate["trained_val_accuracy"]
    assert abs(evaluate["val_loss"] - train["kept_val_loss"]) <= 1e-5
    rows = (project / "plots" / "evaluate" / "confusion.csv").read_text().splitlines()
    assert rows[0] == "actual,predicted" and len(rows) == 1 + 4
    assert {r.split(",")[0] for r in rows[1:]} <= {"class0", "class1", "class2"}
    confusion = json.loads((project / "models" / "evaluate" / "confusion.json").read_text())
    assert sum(map(sum, confusion["matrix"])) == 4 and confusion["classes"] == ["class0", "class1", "class2"]
    g = GGUFFile(project / "models" / "export" / "model.gguf")
    assert g.architecture == "vit" and g.metadata["vit.class_count"] == 3 and g.metadata["vit.image_size"] == 8
    assert "val_accuracy" in (project / "plots" / "train" / "val_loss.tsv").read_text().splitlines()[0]


def test_mlflow_has_accuracy_and_the_confusion_figure(project: Path, exp_run: str) -> None:
    client, runs = mlflow_runs(project)
    evaluate = next(r for r in runs if r.info.run_name.endswith("evaluate"))
    assert "confusion.png" in {a.path for a in client.list_artifacts(evaluate.info.run_id)}
    train = next(r for r in runs if r.info.run_name.endswith("train"))
    accuracy = client.get_metric_history(train.info.run_id, "val_accuracy")
    assert accuracy and all(0 <= m.value <= 1 for m in accuracy)


def test_bad_images_stop_pack_with_one_named_line(project: Path, tmp_path: Path) -> None:
    flat = tmp_path / "flat"
    flat.mkdir()
    (flat / "a.png").write_bytes(b"")
    proc = run(project, sys.executable, "-m", "stages.pack", "recipe=vit-tiny", "data=images", f"data.path={flat}")
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert lines[0].startswith(f"error: data.path={flat}: expected one sub-folder of images per class")
    proc = run(project, sys.executable, "-m", "stages.pack", "recipe=vit-tiny", "data.image_size=10")
    assert (
        proc.returncode == 2 and "config key data.image_size: expected a multiple of model.patch_size=4" in proc.stderr
    )
