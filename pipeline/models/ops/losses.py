"""Cross-entropy over a large vocabulary without holding the full fp32 logits.

The head matmul and the softmax are done chunk by chunk over the tokens; gradients for the
hidden states and the head weight are computed in the same pass (as Liger-Kernel does), so
backward costs nothing extra and peak memory is one chunk of logits, not (tokens x vocab) fp32.

Per chunk of rows there are three matmuls in the autocast dtype. The softmax runs over blocks of
rows (on a CPU, `BLOCK` rows small enough to stay in cache; on a GPU, the whole chunk; see
`chunk_sizes`): each block of the matmul's output is converted to
fp32, softmaxed in place by torch's fused kernel, and written back in the matmul dtype, where it
becomes the logits' gradient once 1 is subtracted at the targets; the loss is `-log p[target]` in
fp32 (a probability below fp32's smallest normal, a loss above 87 nats, counts as 87.3). The 1/N
of the mean is applied to the two small gradient tensors, never to the (chunk x vocab) one.
Buffers are allocated once per call. Measured against the plain path and a transformers model
by benchmarks/train_throughput.py.

Distillation (`linear_distill_loss`) rides on the same pass: `(1-w)*CE + w*T^2*KL(teacher || student)`
where both distributions are seen through the teacher's top-k tokens plus one bucket holding the
rest of the mass (k+1 categories), then tempered: `softmax(log p_coarse / T)`. The teacher's side
comes from its top-k log-probs and its exact tail log-mass (`top_k_targets`); the student's from
its full-softmax probabilities gathered at those ids, and the sum of all its other probabilities
(summed directly, never as 1 - sum, so nothing cancels). Why this and not the teacher renormalised
over its top-k against the student's gathered log-probs: that term is not 0 when the student is the
teacher (it asks for all mass on the top-k, over-confidence), and renormalising the student as well
would leave the mass outside the top-k untaught. The coarse KL is 0 exactly when the student
matches the teacher's top-k probabilities (hence its tail too), is a lower bound of the full KL,
and at T=1 its logit gradient is the full KL's on the top-k (`s_i - p_i`); the tail bucket's
gradient is spread over the other tokens in proportion to the student's own probabilities.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pipeline.models.devices import matmul_dtype, to_device
from pipeline.models.ops import fused_ce

IGNORE_INDEX = -100  # a target that takes no loss (prompt tokens, padding), as F.cross_entropy's default
DEFAULT_CHUNK = 1024  # rows per matmul
# ... and at most this many logits (256 rows at a 49k vocabulary, 48 MB fp32, 24 MB bf16): in fp32 a 16 MB chunk
# (85 rows) ran the head's matmuls at ~100 GFLOPS against ~150 at 256 rows, and the default's step 1.16x slower
# (benchmarks/results/loss_chunk_avx2_2026-11-29.md); LoRA's peak memory is why it is not larger
CHUNK_LOGITS = 256 * 49152
NLL_CHUNK_BYTES = 64 * 2**20  # validation's fp32 logits (and as much for their log-softmax): 341 rows at 49k
BLOCK = 64  # rows per softmax block: 64 x 49152 fp32 = 12 MB, in the L3 cache
_TINY = torch.finfo(torch.float32).tiny


@dataclass(frozen=True)
class ChunkSizes:
    """How the chunked losses cut their work on one kind of device: a CPU wants small blocks that
    stay in its cache; a GPU wants few, large kernels (every chunk and block is a Python loop
    iteration of ~10 kernel launches, and 64-row blocks left an H100 waiting on the host)."""

    logits: int  # a chunk's logits at most (elements)
    max_rows: int  # rows per chunk at most
    block: int  # rows per fp32 softmax block; 0: the whole chunk at once
    nll_bytes: int  # validation's fp32 logits per chunk (`linear_nll`)
    distill_rows: int  # the distillation loss's rows per chunk; 0: as many as `logits` allows


CPU_SIZES = ChunkSizes(CHUNK_LOGITS, DEFAULT_CHUNK, BLOCK, NLL_CHUNK_BYTES, DEFAULT_CHUNK)
ACCELERATOR_SIZES = ChunkSizes(128 * 2**20, 8192, 0, 512 * 2**20, 0)  # 2730 rows at 49k: 256 MB bf16 + 512 MB fp32


def chunk_sizes(device: torch.device) -> ChunkSizes:
    """The sizes for `device` (CUDA and MPS share the accelerator's)."""
    return CPU_SIZES if device.type == "cpu" else ACCELERATOR_SIZES


_TAIL_FLOOR = 1e-30  # the student's tail mass divides its tail gradient; below this it is 0 in all but name


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h: torch.Tensor, w: torch.Tensor, targets: torch.Tensor, chunk: int, dtype, rows: int, bias):
        n, vocab = h.shape[0], w.shape[0]
        dev = h.device
        with torch.autocast(device_type=dev.type, enabled=False):
            hc_all = h.detach().to(dtype)
            wc = w.detach().to(dtype)
            bias = None if bias is None else bias.to(dev, dtype)
            logits = torch.empty(min(chunk, n), vocab, dtype=dtype, device=dev)
            rows = min(rows or chunk, chunk, n)  # softmax block
            kernel = fused_ce.wanted(logits)  # CUDA: one Triton kernel per chunk, no fp32 block
            fp32_copy = not kernel and dtype != torch.float32
            block = torch.empty(rows, vocab, dtype=torch.float32, device=dev) if fp32_copy else None
            grad_h = torch.empty_like(hc_all)
            grad_w = None
            total = torch.zeros((), dtype=torch.float32, device=dev)
            for start in range(0, n, chunk):
                c = min(chunk, n - start)
                hc, tc = hc_all[start : start + c], targets[start : start + c]
                z = torch.mm(hc, wc.t(), out=logits[:c])
                if bias is not None:
                    z.add_(bias)
                if kernel:
                    total += fused_ce.softmax_grad_(z, tc)
                else:
                    for b in range(0, c, rows):
                        total += _softmax_nll_(z[b : b + rows], tc[b : b + rows], block)
                    _add_at_targets_(z, tc, -1.0)
                torch.mm(z, wc, out=grad_h[start : start + c])
                if ctx.needs_input_grad[1]:  # a frozen head (LoRA's tied embedding) needs no weight gradient
                    part = torch.mm(z.t(), hc)
                    grad_w = part.float() if grad_w is None else grad_w.add_(part)
        _save_mean_grads(ctx, grad_h, grad_w, n, h.dtype, w.dtype)
        return total / n

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        # the saved gradients are used once (no retain_graph): scale them in place
        grad_h, grad_w = ctx.saved_tensors
        return grad_h.mul_(grad_out).to(ctx.h_dtype), _weight_grad(ctx, grad_w, grad_out), None, None, None, None, None


def _weight_grad(ctx, grad_w: torch.Tensor, grad_out: torch.Tensor) -> torch.Tensor | None:
    return grad_w.mul_(grad_out).to(ctx.w_dtype) if ctx.needs_input_grad[1] else None


def _save_mean_grads(ctx, grad_h: torch.Tensor, grad_w: torch.Tensor | None, n: int, h_dtype, w_dtype) -> None:
    """Both chunked losses compute their gradients in forward: scale them to the mean, keep them for backward.

    `grad_w` is None for a head that does not require grad (nothing computed, nothing returned)."""
    grad_h = grad_h.float().mul_(1.0 / n) if grad_h.dtype != torch.float32 else grad_h.mul_(1.0 / n)
    if grad_w is None:
        grad_w = torch.zeros(0)
    else:
        grad_w.mul_(1.0 / n)
    ctx.save_for_backward(grad_h, grad_w)
    ctx.h_dtype, ctx.w_dtype = h_dtype, w_dtype


def _add_at_targets_(z: torch.Tensor, targets: torch.Tensor, value: float) -> None:
    """`z[i, targets[i]] += value` for every row: one entry per row, so a gather and a plain scatter
    (index_put_'s accumulate mode sorts its indices on CUDA, for duplicates that cannot occur here)."""
    at = torch.arange(z.shape[0], device=z.device)
    z.index_put_((at, targets), z[at, targets] + value)


def _softmax_nll_(z: torch.Tensor, targets: torch.Tensor, buf: torch.Tensor | None) -> torch.Tensor:
    """Overwrite logits rows `z` with their softmax (fp32 math); return the rows' summed -log p[target]."""
    x = z if buf is None else buf[: z.shape[0]].copy_(z)
    torch.softmax(x, dim=-1, out=x)
    picked = x[torch.arange(x.shape[0], device=x.device), targets]
    nll = picked.clamp_min(_TINY).log().sum().neg()
    if buf is not None:
        z.copy_(x)
    return nll


def linear_cross_entropy(
    h: torch.Tensor, w: torch.Tensor, targets: torch.Tensor, chunk: int | None = None, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """mean CE of `h @ w.T (+ bias)` against `targets`; h (N, d), w (V, d), targets (N,), bias (V,) a
    fixed logit offset per column (sampled softmax's, `head_rows`).

    Matmuls run in bf16 when autocast is on (as the plain path would), softmax in fp32. `chunk` rows
    at a time: by default as many as the device's `chunk_sizes` allow.
    """
    dtype = matmul_dtype(h.device.type, torch.float32)
    sizes = chunk_sizes(h.device)
    chunk = chunk or _rows_within(sizes.logits, w.shape[0], sizes.max_rows)
    return _ChunkedLinearCrossEntropy.apply(h, w, targets, chunk, dtype, sizes.block, bias)


def _rows_within(budget: int, row: int, most: int = DEFAULT_CHUNK) -> int:
    """Rows a chunk holds: as many as `budget` takes at `row` per row (elements or bytes alike), between
    BLOCK and `most`."""
    return max(BLOCK, min(most, budget // row))


@torch.no_grad()
def linear_nll(h: torch.Tensor, w: torch.Tensor, targets: torch.Tensor, chunk: int | None = None) -> torch.Tensor:
    """mean CE of `h @ w.T` without gradients, `chunk` rows of fp32 logits at a time, by default as many
    as the device's `chunk_sizes` allow (`NLL_CHUNK_BYTES` on a CPU: validation's whole (tokens x vocab)
    logits and their log-softmax were 800 MB at 4 x 512 tokens). One chunk is exactly `F.cross_entropy`
    of the plain path."""
    n = h.shape[0]
    sizes = chunk_sizes(h.device)
    chunk = chunk or _rows_within(sizes.nll_bytes, w.shape[0] * 4, sizes.max_rows)
    if n <= chunk:
        return torch.nn.functional.cross_entropy(torch.nn.functional.linear(h, w).float(), targets)
    total = torch.zeros((), dtype=torch.float64, device=h.device)
    for i in range(0, n, chunk):
        logits = torch.nn.functional.linear(h[i : i + chunk], w).float()
        total += torch.nn.functional.cross_entropy(logits, targets[i : i + chunk], reduction="sum").double()
    return (total / n).float()


def select_targets(h: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of `h` (N, d) and `targets` (N,) whose target is not IGNORE_INDEX (all rows when none is),
    both on `h`'s device.

    `targets` may stay on the host while `h` is on a GPU (the training loop keeps them there): which
    rows count is then worked out on the host, and nothing waits for the device's queued kernels.
    Inside a CUDA graph capture (`pipeline.training.graphed`: token windows, where every target counts)
    nothing can be read on the host: the rows are taken as they are."""
    if targets.is_cuda and torch.cuda.is_current_stream_capturing():
        return h, targets
    keep = targets != IGNORE_INDEX
    if bool(keep.all()):
        return h, to_device(targets, h.device)
    if not bool(keep.any()):
        raise ValueError("every target is IGNORE_INDEX: a batch without any position to learn")
    if targets.device == h.device:
        return h[keep], targets[keep]
    where = torch.nonzero(keep).squeeze(1)
    return h.index_select(0, to_device(where, h.device)), to_device(targets[where], h.device)


def top_k_targets(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A teacher's targets from its logits rows (N, V): top-k ids (N, k) int64, their fp32 full-softmax
    log-probs (N, k), descending, and the log of the mass of every other token (N,): 1 - the top-k's
    mass, so exact to ~1e-6 of probability (-inf when the top-k hold all of it, as when k = V). One
    fp32 pass over the logits (their logsumexp) instead of a full log-softmax: the teach stage's
    cost after the donor's forward."""
    values, ids = logits.topk(k, dim=-1)
    logp = values.float() - torch.logsumexp(logits.float(), dim=-1, keepdim=True)
    tail = torch.log1p(-logp.double().exp().sum(-1).clamp(max=1.0)).float()
    return ids, logp, tail


def narrow_targets(
    ids: torch.Tensor, logp: torch.Tensor, tail: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The same targets with only the first `k` of their (descending) ids: the rest joins the tail."""
    if k >= ids.shape[-1]:
        return ids, logp, tail
    rest = torch.logsumexp(torch.cat((logp[..., k:], tail.unsqueeze(-1)), dim=-1), dim=-1)
    return ids[..., :k], logp[..., :k], rest


def _coarse(logp: torch.Tensor, tail: torch.Tensor, temperature: float) -> torch.Tensor:
    """log of softmax(log p_coarse / T) over the k+1 categories (top-k, then the tail), fp32."""
    coarse = torch.cat((logp.float(), tail.float().clamp_min(_LOG_TINY).unsqueeze(-1)), dim=-1)
    return torch.log_softmax(coarse / temperature, dim=-1)


_LOG_TINY = float(torch.log(torch.tensor(_TINY)))


class _ChunkedLinearDistill(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, w, targets, t_ids, log_q, weight: float, temperature: float, chunk: int, dtype, rows, bias):
        n, vocab = h.shape[0], w.shape[0]
        dev = h.device
        with torch.autocast(device_type=dev.type, enabled=False):
            hc_all, wc = h.detach().to(dtype), w.detach().to(dtype)
            bias = None if bias is None else bias.to(dev, dtype)
            logits = torch.empty(min(chunk, n), vocab, dtype=dtype, device=dev)
            rows = min(rows or chunk, chunk, n)  # softmax block
            block = None if dtype == torch.float32 else torch.empty(rows, vocab, dtype=torch.float32, device=dev)
            grad_h = torch.empty_like(hc_all)
            grad_w = None
            sums = torch.zeros(2, dtype=torch.float32, device=dev)  # summed CE, summed KL
            for start in range(0, n, chunk):
                c = min(chunk, n - start)
                hc = hc_all[start : start + c]
                z = torch.mm(hc, wc.t(), out=logits[:c])
                if bias is not None:
                    z.add_(bias)
                for b in range(0, c, rows):
                    at = slice(start + b, start + min(b + rows, c))
                    sums += _distill_block_(
                        z[b : b + rows], targets[at], t_ids[at], log_q[at], block, weight, temperature
                    )
                torch.mm(z, wc, out=grad_h[start : start + c])
                if ctx.needs_input_grad[1]:
                    part = torch.mm(z.t(), hc)
                    grad_w = part.float() if grad_w is None else grad_w.add_(part)
        _save_mean_grads(ctx, grad_h, grad_w, n, h.dtype, w.dtype)
        parts = sums / n
        ctx.mark_non_differentiable(parts)
        return (1.0 - weight) * parts[0] + weight * parts[1], parts

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor, _grad_parts: torch.Tensor):
        grad_h, grad_w = ctx.saved_tensors
        none = (None,) * 9
        return grad_h.mul_(grad_out).to(ctx.h_dtype), _weight_grad(ctx, grad_w, grad_out), *none


def _distill_block_(
    z: torch.Tensor,
    targets: torch.Tensor,
    ids: torch.Tensor,
    log_q: torch.Tensor,
    buf: torch.Tensor | None,
    weight: float,
    temperature: float,
) -> torch.Tensor:
    """Overwrite logits rows `z` with d loss / d logits (unscaled by 1/N); return (summed CE, summed T^2*KL).

    The softmax `s` is built in place; the top-k entries are taken out (gathered, zeroed) so the
    tail mass is a plain sum; the gradient is then `(1-w)*(s - onehot)` plus `w*T*(r - q)` on
    the top-k and `w*T*(r_tail - q_tail) * s_j / s_tail` on every other token.
    """
    x = z if buf is None else buf[: z.shape[0]].copy_(z)
    torch.softmax(x, dim=-1, out=x)
    r = torch.arange(x.shape[0], device=x.device)
    ce = x[r, targets].clamp_min(_TINY).log().sum().neg()
    s_k = x.gather(1, ids)
    s_tail = x.scatter_(1, ids, 0.0).sum(dim=-1)
    log_r = _coarse(s_k.clamp_min(_TINY).log(), s_tail.clamp_min(_TINY).log(), temperature)
    q = log_q.exp()
    kl = (q * (log_q - log_r)).sum() * temperature**2
    g = (log_r.exp() - q).mul_(temperature * weight)  # d(w*T^2*KL) / d(log p_coarse)
    x.mul_(((1.0 - weight) + g[:, -1] / s_tail.clamp_min(_TAIL_FLOOR)).unsqueeze(-1))
    x.scatter_(1, ids, s_k * (1.0 - weight) + g[:, :-1])
    _add_at_targets_(x, targets, weight - 1.0)
    if buf is not None:
        z.copy_(x)
    return torch.stack((ce, kl))


def linear_distill_loss(
    h: torch.Tensor,
    w: torch.Tensor,
    targets: torch.Tensor,
    teacher: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    weight: float,
    temperature: float,
    chunk: int | None = None,
    bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`(1-weight)*CE + weight*T^2*KL` of `h @ w.T (+ bias)` (see the module doc) and its detached parts (CE, KL).

    h (N, d), w (V, d), targets (N,); `teacher` = (ids (..., k), log-probs (..., k), tail log-mass (...))
    as `top_k_targets` makes them, N positions in all. Memory as `linear_cross_entropy`: one chunk of logits
    (`DEFAULT_CHUNK` rows on a CPU, by default; as the device's `chunk_sizes` allow elsewhere).
    """
    dtype = matmul_dtype(h.device.type, torch.float32)
    sizes = chunk_sizes(h.device)
    chunk = chunk or sizes.distill_rows or _rows_within(sizes.logits, w.shape[0], sizes.max_rows)
    k = teacher[0].shape[-1]
    ids, logp, tail = teacher[0].reshape(-1, k), teacher[1].reshape(-1, k), teacher[2].reshape(-1)
    with torch.autocast(device_type=h.device.type, enabled=False):
        log_q = _coarse(logp, tail, temperature)
    return _ChunkedLinearDistill.apply(
        h, w, targets, ids.long(), log_q, float(weight), float(temperature), chunk, dtype, sizes.block, bias
    )


def head_targets(
    h: torch.Tensor, w: torch.Tensor, k: int, chunk: int | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`top_k_targets` of the logits `h @ w.T` (h (N, d), w (V, d)), a chunk of rows at a time so
    that only (chunk x V) fp32 logits are ever held: 64 rows on a CPU, whose ~12 MB of fp32 logits
    stay in cache for the logsumexp's passes (1.5x the teach stage's head over 512 rows, measured in
    docs/distillation.md), 512 elsewhere."""
    chunk = chunk or (64 if h.device.type == "cpu" else 512)
    parts = [top_k_targets(torch.nn.functional.linear(h[i : i + chunk], w), k) for i in range(0, h.shape[0], chunk)]
    return tuple(torch.cat(p) for p in zip(*parts))
