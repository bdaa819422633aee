"""QLoRA's frozen base: a GGUF's own quantized blocks kept in memory, dequantized per matmul in torch.

`QuantLinear` holds a matrix as the GGUF stored it (scales as fp16, quants as packed uint8; K-quant
super-blocks, Q4_K/Q5_K/Q6_K as llama.cpp's Q4_K_M/Q5_K_M/Q6_K mixes write them, as their raw bytes) and
rebuilds the fp32 weight for each forward and backward matmul, so the fp32 matrix never outlives
one matmul: autograd saves nothing of it (a custom Function re-dequantizes in backward; the base
is frozen, so only the input gradient is needed). The torch dequantization reproduces
`gguf.quants.dequantize` bit for bit in fp32 (same operations in the same order), so a QLoRA model
computes exactly what the dequantized (LoRA) base computes. `QuantEmbedding` keeps the token table
the same way: a lookup rebuilds only the looked-up rows.
"""

from __future__ import annotations

import os

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from pipeline.errors import GGUFError, problem
from pipeline.gguf.reader import GGUFFile
from pipeline.models.convert import assign_from_gguf
from pipeline.models.devices import matmul_dtype
from pipeline.models.llama import Llama
from pipeline.models.llama_gguf import LAYOUTS, config_from_gguf
from pipeline.models.names import LLAMA_LAYERS, TOKEN_EMBD

# ggml type -> (block size in weights, block size in bytes)
K_BLOCKS = {"Q4_K": (256, 144), "Q5_K": (256, 176), "Q6_K": (256, 210)}  # super-blocks, kept whole as `raw`
BLOCKS = {
    **K_BLOCKS,
    "Q4_0": (32, 18),
    "Q4_1": (32, 20),
    "Q5_0": (32, 22),
    "Q5_1": (32, 24),
    "Q8_0": (32, 34),
    "F16": (1, 2),
    "BF16": (1, 2),
    "F32": (1, 4),
}
SUPPORTED_TYPES = tuple(BLOCKS)
ROWS_AT_ONCE = 8192  # rows rebuilt at a time when a large matrix is wanted in a dtype other than fp32


def split_blocks(
    raw: np.ndarray, ggml_type: str, shape: tuple[int, int], where: str = "tensor"
) -> dict[str, torch.Tensor]:
    """A tensor's raw bytes as named torch fields: `d` (and `m`) fp16 scales, `qs`/`qh` packed uint8, or `w`.

    Copies off the mmap (the fields are small: the quantized size of the matrix).
    """
    if ggml_type not in BLOCKS:
        raise GGUFError(
            problem(
                where,
                f"a tensor type QLoRA keeps quantized ({', '.join(SUPPORTED_TYPES)})",
                ggml_type,
                "use recipe=lora (it dequantizes any type gguf-py knows), or a Q4_K_M/Q4_1/Q8_0 GGUF",
            )
        )
    per_block, nbytes = BLOCKS[ggml_type]
    out_f, in_f = shape
    if in_f % per_block or raw.size != out_f * in_f // per_block * nbytes:
        raise GGUFError(
            problem(where, f"{out_f}x{in_f} weights of {ggml_type}", f"{raw.size} bytes", "the file is inconsistent")
        )
    if per_block == 1:
        dtype = {"F16": np.float16, "BF16": np.uint16, "F32": np.float32}[ggml_type]
        w = torch.from_numpy(np.array(raw.view(dtype).reshape(out_f, in_f)))
        return {"w": w.view(torch.bfloat16) if ggml_type == "BF16" else w}
    blocks = raw.reshape(-1, nbytes)
    if ggml_type in K_BLOCKS:  # sliced per matmul by `dequantize_k` (the fields are not byte-aligned to 4)
        return {"raw": torch.from_numpy(np.array(blocks))}
    fields: dict[str, torch.Tensor] = {}
    offset = 0
    layout = {
        "Q4_0": (("d", 2), ("qs", 16)),
        "Q4_1": (("d", 2), ("m", 2), ("qs", 16)),
        "Q5_0": (("d", 2), ("qh", 4), ("qs", 16)),
        "Q5_1": (("d", 2), ("m", 2), ("qh", 4), ("qs", 16)),
        "Q8_0": (("d", 2), ("qs", 32)),
    }[ggml_type]
    for name, size in layout:
        part = np.array(blocks[:, offset : offset + size])  # contiguous copy
        offset += size
        if name in ("d", "m"):
            fields[name] = torch.from_numpy(part.view(np.float16).reshape(-1))
        elif ggml_type == "Q8_0":
            fields[name] = torch.from_numpy(part.view(np.int8))
        else:
            fields[name] = torch.from_numpy(part)
    return fields


def dequantize(ggml_type: str, fields: dict[str, torch.Tensor], shape: tuple[int, int]) -> torch.Tensor:
    """The fp32 matrix of `shape`, with gguf-py's arithmetic (so equal to its output bit for bit)."""
    if "w" in fields:
        return fields["w"].float()
    if "raw" in fields:
        return dequantize_k(ggml_type, fields["raw"]).reshape(shape)
    d = fields["d"].float().unsqueeze(1)
    if ggml_type == "Q8_0":
        return fields["qs"].float().mul_(d).reshape(shape)
    qs = fields["qs"]
    q = torch.empty((qs.shape[0], 32), dtype=torch.uint8, device=qs.device)
    torch.bitwise_and(qs, 0x0F, out=q[:, :16])  # 16 low nibbles, then 16 high nibbles
    torch.bitwise_right_shift(qs, 4, out=q[:, 16:])
    if ggml_type in ("Q5_0", "Q5_1"):
        bits = torch.arange(8, dtype=torch.uint8, device=qs.device)
        qh = ((fields["qh"].unsqueeze(-1) >> bits) & 1).reshape(q.shape)  # bit j of the LE uint32 -> weight j
        q |= qh << 4
    if ggml_type in ("Q4_0", "Q5_0"):
        w = (q.view(torch.int8) - (8 if ggml_type == "Q4_0" else 16)).float().mul_(d)
    else:
        w = q.float().mul_(d).add_(fields["m"].float().unsqueeze(1))  # (d * q) + m, rounded per op as gguf-py
    return w.reshape(shape)


def _f16(raw: torch.Tensor, start: int) -> torch.Tensor:
    """The fp16 at byte `start` of every block, as fp32 (n, 1)."""
    return raw[:, start : start + 2].contiguous().view(torch.float16).float()


def _shifted(q: torch.Tensor, shifts: tuple[int, ...], mask: int) -> torch.Tensor:
    """`(q[:, :, None, :] >> shifts[None, None, :, None]) & mask`: (n, groups, width) -> (n, groups, shifts, width)."""
    s = torch.tensor(shifts, dtype=torch.uint8, device=q.device).view(1, 1, -1, 1)
    return (q.unsqueeze(2) >> s) & mask


def _scale_min_k4(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K's eight 6-bit scales and mins of each super-block (gguf-py's `get_scale_min`)."""
    d, m, m_d = scales.view(-1, 3, 4).unbind(1)
    sc = torch.cat((d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)), dim=-1)
    mn = torch.cat((m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)), dim=-1)
    return sc, mn


def dequantize_k(ggml_type: str, raw: torch.Tensor) -> torch.Tensor:
    """(n, 256) fp32 weights of n K-quant super-blocks `raw` (n, bytes), with gguf-py's operations in its
    order (fp32 `d * sc`, then `d * q - dmin * m`), so equal to `gguf.quants.dequantize` bit for bit."""
    n = raw.shape[0]
    if ggml_type == "Q6_K":
        ql, qh = raw[:, :128].reshape(n, 2, 64), raw[:, 128:192].reshape(n, 2, 32)
        d = (_f16(raw, 208) * raw[:, 192:208].view(torch.int8).float()).view(n, 16, 1)
        low = _shifted(ql, (0, 4), 0x0F).reshape(n, 8, 32)
        high = _shifted(qh, (0, 2, 4, 6), 0x03).reshape(n, 8, 32)
        q = ((low | (high << 4)).view(torch.int8) - 32).view(n, 16, 16).float()
        return (d * q).reshape(n, 256)
    sc, mn = _scale_min_k4(raw[:, 4:16])
    d = (_f16(raw, 0) * sc.float()).view(n, 8, 1)
    dm = (_f16(raw, 2) * mn.float()).view(n, 8, 1)
    qs = raw[:, -128:].reshape(n, 4, 32)
    q = _shifted(qs, (0, 4), 0x0F).reshape(n, 8, 32)
    if ggml_type == "Q5_K":
        q = q | (_shifted(raw[:, 16:48].reshape(n, 1, 32), tuple(range(8)), 0x01).reshape(n, 8, 32) << 4)
    return (d * q.float() - dm).reshape(n, 256)


class _DequantLinear(torch.autograd.Function):
    """y = x @ W.T with W rebuilt from the blocks in forward and again in backward (never saved)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, layer: QuantLinear) -> torch.Tensor:
        dtype = matmul_dtype(x.device.type, x.dtype)
        ctx.layer, ctx.dtype, ctx.x_dtype = layer, dtype, x.dtype
        with torch.autocast(device_type=x.device.type, enabled=False):
            return F.linear(x.to(dtype), layer.weight_as(dtype))

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        w = ctx.layer.weight_as(ctx.dtype)
        return (grad.to(ctx.dtype) @ w).to(ctx.x_dtype), None


class QuantMatrix(nn.Module):
    """A frozen (out, in) matrix kept in its GGUF block format (the file's bytes, split into fields).

    `cache_weight(dtype)` also keeps it dequantized in the dtype the matmuls run in (recipe=lora: no
    step rebuilds or re-casts it); any other dtype (fp32 validation under bf16 training) is still
    rebuilt exactly from the blocks.
    """

    cached: torch.Tensor | None

    def __init__(self, in_features: int, out_features: int, ggml_type: str, fields: dict[str, torch.Tensor]):
        super().__init__()
        self.in_features, self.out_features, self.ggml_type = in_features, out_features, ggml_type
        for name, t in fields.items():
            self.register_buffer(name, t)
        self._field_names = tuple(fields)
        self.register_buffer("cached", None, persistent=False)

    @classmethod
    def from_gguf(cls, g: GGUFFile, name: str) -> QuantMatrix:
        raw, ggml_type, shape = g.raw_tensor(name)
        if len(shape) != 2:
            raise GGUFError(
                problem(f"{g.path} tensor {name}", "a matrix", f"shape {shape}", "the file is inconsistent")
            )
        fields = split_blocks(raw, ggml_type, shape, f"{g.path} tensor {name}")
        return cls(shape[1], shape[0], ggml_type, fields)

    def fields(self) -> dict[str, torch.Tensor]:
        return {n: getattr(self, n) for n in self._field_names}

    def dequantize(self) -> torch.Tensor:
        """The fp32 (out, in) weight; rebuilt on every call."""
        return dequantize(self.ggml_type, self.fields(), (self.out_features, self.in_features))

    def dequantize_rows(self, rows: torch.Tensor | slice) -> torch.Tensor:
        """The fp32 rows `rows` of the weight, rebuilt from their own blocks only (a row is whole blocks)."""
        picked = {}
        for name, t in self.fields().items():
            per_row = t.shape[0] // self.out_features  # blocks per row (1 for a dense `w`: its rows)
            picked[name] = t.view(self.out_features, per_row, *t.shape[1:])[rows].flatten(0, 1)
        n = len(range(*rows.indices(self.out_features))) if isinstance(rows, slice) else rows.numel()
        return dequantize(self.ggml_type, picked, (n, self.in_features))

    def cache_weight(self, dtype: torch.dtype) -> None:
        self.cached = None
        self.cached = self.weight_as(dtype)

    def weight_as(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight in `dtype`: the cached copy when it has that dtype, else rebuilt from the blocks
        (`ROWS_AT_ONCE` rows at a time for another dtype: no whole fp32 copy of a token table)."""
        if self.cached is not None and self.cached.dtype == dtype:
            return self.cached
        if dtype == torch.float32 or self.out_features <= ROWS_AT_ONCE:
            return self.dequantize().to(dtype)
        out = torch.empty(self.out_features, self.in_features, dtype=dtype, device=self.device)
        for r in range(0, self.out_features, ROWS_AT_ONCE):
            out[r : r + ROWS_AT_ONCE] = self.dequantize_rows(slice(r, r + ROWS_AT_ONCE))
        return out

    @property
    def device(self) -> torch.device:
        """Where the blocks are (and any copy made from them goes)."""
        return getattr(self, self._field_names[0]).device

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, type={self.ggml_type}"


class QuantLinear(QuantMatrix):
    """A frozen linear layer whose weight stays in its GGUF block format; `bias` (Qwen2's q/k/v), a
    frozen fp32 parameter or None."""

    bias: nn.Parameter | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = _DequantLinear.apply(x, self)
        return y if self.bias is None else y + self.bias.to(y.dtype)


class QuantEmbedding(QuantMatrix):
    """A frozen token table kept in its GGUF blocks (a Q8_0 table is a quarter of fp32's bytes).

    A lookup rebuilds only the looked-up rows, exactly; as a tied head, `weight` is the table in the
    dtype matmuls run in now (autocast's, else fp32), as `QuantLinear` computes.
    """

    @property
    def weight(self) -> torch.Tensor:
        return self.weight_as(matmul_dtype(self.device.type, torch.float32))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.dequantize_rows(idx.reshape(-1)).view(*idx.shape, self.in_features)


def load_quantized_base(source: str | os.PathLike[str] | GGUFFile) -> nn.Module:
    """A llama-family GGUF as our module with every block matrix a frozen `QuantLinear` (its own blocks).

    The token table too (`QuantEmbedding`) when its type is one of `BLOCKS`; norms, an untied head and
    a table of another type are dequantized to fp32 as `load_gguf` does; nothing else is ever
    materialised in fp32 (the module is built on the meta device first).
    """
    g = source if isinstance(source, GGUFFile) else GGUFFile(source)
    cfg = config_from_gguf(g)
    with torch.device("meta"):
        model = Llama(cfg)
    matrices = [layer for layer in LLAMA_LAYERS if not layer.is_norm]
    for i, block in enumerate(model.blocks):
        for layer in matrices:
            _quantize_layer(g, block, layer.ours, f"blk.{i}.{layer.gguf}.weight")
    _quantize_table(g, model)
    left = model.state_dict()  # the dense rest: embeddings, norms, biases, an untied head
    names = LAYOUTS[cfg.arch].names(cfg.n_layer, cfg.tie_embeddings)
    assign_from_gguf(model, g, {ours: theirs for ours, theirs in names.items() if ours in left}, strict=False)
    for p in model.parameters():
        p.requires_grad_(False)
    return model


def _quantize_layer(g: GGUFFile, block: nn.Module, path: str, tensor: str) -> None:
    """Replace the linear layer at `path` in `block` by the file's quantized tensor, shape-checked."""
    layer = QuantLinear.from_gguf(g, tensor)
    old = block.get_submodule(path)
    if (layer.out_features, layer.in_features) != (old.out_features, old.in_features):
        raise GGUFError(
            problem(
                f"{g.path} tensor {tensor}",
                f"shape {(old.out_features, old.in_features)}",
                f"shape {(layer.out_features, layer.in_features)}",
                "the file is inconsistent",
            )
        )
    if getattr(old, "bias", None) is not None:  # loaded with the dense rest (`assign_from_gguf`)
        layer.bias = nn.Parameter(torch.empty(layer.out_features, device="meta"), requires_grad=False)
    parent_path, attr = path.rsplit(".", 1)
    setattr(block.get_submodule(parent_path), attr, layer)


def _quantize_table(g: GGUFFile, model: nn.Module) -> None:
    """The token table stays in its blocks too, when its type is one QLoRA keeps (else it loads as fp32)."""
    _, ggml_type, shape = g.raw_tensor(TOKEN_EMBD)
    old = model.tok_embd
    if ggml_type in BLOCKS and shape == (old.num_embeddings, old.embedding_dim):
        model.tok_embd = QuantEmbedding.from_gguf(g, TOKEN_EMBD)


def cache_weights(model: nn.Module, dtype: torch.dtype, kind: type[QuantMatrix] = QuantMatrix) -> int:
    """Every quantized matrix of `model` (of `kind`) also keeps its weight in `dtype`; the bytes held."""
    layers = [m for m in model.modules() if isinstance(m, kind)]
    for m in layers:
        m.cache_weight(dtype)
    return sum(m.cached.numel() * m.cached.element_size() for m in layers)


def dequantize_model(model: nn.Module) -> nn.Module:
    """Replace every quantized matrix by a frozen fp32 nn.Linear (nn.Embedding) of its weight (in place)."""
    quantized = [(name, m) for name, m in model.named_modules() if isinstance(m, QuantMatrix)]
    for name, m in quantized:
        if isinstance(m, QuantEmbedding):
            dense = nn.Embedding(m.out_features, m.in_features, device="meta")
        else:
            dense = nn.Linear(m.in_features, m.out_features, bias=m.bias is not None, device="meta")
            if m.bias is not None:
                dense.bias = nn.Parameter(m.bias.detach().clone(), requires_grad=False)
        dense.weight = nn.Parameter(m.dequantize(), requires_grad=False)
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent), attr, dense)
    return model
