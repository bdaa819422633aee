"""Cross-entropy over a large vocabulary without holding the full fp32 logits.

The head matmul and the softmax are done chunk by chunk over the tokens; gradients for the
hidden states and the head weight are computed in the same pass (as Liger-Kernel does), so
backward costs nothing extra and peak memory is one chunk of logits, not (tokens x vocab) fp32.

Per chunk of rows there are three matmuls in the autocast dtype. The softmax runs over blocks of
`BLOCK` rows small enough to stay in cache: each block of the matmul's output is converted to
fp32, softmaxed in place by torch's fused kernel, and written back in the matmul dtype, where it
becomes the logits' gradient once 1 is subtracted at the targets; the loss is `-log p[target]` in
fp32 (a probability below fp32's smallest normal, a loss above 87 nats, counts as 87.3). The 1/N
of the mean is applied to the two small gradient tensors, never to the (chunk x vocab) one.
Buffers are allocated once per call. Measured against the plain path and a transformers model
by benchmarks/train_throughput.py.
"""

from __future__ import annotations

import torch

IGNORE_INDEX = -100  # a target that takes no loss (prompt tokens, padding), as F.cross_entropy's default
DEFAULT_CHUNK = 1024  # rows per matmul
BLOCK = 64  # rows per softmax block: 64 x 49152 fp32 = 12 MB, in the L3 cache
_TINY = torch.finfo(torch.float32).tiny


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h: torch.Tensor, w: torch.Tensor, targets: torch.Tensor, chunk: int, dtype: torch.dtype):
        n, vocab = h.shape[0], w.shape[0]
        dev = h.device
        with torch.autocast(device_type=dev.type, enabled=False):
            hc_all = h.detach().to(dtype)
            wc = w.detach().to(dtype)
            logits = torch.empty(min(chunk, n), vocab, dtype=dtype, device=dev)
            block = None if dtype == torch.float32 else torch.empty(BLOCK, vocab, dtype=torch.float32, device=dev)
            grad_h = torch.empty_like(hc_all)
            grad_w = None
            total = torch.zeros((), dtype=torch.float32, device=dev)
            for start in range(0, n, chunk):
                c = min(chunk, n - start)
                hc, tc = hc_all[start : start + c], targets[start : start + c]
                z = torch.mm(hc, wc.t(), out=logits[:c])
                for b in range(0, c, BLOCK):
                    total += _softmax_nll_(z[b : b + BLOCK], tc[b : b + BLOCK], block)
                rows = torch.arange(c, device=dev)
                z.index_put_((rows, tc), torch.full((c,), -1.0, dtype=dtype, device=dev), accumulate=True)
                torch.mm(z, wc, out=grad_h[start : start + c])
                part = torch.mm(z.t(), hc)
                grad_w = part.float() if grad_w is None else grad_w.add_(part)
        grad_h = grad_h.float().mul_(1.0 / n) if grad_h.dtype != torch.float32 else grad_h.mul_(1.0 / n)
        grad_w.mul_(1.0 / n)
        ctx.save_for_backward(grad_h, grad_w)
        ctx.h_dtype, ctx.w_dtype = h.dtype, w.dtype
        return total / n

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        # the saved gradients are used once (no retain_graph): scale them in place
        grad_h, grad_w = ctx.saved_tensors
        return grad_h.mul_(grad_out).to(ctx.h_dtype), grad_w.mul_(grad_out).to(ctx.w_dtype), None, None, None


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
    h: torch.Tensor, w: torch.Tensor, targets: torch.Tensor, chunk: int = DEFAULT_CHUNK
) -> torch.Tensor:
    """mean CE of `h @ w.T` against `targets`; h (N, d), w (V, d), targets (N,).

    Matmuls run in bf16 when autocast is on (as the plain path would), softmax in fp32.
    """
    dtype = torch.get_autocast_dtype(h.device.type) if torch.is_autocast_enabled(h.device.type) else torch.float32
    return _ChunkedLinearCrossEntropy.apply(h, w, targets, chunk, dtype)


def select_targets(h: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of `h` (N, d) and `targets` (N,) whose target is not IGNORE_INDEX (all rows when none is)."""
    keep = targets != IGNORE_INDEX
    if bool(keep.all()):
        return h, targets
    if not bool(keep.any()):
        raise ValueError("every target is IGNORE_INDEX: a batch without any position to learn")
    return h[keep], targets[keep]
