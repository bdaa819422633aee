"""Padding-free attention for packed rows: every example attends only to itself, no padding is computed.

Packed instruction rows hold one or more examples and end in padding (segment 0): on real data a
third or more of a row. `PackedRows` drops the padding before the first block (the model runs on the
N real tokens as one sequence), and attention runs per example: the examples are gathered into
(examples, length) batches, grouped by length so short ones are not padded to the longest, and each
batch attends causally. Mathematically this is the block-diagonal mask; the work is the examples'
own (no T x T matrix per row, no padding rows through the matmuls). On a GPU with flash attention (bf16 or
fp16, sm80+) one varlen kernel does all examples at once from their offsets, as flash-attn's varlen API does:
the buckets' shapes change every batch, and each new shape costs cuDNN's SDPA a new plan on the host
(~3 ms a call, measured on an H200), which made packed LoRA steps host-bound.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pipeline.models.devices import to_device


@dataclass(frozen=True)
class Bucket:
    """Examples of similar length: `gather` (S, L) indexes the kept tokens (padded slots repeat the
    example's first token: causal attention never lets a real token see them), `scatter` (n,) the
    place of each of the bucket's tokens in the flattened (S*L) batch."""

    gather: torch.Tensor
    scatter: torch.Tensor
    tokens: torch.Tensor  # (n,) indices of the bucket's tokens among the kept ones
    source: torch.Tensor  # (S*L,) the kept token each slot holds, N (one past the last) for padded slots


class PackedRows:
    """The real tokens of (B, T) packed rows and how they split into examples.

    Built where `segment_ids` live, its index tensors then moved to `device`: the training loop keeps
    a batch's segment ids on the host, so on a GPU building them waits for nothing (`nonzero`, `max`
    and `tolist` on device tensors would each wait for every queued kernel)."""

    def __init__(self, segment_ids: torch.Tensor, device: torch.device | None = None):
        seg = segment_ids.reshape(-1)
        keep = torch.nonzero(seg != 0).squeeze(1)  # flat (B*T) index of each real token
        row = keep // segment_ids.shape[-1]
        ids = row * (int(segment_ids.max()) + 1) + seg[keep]  # unique per (row, example)
        starts = torch.ones_like(ids, dtype=torch.bool)
        starts[1:] = ids[1:] != ids[:-1]
        first = torch.nonzero(starts).squeeze(1)
        lengths = torch.diff(first, append=torch.tensor([len(ids)], device=ids.device))
        example = torch.cumsum(starts.long(), 0) - 1
        positions = torch.arange(len(ids), device=ids.device) - first[example]  # restart at each example
        self.longest = int(lengths.max()) if len(lengths) else 0  # positions run 0 .. longest-1
        device = segment_ids.device if device is None else torch.device(device)
        self._host_keep, self._device, self._examples = keep, device, (first, lengths, example, positions)
        self.keep, self.positions = (to_device(t, device) for t in (keep, positions))
        self._buckets: tuple[list[Bucket], torch.Tensor] | None = None
        self._offsets: torch.Tensor | None = None

    @property
    def buckets(self) -> list[Bucket]:
        """The examples grouped by length, built on first use (the flash path needs none)."""
        return self._grouped()[0]

    def _grouped(self) -> tuple[list[Bucket], torch.Tensor]:
        if self._buckets is None:
            buckets = _buckets(*self._examples)
            order = torch.cat([b.tokens for b in buckets])
            inverse = torch.empty_like(order)
            inverse[order] = torch.arange(len(order), device=order.device)
            fields = ((b.gather, b.scatter, b.tokens, b.source) for b in buckets)
            moved = [Bucket(*(to_device(t, self._device) for t in f)) for f in fields]
            self._buckets = moved, to_device(inverse, self._device)
        return self._buckets

    def offsets(self) -> torch.Tensor:
        """(examples + 1,) int32 start of each example among the kept tokens, then their count: flash's cu_seqlens."""
        if self._offsets is None:
            first = self._examples[0]
            ends = torch.cat([first, torch.tensor([len(self._host_keep)], device=first.device)])
            self._offsets = to_device(ends.to(torch.int32), self._device)
        return self._offsets

    def __len__(self) -> int:
        return len(self.keep)

    def select(self, t: torch.Tensor) -> torch.Tensor:
        """The real tokens' entries of a (B, T, ...) tensor, as (N, ...), on `t`'s device."""
        keep = self.keep if t.device == self.keep.device else self._host_keep.to(t.device)
        return t.flatten(0, 1).index_select(0, keep)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """(1, H, N, D) queries, (1, KV, N, D) keys/values -> (1, H, N, D), each example causal alone."""
        q, k, v = (z[0].transpose(0, 1) for z in (q, k, v))  # (N, heads, D)
        if flash_varlen_ready(q):
            out = _FlashVarlen.apply(q.contiguous(), k.contiguous(), v.contiguous(), self.offsets(), self.longest)
            return out.transpose(0, 1).unsqueeze(0)
        if q.device.type == "cpu":
            return _CpuPacked.apply(q, k, v, self).transpose(0, 1).unsqueeze(0)
        return self.attend_buckets(q, k, v).transpose(0, 1).unsqueeze(0)

    def attend_buckets(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """(N, H, D) -> (N, H, D) through `causal_attention` per bucket, autograd's graph around it."""
        buckets, inverse = self._grouped()
        outs = []
        for b in buckets:  # index_select: its backward (index_add) is far cheaper than indexing's
            s, length = b.gather.shape
            qb, kb, vb = (z.index_select(0, b.gather.flatten()).view(s, length, *z.shape[1:]) for z in (q, k, v))
            y = causal_attention(qb.transpose(1, 2), kb.transpose(1, 2), vb.transpose(1, 2))  # (S, heads, L, D)
            outs.append(y.transpose(1, 2).reshape(s * length, *y.shape[1:2], y.shape[3]).index_select(0, b.scatter))
        return torch.cat(outs).index_select(0, inverse) if len(outs) > 1 else outs[0]


_PLAIN_ATTEND = PackedRows.attend


def keep_attend_eager() -> None:
    """`torch.compiler.disable` on `PackedRows.attend` (a loop over this batch's buckets: compiled
    blocks call it as it is). `compile_blocks` applies it, not a decorator: that would import
    torch._dynamo, ~1.5 s, at the start of every stage and of `generate`."""
    if PackedRows.attend is _PLAIN_ATTEND:
        PackedRows.attend = torch.compiler.disable(_PLAIN_ATTEND)


def flash_varlen_ready(q: torch.Tensor) -> bool:
    """Whether torch's flash attention kernel takes these (N, H, D) queries: CUDA sm80+, half precision,
    a head size it was built for."""
    d = q.shape[-1]
    return (
        q.is_cuda
        and q.dtype in (torch.float16, torch.bfloat16)
        and d % 8 == 0
        and d <= 256
        and torch.cuda.get_device_capability(q.device)[0] >= 8
    )


class _FlashVarlen(torch.autograd.Function):
    """Causal attention of every packed example at once: (N, H, D) queries, (N, KV, D) keys/values (GQA
    in the kernel: no repeated heads), examples delimited by `offsets`; torch's own flash kernels, forward
    and backward, called as `torch.nn.attention.varlen` does (whose signature changed between releases)."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offsets: torch.Tensor, longest: int):
        out, lse, rng, unused, _ = torch.ops.aten._flash_attention_forward(
            q, k, v, offsets, offsets, longest, longest, 0.0, True, False
        )
        ctx.save_for_backward(q, k, v, out, lse, offsets, rng, unused)
        ctx.longest = longest
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        q, k, v, out, lse, offsets, rng, unused = ctx.saved_tensors
        n = ctx.longest
        dq, dk, dv = torch.ops.aten._flash_attention_backward(
            grad.contiguous(), q, k, v, out, lse, offsets, offsets, n, n, 0.0, True, rng, unused
        )
        return dq, dk, dv, None, None


def _buckets(first: torch.Tensor, lengths: torch.Tensor, example: torch.Tensor, positions: torch.Tensor) -> list:
    """Examples grouped by length (powers of two): each group padded only to its own longest."""
    group = torch.ceil(torch.log2(lengths.clamp(min=1).double())).long()
    out = []
    for g in torch.unique(group).tolist():
        members = torch.nonzero(group == g).squeeze(1)  # example indices
        length = int(lengths[members].max())
        slots = torch.arange(length, device=first.device)
        gather = torch.where(slots < lengths[members, None], first[members, None] + slots, first[members, None])
        slot_of = torch.full_like(example, -1)
        slot_of[members] = torch.arange(len(members), device=first.device)
        tokens = torch.nonzero(slot_of[example] >= 0).squeeze(1)
        scatter = slot_of[example[tokens]] * length + positions[tokens]
        source = torch.full((gather.numel(),), len(example), dtype=torch.long, device=first.device)
        source[scatter] = tokens
        out.append(Bucket(gather, scatter, tokens, source))
    return out


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal grouped-query attention of (S, H, L, D) queries over (S, KV, L, D) keys/values."""
    if q.device.type == "cpu":
        return _CpuFlash.apply(q, k, v)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1])


class _CpuFlash(torch.autograd.Function):
    """torch's CPU flash attention kernels, forward and backward, always in fp32 (GQA in the kernel: no
    repeated heads), keeping q, k, v and the output in their own dtype for backward. Measured fwd+bwd at 2
    threads (`benchmarks/results/lora_speed.md`): the bf16 kernel is 1.6-5x slower than the fp32 one (short
    examples worst), the plain-matmul attention with fp32 softmax this replaces ~2x; the backward is
    deterministic (tested at 2 and 5 threads), as exact resume needs."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        out, lse = _flash(*_wide(q, k, v))
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = _flash_grad(*_wide(grad, q, k, v, out), lse)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class _CpuPacked(torch.autograd.Function):
    """`PackedRows.attend` on CPU: `_CpuFlash` per bucket, with q, k, v and the gradients cast to fp32
    once per call (not once per bucket) and each bucket's rows put straight into place: autograd's own
    graph of the gathers zero-filled an (N, heads, D) gradient per gather and scattered into it
    (index_add), a tenth of a LoRA step's elementwise traffic. The same bits as that graph (tested)."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rows: PackedRows) -> torch.Tensor:
        wide, buckets = _wide(q, k, v), rows.buckets
        out = torch.empty(q.shape, dtype=q.dtype)
        kept = []
        for b in buckets:
            y, lse = _flash(*_bucket(wide, b))
            y = y.to(q.dtype)
            out.index_copy_(0, b.tokens, _unbucket(y, b))
            kept += [y, lse]
        ctx.save_for_backward(q, k, v, *kept)
        ctx.buckets = buckets
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        q, k, v, *kept = ctx.saved_tensors
        wide, (grad,) = _wide(q, k, v), _wide(grad)
        padded = torch.cat([grad, grad.new_zeros(1, *grad.shape[1:])])  # the row padded slots read
        grads = [torch.empty(z.shape, dtype=z.dtype) for z in wide]
        for i, b in enumerate(ctx.buckets):
            y, lse = kept[2 * i], kept[2 * i + 1]
            g = padded.index_select(0, b.source).view(*b.gather.shape, *grad.shape[1:]).transpose(1, 2)
            d = _flash_grad(g, *_bucket(wide, b), y.to(grad.dtype), lse)
            for full, part in zip(grads, d):
                full.index_copy_(0, b.tokens, _unbucket(part, b))
        return (*(g.to(z.dtype) for g, z in zip(grads, (q, k, v))), None)


def _flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """torch's CPU flash kernel, causal, on (S, heads, L, D) tensors already in fp32 (or fp64): (out, lse)."""
    with torch.autocast("cpu", enabled=False):
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, True)


def _flash_grad(grad, q, k, v, out, lse) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Its backward: (dq, dk, dv) in the operands' dtype."""
    with torch.autocast("cpu", enabled=False):
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(grad, q, k, v, out, lse, 0.0, True)


def _bucket(ts: tuple[torch.Tensor, ...], b: Bucket) -> tuple[torch.Tensor, ...]:
    """(N, heads, D) tensors gathered into the bucket's (S, heads, L, D) examples."""
    return tuple(t.index_select(0, b.gather.flatten()).view(*b.gather.shape, *t.shape[1:]).transpose(1, 2) for t in ts)


def _unbucket(t: torch.Tensor, b: Bucket) -> torch.Tensor:
    """The bucket's (S, heads, L, D) rows of its real tokens, as (n, heads, D) in `b.tokens` order."""
    return t.transpose(1, 2).reshape(-1, *t.shape[1:2], t.shape[3]).index_select(0, b.scatter)


def _wide(*ts: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Each tensor in fp32 (fp64 stays fp64); the kernels take any strides."""
    return tuple(t.to(torch.promote_types(t.dtype, torch.float32)) for t in ts)
