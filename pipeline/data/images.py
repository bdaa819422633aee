"""The pack stage for labelled images (the ViT recipe): scikit-learn's bundled handwritten digits
(`data.source=digits`, 1,797 8x8 grey images, on every machine) or a directory of image files in one
sub-folder per class (`data.source=images`, `data.path=dir/`, read with Pillow), resized to
`data.image_size`, split into train/val by the one seeded rule (`pipeline.data.split`), normalized
with the train split's per-channel mean and std, and written as the packed-images format
(`pipeline.data.packed`).
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
from PIL import Image, UnidentifiedImageError

from pipeline.config import DataConfig
from pipeline.data.packed import PackMeta, write_images, write_meta
from pipeline.data.split import split_indices
from pipeline.errors import DataError, one_line, problem
from pipeline.io.files import atomic_dir


@dataclass
class ImageSet:
    """Every image of the source, resized, in [0, 1] (N, C, H, W) float32, with class ids and names."""

    pixels: np.ndarray
    labels: np.ndarray
    classes: list[str]
    sha256: str  # of what was read: identifies the data in the packed meta


def read_digits(size: int) -> ImageSet:
    """scikit-learn's 8x8 digits (values 0..16), scaled to [0, 1] and resized to `size`."""
    from sklearn.datasets import load_digits  # heavy: only when this source is asked for

    raw = load_digits()
    images = raw.images.astype(np.float32) / 16.0
    pixels = np.stack([_resize_grey(img, size) for img in images])[:, None]
    labels = raw.target.astype(np.int64)
    digest = hashlib.sha256(images.tobytes() + labels.tobytes()).hexdigest()
    return ImageSet(pixels, labels, [str(c) for c in raw.target_names], digest)


def _resize_grey(img: np.ndarray, size: int) -> np.ndarray:
    if img.shape == (size, size):
        return img
    return np.asarray(Image.fromarray(img, mode="F").resize((size, size), Image.Resampling.BILINEAR))


def class_folders(root: Path) -> list[Path]:
    """The class sub-folders of an image directory, sorted by name (the class id is the position)."""
    if not root.is_dir():
        found = "a file" if root.is_file() else f"nothing at {root.resolve()}"
        fix = "point data.path at a folder with one sub-folder of images per class"
        raise DataError(problem(f"data.path={root}", "an existing directory", found, fix))
    folders = sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))
    if not folders:
        raise DataError(
            problem(
                f"data.path={root}",
                "one sub-folder of images per class (e.g. cats/ and dogs/)",
                "no sub-folders",
                "put each class's images in a folder named after the class",
            )
        )
    if len(folders) == 1:  # model.n_classes must be >= 2: a pack of one class could never be trained
        raise DataError(
            problem(
                f"data.path={root}",
                "at least 2 class sub-folders (a classifier tells classes apart)",
                f"1 ({folders[0].name}/)",
                "add a sub-folder of images for each other class",
            )
        )
    return folders


def image_files(folder: Path) -> list[Path]:
    """Every file under a class folder, nested folders included (cat/indoor/*.png is class cat, as
    torchvision's ImageFolder reads it; they were skipped without a word); hidden files and folders
    (.DS_Store, .ipynb_checkpoints/) are not images."""
    files = (p for p in folder.rglob("*") if p.is_file())
    return sorted(p for p in files if not any(part.startswith(".") for part in p.relative_to(folder).parts))


def read_image(path: Path, size: int, channels: int) -> np.ndarray:
    """One image file as (C, size, size) float32 in [0, 1]; an unreadable file is a named error."""
    try:
        with Image.open(path) as img:
            if img.mode in WIDE_MODES:
                arr = _wide_grey(img, path, size, channels)
            else:
                img = img.convert("L" if channels == 1 else "RGB").resize((size, size), Image.Resampling.BILINEAR)
                arr = np.asarray(img, dtype=np.float32) / 255.0
    except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError) as e:
        raise DataError(
            problem(
                str(path), "an image file Pillow can read", f"unreadable ({one_line(e, 100)})", "remove or replace it"
            )
        ) from None
    return arr[None] if channels == 1 else arr.transpose(2, 0, 1)


# Pillow's grey modes wider than 8 bits: 16-bit PNG/TIFF (I;16*, or I), 32-bit float TIFF (F). Their
# convert("L") clips every value above 255, so a 16-bit image came out all white and a float one black.
WIDE_MODES = ("I;16", "I;16B", "I;16L", "I;16N", "I", "F")


def _wide_grey(img: Image.Image, path: Path, size: int, channels: int) -> np.ndarray:
    """A 16-bit (scaled by 65535) or float ([0, 1]) grey image as (H, W[, 3]) float32 in [0, 1]."""
    raw = np.asarray(img, dtype=np.float32)
    top = 1.0 if img.mode == "F" else 65535.0
    if raw.size and (raw.min() < 0 or raw.max() > top):
        found = f"values from {raw.min():g} to {raw.max():g} in a {img.mode} image"
        expected = "float pixels in [0, 1]" if img.mode == "F" else "16-bit pixels (0 to 65535)"
        raise DataError(problem(str(path), expected, found, "save it rescaled as an 8- or 16-bit PNG"))
    grey = _resize_grey(raw / top, size)
    return grey if channels == 1 else np.repeat(grey[:, :, None], 3, axis=2)


def read_folder(root: Path, size: int, channels: int) -> ImageSet:
    """Every file in each class sub-folder of `root`, in name order."""
    pixels, labels, digest = [], [], hashlib.sha256()
    folders = class_folders(root)
    for label, folder in enumerate(folders):
        files = image_files(folder)
        if not files:
            raise DataError(
                problem(str(folder), "image files of class " + folder.name, "none", "add images or remove it")
            )
        for path in files:
            pixels.append(read_image(path, size, channels))
            labels.append(label)
            digest.update(f"{folder.name}/{path.relative_to(folder).as_posix()}\n".encode() + path.read_bytes())
    return ImageSet(np.stack(pixels), np.asarray(labels, dtype=np.int64), [f.name for f in folders], digest.hexdigest())


def read_images(data: DataConfig) -> ImageSet:
    if data.source == "digits":
        return read_digits(data.image_size)
    return read_folder(Path(data.path).expanduser(), data.image_size, data.channels)


def pack_images(data: DataConfig, out_dir: Path) -> tuple[PackMeta, dict[str, float]]:
    """Read, split, normalize and write `out_dir` atomically; returns the meta and the stage metrics."""
    start = time.perf_counter()
    found = read_images(data)
    if len(found.labels) < 2:
        raise DataError(problem(f"data.path={data.path}", "at least 2 images", str(len(found.labels)), "add images"))
    train_idx, val_idx = split_indices(len(found.labels), data.val_fraction, data.split_seed)
    train = found.pixels[train_idx]
    mean = train.mean(axis=(0, 2, 3), dtype=np.float64)
    std = np.maximum(train.std(axis=(0, 2, 3), dtype=np.float64), 1e-6)
    norm = ((found.pixels - mean[None, :, None, None]) / std[None, :, None, None]).astype(np.float32)
    counts = {"train": len(train_idx), "val": len(val_idx)}
    stats = {
        "classes": found.classes,
        "image_size": data.image_size,
        "channels": int(found.pixels.shape[1]),
        "mean": [float(m) for m in mean],
        "std": [float(s) for s in std],
    }
    n_classes = len(found.classes)
    meta = PackMeta(
        vocab_size=0,
        n_classes=n_classes,
        dtype="float32",
        tokenizer_fingerprint="",
        corpus_sha256=found.sha256,
        source=data.source,
        bos_id=None,
        eos_id=None,
        documents=counts,
        tokens=dict(counts),
        distinct_tokens=0,
        format="images",
        stats=stats,
        data=asdict(data),
    )
    with atomic_dir(out_dir) as tmp:
        for split, idx in (("train", train_idx), ("val", val_idx)):
            write_images(tmp, split, norm[idx], found.labels[idx])
        write_meta(tmp, meta)
    seconds = time.perf_counter() - start
    metrics = {"images": float(len(found.labels)), "classes": float(n_classes), "seconds": seconds}
    return meta, {**metrics, "train_images": float(counts["train"]), "val_images": float(counts["val"])}
