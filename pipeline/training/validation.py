"""The deterministic fp32 validation loss the train stage reports and the evaluate stage
reproduces from the exported GGUF (to 1e-3): no sampling, no autocast, the whole split."""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from pipeline.data.packed import Images, Packed, begin_with_bos, is_images, is_rows, window_bos
from pipeline.models.ops.losses import IGNORE_INDEX


def validation_metrics(
    model: nn.Module, data: np.ndarray | Packed | Images, seq_len: int, batch_size: int, device: torch.device
) -> dict[str, float]:
    """`val_loss`, and for images `val_accuracy` too (one pass)."""
    if is_images(data):
        loss, accuracy, _ = classify(model, data, batch_size, device)
        return {"val_loss": loss, "val_accuracy": accuracy}
    return {"val_loss": validation_loss(model, data, seq_len, batch_size, device)}


def validation_loss(
    model: nn.Module, data: np.ndarray | Packed | Images, seq_len: int, batch_size: int, device: torch.device
) -> float:
    """Every window of `seq_len` of a token stream, every labelled (response) position of packed rows,
    or every image (mean cross-entropy of its class logits)."""
    if is_images(data):
        return classify(model, data, batch_size, device)[0]
    if is_rows(data):
        return response_nll(model, data, batch_size, device)
    return evaluate_loss(model, data, seq_len, batch_size, device)


def evaluate_loss(model: nn.Module, data: np.ndarray, seq_len: int, batch_size: int, device: torch.device) -> float:
    """Token-weighted mean NLL over consecutive non-overlapping windows of the whole split, fp32."""
    return scored_windows(model, data, seq_len, batch_size, device)[0]


@torch.no_grad()
def scored_windows(
    model: nn.Module, data: np.ndarray, seq_len: int, batch_size: int, device: torch.device
) -> tuple[float, np.ndarray]:
    """`evaluate_loss` and the model's greedy choice (int32, windows x seq_len) at every position of
    those windows: what a draft model is judged by against its target (inference.speculative). A model
    training over the corpus's ids (`head_vocab`) is scored over them: a lower bound of the whole
    vocabulary's loss, which the train stage then measures once for the weights it keeps."""
    was_training = model.training
    model.eval()
    n = (len(data) - 1) // seq_len
    if n < 1:  # the stages refuse this first (training.batches.check_split_fits): a caller's bug, named
        raise ValueError(f"evaluate_loss: {len(data)} tokens hold no window of seq_len={seq_len} plus its target")
    tokens = np.asarray(data[: n * seq_len + 1], dtype=np.int64)
    x_all = begin_with_bos(torch.from_numpy(tokens[:-1].reshape(n, seq_len).copy()), window_bos(data))
    y_all = torch.from_numpy(tokens[1:].reshape(n, seq_len))
    total, count, choices = 0.0, 0, []
    for i in range(0, n, batch_size):
        x, y = x_all[i : i + batch_size].to(device), y_all[i : i + batch_size].to(device)
        logits, y, rows = _logits(model, x, y)
        total += torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="sum").item()
        best = logits.argmax(-1)
        choices.append((best if rows is None else rows[best]).to(torch.int32).cpu().numpy())
        count += y.numel()
    model.train(was_training)
    return total / count, np.concatenate(choices)


def _logits(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """fp32 logits of windows `x` and their targets `y`: over the whole head, or over `head_vocab`'s ids
    (then `y` as positions among them, and those ids, to map a choice back)."""
    vocab = getattr(model, "head_vocab", None)
    if vocab is None:
        return model(x).float(), y, None
    rows = vocab.ids.to(x.device)
    logits = torch.nn.functional.linear(model.hidden(x), model.head_weight().index_select(0, rows)).float()
    return logits, vocab.map(y), rows


@torch.no_grad()
def response_nll(model: nn.Module, packed: Packed, batch_size: int, device: torch.device) -> float:
    """Token-weighted mean NLL of every labelled (response) position of packed rows, fp32."""
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    for i in range(0, len(packed.input_ids), batch_size):
        x = torch.from_numpy(packed.input_ids[i : i + batch_size]).to(device)
        y = torch.from_numpy(packed.labels[i : i + batch_size])  # on the host, as the loop keeps them
        seg = torch.from_numpy(packed.segment_ids[i : i + batch_size].astype(np.int64))
        n = int((y != IGNORE_INDEX).sum())
        if n:
            total += float(model.loss(x, y, seg)) * n
            count += n
    model.train(was_training)
    return total / max(count, 1)


@torch.no_grad()
def classify(
    model: nn.Module, images: Images, batch_size: int, device: torch.device
) -> tuple[float, float, np.ndarray]:
    """(mean cross-entropy, accuracy, predicted class per image) over the whole split, fp32, in file order."""
    was_training = model.training
    model.eval()
    total, predicted = 0.0, []
    for i in range(0, len(images.labels), batch_size):
        x = torch.from_numpy(np.array(images.pixels[i : i + batch_size])).to(device)
        y = torch.from_numpy(np.array(images.labels[i : i + batch_size])).to(device)
        logits = model(x).float()
        total += torch.nn.functional.cross_entropy(logits, y, reduction="sum").item()
        predicted.append(logits.argmax(-1).cpu().numpy())
    model.train(was_training)
    pred = np.concatenate(predicted)
    n = max(len(pred), 1)
    return total / n, float((pred == np.asarray(images.labels)).mean()), pred
