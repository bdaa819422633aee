"""What the side-by-side benchmarks share when they run their contenders one after another on a device
(`--device cuda`, or `--device cpu` with named shapes/contenders): the named model shapes, timing with the
device synchronised, peak memory per contender, freeing a contender before the next, and transformers
models of the same shape.

Nothing here touches `torch.cuda` unless the device is CUDA, so every path runs on CPU too (smaller).
"""

from __future__ import annotations

import ctypes
import gc
import os
import platform
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import yaml
from harness import ROOT  # first: this checkout's library on sys.path

from pipeline.models.transformer import TransformerConfig

SMOLLM2_VOCAB = 49152  # the SmolLM2 tokenizer every shape of ours trains with (pydoc data, the donor)
SMOLLM2_ROPE_THETA = 100000.0  # SmolLM2-135M's RoPE base (a shape of model.arch=donor takes the donor's)
H100_BF16_TFLOPS = 989.0  # H100 SXM dense bf16 peak: the MFU denominator the issue uses


@dataclass(frozen=True)
class Shape:
    """A llama shape with the batch x seq it is measured at."""

    name: str
    vocab: int
    d_model: int
    n_layer: int
    n_head: int
    n_kv_head: int
    d_ff: int
    batch: int
    seq: int
    rope_theta: float = 10000.0

    def describe_model(self) -> str:
        return (
            f"{self.name}: d_model {self.d_model}, {self.n_layer} layers, {self.n_head} heads ({self.n_kv_head} kv), "
            f"ffn {self.d_ff}, vocab {self.vocab}, tied"
        )

    def describe(self) -> str:
        return f"{self.describe_model()}; batch {self.batch} x seq {self.seq}"

    def config(self, context: int | None = None) -> TransformerConfig:
        """Our model's config for this shape (context = seq unless given)."""
        return TransformerConfig(
            self.vocab,
            self.d_model,
            self.n_layer,
            self.n_head,
            self.n_kv_head,
            self.d_ff,
            context_length=context or self.seq,
            rope_theta=self.rope_theta,
        )


def conf_shape(name: str, model: str, batch: int, seq: int) -> Shape:
    """A shape from conf/model/<model>.yaml, so the benchmark follows the config if it changes."""
    m = yaml.safe_load((ROOT / "conf" / "model" / f"{model}.yaml").read_text())
    dims = [m[k] for k in ("d_model", "n_layer", "n_head", "n_kv_head", "d_ff")]
    theta = m["rope_theta"] or SMOLLM2_ROPE_THETA  # 0 = the donor's (model.arch=donor): the default donor's
    return Shape(name, SMOLLM2_VOCAB, *dims, batch, seq, theta)


def default_run_batch_seq() -> tuple[int, int]:
    """train.batch_size x train.seq_len of the default run (conf/train/default.yaml)."""
    t = yaml.safe_load((ROOT / "conf" / "train" / "default.yaml").read_text())
    return t["batch_size"], t["seq_len"]


def named_shapes() -> dict[str, Shape]:
    """The shapes issue 19 names; `smoke` is a toy one for proving the code paths on a CPU."""
    b, t = default_run_batch_seq()
    return {
        # SmolLM2-135M (the donor): head size 64, RoPE base 1e5
        "135m": Shape("135m", SMOLLM2_VOCAB, 576, 30, 9, 3, 1536, 16, 1024, SMOLLM2_ROPE_THETA),
        "tiny": conf_shape("tiny", "llama-tiny", 64, 512),
        "tiny-default": conf_shape("tiny-default", "llama-tiny", b, t),
        "small": conf_shape("small", "llama-small", 32, 512),
        "default": conf_shape("default", "subclone", b, t),  # the default run's student (model=subclone)
        "smoke": Shape("smoke", 512, 64, 2, 4, 2, 128, 2, 64),
    }


def pick_shapes(spec: str, batch: int | None, seq: int | None) -> list[Shape]:
    """Comma-separated shape names, each with its own batch x seq unless `batch`/`seq` override them."""
    known = named_shapes()
    unknown = [s for s in spec.split(",") if s not in known]
    if unknown:
        sys.exit(f"unknown shape(s) {', '.join(unknown)}; known: {', '.join(known)}")
    return [replace(known[s], batch=batch or known[s].batch, seq=seq or known[s].seq) for s in spec.split(",")]


def matmul_params(shape: Shape) -> int:
    """Parameters that multiply activations (attention, FFN, the tied head); not norms or the lookup."""
    hd = shape.d_model // shape.n_head
    attn = 2 * shape.d_model * shape.n_head * hd + 2 * shape.d_model * shape.n_kv_head * hd
    return shape.n_layer * (attn + 3 * shape.d_model * shape.d_ff) + shape.vocab * shape.d_model


def train_flops_per_token(shape: Shape) -> float:
    """6 x matmul parameters + 6 x layers x seq x d_model (causal attention), as issue 19 counts it."""
    return 6 * matmul_params(shape) + 6 * shape.n_layer * shape.seq * shape.d_model


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)} (torch {torch.__version__}, CUDA {torch.version.cuda})"
    cap = torch.backends.cpu.get_cpu_capability()
    return f"CPU {platform.machine()} {cap}, {torch.get_num_threads()} threads (torch {torch.__version__})"


def sync(device: torch.device) -> None:
    """Wait for queued kernels, so a wall-clock interval covers the work it launched."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def clock(device: torch.device) -> float:
    sync(device)
    return time.perf_counter()


def _rss_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def release(device: torch.device, compiled: bool = False) -> None:
    """Free what the last contender left (its compiled graphs too) and restart the peak-memory count:
    each contender's peak is then its own, not the largest of all so far."""
    if compiled:
        torch._dynamo.reset()  # compiled code keeps the model it traced alive
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        return
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS
    except OSError:
        pass


def peak_mib(device: torch.device) -> float:
    """Peak memory since `release`: CUDA allocations on a GPU, the process's resident high-water mark on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return _rss_kib("VmHWM") / 1024


def memory_label(device: torch.device) -> str:
    return "peak alloc MiB" if device.type == "cuda" else "peak RSS MiB"


def hf_llama(shape: Shape, attn: str = "sdpa"):
    """transformers' LlamaForCausalLM of `shape` (random init), on CPU in fp32."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=shape.vocab,
        hidden_size=shape.d_model,
        intermediate_size=shape.d_ff,
        num_hidden_layers=shape.n_layer,
        num_attention_heads=shape.n_head,
        num_key_value_heads=shape.n_kv_head,
        max_position_embeddings=max(shape.seq, 2048),
        rope_theta=shape.rope_theta,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        attn_implementation=attn,
    )
    return LlamaForCausalLM(cfg)


def one_line(e: BaseException) -> str:
    """An error as one line (its type and the first line of its message)."""
    msg = str(e).strip().splitlines()
    return f"{type(e).__name__}: {msg[0][:200] if msg else ''}"


def guarded(name: str, fn: Callable[[], object]) -> object | None:
    """fn(), or None after printing one line naming the contender and the error (compile error, OOM...)."""
    try:
        return fn()
    except Exception as e:  # noqa: BLE001 - any failure of one contender must not stop the others
        print(f"  {name:16s} failed: {one_line(e)}", flush=True)
        return None
