"""Cross-entropy over a large vocabulary without holding the full fp32 logits.

The head matmul and the softmax are done chunk by chunk over the tokens; gradients for the
hidden states and the head weight are computed in the same pass (as Liger-Kernel does), so
backward costs nothing extra and peak memory is one chunk of logits, not (tokens x vocab) fp32.
"""

from __future__ import annotations

import torch


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h: torch.Tensor, w: torch.Tensor, targets: torch.Tensor, chunk: int, dtype: torch.dtype):
        n = h.shape[0]
        hc_all = h.to(dtype)
        wc = w.to(dtype)
        grad_h = torch.empty_like(hc_all)
        grad_w = torch.zeros(w.shape, dtype=torch.float32, device=w.device)
        total = torch.zeros((), dtype=torch.float32, device=h.device)
        with torch.autocast(device_type=h.device.type, enabled=False):
            for start in range(0, n, chunk):
                hc = hc_all[start : start + chunk]
                tc = targets[start : start + chunk]
                logits = (hc @ wc.T).float()
                rows = torch.arange(tc.shape[0], device=h.device)
                target_logit = logits[rows, tc]
                # one pass of exp: softmax = exp(x - max) / sum, and lse = max + log(sum)
                peak = logits.amax(dim=-1, keepdim=True)
                exps = logits.sub_(peak).exp_()
                norm = exps.sum(dim=-1, keepdim=True)
                total += (peak.squeeze(1) + norm.log().squeeze(1) - target_logit).sum()
                exps.mul_(1.0 / (norm * n))  # softmax / n
                exps[rows, tc] -= 1.0 / n
                g = exps.to(dtype)
                grad_h[start : start + chunk] = g @ wc
                grad_w += (g.T @ hc).float()
        ctx.save_for_backward(grad_h, grad_w)
        ctx.h_dtype, ctx.w_dtype = h.dtype, w.dtype
        return total / n

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        grad_h, grad_w = ctx.saved_tensors
        return (grad_h * grad_out).to(ctx.h_dtype), (grad_w * grad_out).to(ctx.w_dtype), None, None, None


def linear_cross_entropy(h: torch.Tensor, w: torch.Tensor, targets: torch.Tensor, chunk: int = 1024) -> torch.Tensor:
    """mean CE of `h @ w.T` against `targets`; h (N, d), w (V, d), targets (N,).

    Matmuls run in bf16 when autocast is on (as the plain path would), softmax in fp32.
    """
    dtype = torch.get_autocast_dtype(h.device.type) if torch.is_autocast_enabled(h.device.type) else torch.float32
    return _ChunkedLinearCrossEntropy.apply(h, w, targets, chunk, dtype)
