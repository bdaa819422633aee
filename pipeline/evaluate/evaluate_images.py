"""The evaluate stage for image classification (the ViT recipe): the exported GGUF read back through
our own reader, its val loss and accuracy over every val image (for an f32 export they must equal
what the train stage measured for the weights it kept, or the stage fails), and the confusion
matrix (rows: actual class, columns: predicted)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pipeline.config import PipelineConfig
from pipeline.data.packed import load_images, load_meta
from pipeline.errors import PipelineError
from pipeline.modeldir import read_train_state
from pipeline.models.devices import pick_device
from pipeline.models.registry import load_gguf
from pipeline.training.validation import classify

F32_LOSS_TOLERANCE = 1e-5  # the same fp32 computation on the same weights: equal but for summation order
CONFUSION_HEADER = "actual,predicted"


@dataclass
class Confusion:
    """The val split's actual and predicted class per image, and the class names."""

    classes: list[str]
    actual: np.ndarray
    predicted: np.ndarray

    def matrix(self) -> np.ndarray:
        """counts[actual, predicted]."""
        k = len(self.classes)
        counts = np.zeros((k, k), dtype=np.int64)
        np.add.at(counts, (self.actual, self.predicted), 1)
        return counts

    def csv(self) -> str:
        """One row per val image, by class name: what DVC's `confusion` template draws."""
        rows = [CONFUSION_HEADER] + [
            f"{self.classes[a]},{self.classes[p]}" for a, p in zip(self.actual, self.predicted)
        ]
        return "\n".join(rows) + "\n"

    def record(self) -> dict:
        return {"classes": self.classes, "matrix": self.matrix().tolist(), "rows": "actual", "columns": "predicted"}


def run_evaluate_images(
    gguf: Path, packed_dir: Path, train_dir: Path, cfg: PipelineConfig
) -> tuple[dict[str, float], Confusion]:
    """Val loss and accuracy of the GGUF, checked against the train stage's (f32 export), and the confusion."""
    model, _ = load_gguf(gguf)
    dev = pick_device(cfg.train.device)
    model.to(dev)
    val = load_images(packed_dir, "val")
    loss, accuracy, predicted = classify(model, val, cfg.train.batch_size, dev)
    metrics = {
        "val_loss": loss,
        "val_ppl": math.exp(loss),
        "val_accuracy": accuracy,
        "val_images": float(len(predicted)),
    }
    state = read_train_state(train_dir)
    if state is not None:
        kept = state.kept_step if state.kept_step is not None else state.steps
        trained = next((h for h in state.history if h.get("step") == kept and "val_accuracy" in h), {})
        metrics.update(trained_val_loss=state.val_loss, val_loss_abs_diff=abs(loss - state.val_loss))
        if "val_accuracy" in trained:
            metrics["trained_val_accuracy"] = trained["val_accuracy"]
        metrics["kept_step"] = float(kept)
        same = abs(loss - state.val_loss) <= F32_LOSS_TOLERANCE and trained.get("val_accuracy", accuracy) == accuracy
        if cfg.export.dtype == "f32" and not same:
            raise PipelineError(
                f"{gguf}: expected val loss {state.val_loss:.6f} and accuracy {trained.get('val_accuracy')} "
                f"(train stage, step {kept}), found {loss:.6f} and {accuracy}; fix: the export does not "
                "reproduce the trained model, re-run export"
            )
    classes = list((load_meta(packed_dir).stats or {}).get("classes", []))
    return metrics, Confusion(classes, np.asarray(val.labels), predicted)
