"""What every architecture's GGUF mapping shares: the name map from our parameters to GGUF tensors,
shape-checked loading onto a module built on the meta device, and the tensors an export writes.

The tables themselves live in `pipeline.models.names`; `llama_gguf.py` and `gpt2_gguf.py` add
their architecture's keys and checks.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from pipeline.errors import GGUFError, problem
from pipeline.gguf.reader import GGUFFile
from pipeline.models.names import OUTPUT, TOKEN_EMBD
from pipeline.models.transformer import DecoderLM


@dataclass(frozen=True)
class TensorLayout:
    """An architecture's GGUF tensors: before the blocks, per block, after them (file order)."""

    inputs: dict[str, str]
    block: dict[str, str]
    outputs: dict[str, str]

    def names(self, n_layer: int, tied: bool) -> dict[str, str]:
        """Our parameter name -> GGUF tensor name for a whole model (`head.weight` only when untied)."""
        names = dict(self.inputs)
        for i in range(n_layer):
            names.update({f"blocks.{i}.{ours}": f"blk.{i}.{theirs}" for ours, theirs in self.block.items()})
        names.update(self.outputs)
        if not tied:
            names["head.weight"] = OUTPUT
        return names

    def required(self, n_layer: int) -> set[str]:
        """The GGUF tensors a model of `n_layer` blocks must have (an untied head's output.weight aside)."""
        return set(self.names(n_layer, tied=True).values())


def check_tensor_set(g: GGUFFile, expected: set[str], optional: set[str], what: str, fix: str) -> None:
    """Exactly the tensors our module has (plus `optional`): nothing missing, nothing ignored."""
    present = set(g.tensor_names())
    missing = sorted(expected - present)
    if missing:
        raise GGUFError(problem(str(g.path), what, f"{missing[:4]} missing", "re-export it"))
    extra = sorted(present - expected - optional)
    if extra:
        more = f" and {len(extra) - 4} more" if len(extra) > 4 else ""
        raise GGUFError(problem(str(g.path), "only tensors our module uses", f"{extra[:4]}{more}", fix))


def check_shapes(g: GGUFFile, expected: dict[str, tuple[int, ...]], keys: str) -> None:
    """Every present tensor has the shape the header keys imply, checked before a module of that size
    is built: a forged key is a named error, never a torch allocation or an overflow."""
    for name, want in expected.items():
        if g.has_tensor(name) and g.tensor_info(name).shape != want:
            raise GGUFError(
                problem(
                    f"{g.path} tensor {name}",
                    f"shape {want} (from the {keys} keys)",
                    f"shape {g.tensor_info(name).shape}",
                    "the header keys and the tensors disagree; re-export the file",
                )
            )


def assign_from_gguf(model: nn.Module, g: GGUFFile, names: dict[str, str], strict: bool = True) -> None:
    """Give a meta-device module the file's tensors (dequantized to fp32) as its parameters, each
    shape-checked by name: no throw-away random init is ever computed. `strict=False` leaves the
    module's other entries (QLoRA's quantized blocks) as they are."""
    expected = model.state_dict()
    state = {}
    for ours, theirs in names.items():
        arr = g.tensor(theirs)
        want = tuple(expected[ours].shape)
        if arr.shape != want:
            raise GGUFError(
                problem(f"{g.path} tensor {theirs}", f"shape {want}", f"shape {arr.shape}", "the file is inconsistent")
            )
        state[ours] = torch.from_numpy(arr)
    model.load_state_dict(state, strict=strict, assign=True)


def export_tensors(model: DecoderLM, names: dict[str, str]) -> dict[str, np.ndarray]:
    """Every tensor under its GGUF name, fp32, in `names` order, with a lens folded into the
    embedding table. A tied head is left out, as llama.cpp's converter does (since llama.cpp PR
    #12456): llama.cpp then reads token_embd as the head and transformers ties the weights."""
    with torch.no_grad():
        params = dict(model.named_parameters())
        out = {}
        for ours, theirs in names.items():
            tensor = model.embedding_table() if theirs == TOKEN_EMBD else params[ours]
            out[theirs] = tensor.detach().float().cpu().numpy()
    return out
