"""The output layer and the label-smoothed cross-entropy in one piece, a chunk of rows at a time: no (tokens x
vocabulary) logits in float32, nor their log-probabilities and gradient beside them. Eager only; under
torch.compile the plain formulation, which inductor fuses itself."""

import torch
import torch.nn.functional as F
from torch import Tensor

from .casting import cast_once

# Rows per chunk: as many as keep a chunk's float32 logits within this many elements (256 MiB)
CHUNK_ELEMENTS = 1 << 26


def linear_cross_entropy(x: Tensor, weight: Tensor, labels: Tensor, label_smoothing: float, ignore_index: int,
                         bias: Tensor | None = None) -> Tensor:  # fmt: skip
    """F.cross_entropy(F.linear(x, weight, bias), labels, label_smoothing=..., ignore_index=..., reduction="sum") for
    x (N, d), weight (V, d), bias (V,) or None, labels (N,): the same value and gradients, to rounding, in the dtype
    matmuls run in.
    The plain formulation where the fused one would not pay or would lose: compiled, and in float16, whose gradient
    in the logits (probabilities down to 1e-6 and below, before the loss scale reaches them) it would flush to zero."""
    x, weight, bias = cast_once(x), cast_once(weight), None if bias is None else cast_once(bias)
    if torch.compiler.is_compiling() or x.dtype == torch.float16:
        logits = F.linear(x, weight, bias).float()  # (N, V)
        return F.cross_entropy(logits, labels, ignore_index=ignore_index, label_smoothing=label_smoothing,
                               reduction="sum")  # fmt: skip
    if not torch.is_grad_enabled():  # validation: no gradient computed in forward (needs_input_grad would ask)
        x, weight, bias = x.detach(), weight.detach(), None if bias is None else bias.detach()
    return _LinearCrossEntropy.apply(x, weight, bias, labels, label_smoothing, ignore_index)


class _LinearCrossEntropy(torch.autograd.Function):
    """Forward computes the loss and, where gradients are wanted, both gradients at once, chunk by chunk (a chunk's
    logits are dropped before the next is made); backward scales them by the incoming gradient.

    Per row, with z the logits, lse their log-sum-exp and e = label_smoothing: loss = lse - (1 - e) z[label] -
    e / V * sum(z), PyTorch's label-smoothed cross-entropy; its gradient in z is softmax(z) - (1 - e) onehot - e / V.
    Rows labelled ignore_index count for nothing."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Tensor | None, labels: Tensor, smoothing: float,
                ignore_index: int) -> Tensor:  # fmt: skip
        N, V = x.size(0), weight.size(0)
        wants_x, wants_weight, wants_bias = ctx.needs_input_grad[:3]
        rows = max(1, CHUNK_ELEMENTS // V)
        wide = torch.float64 if x.dtype == torch.float64 else torch.float32  # where logits and sums are kept
        grad_x = torch.empty_like(x) if wants_x and N > rows else None  # one chunk's is x's gradient
        grad_weight = weight.new_zeros(weight.shape, dtype=wide) if wants_weight and N > rows else None  # summed
        grad_bias = weight.new_zeros(V, dtype=wide) if wants_bias else None  # summed over rows
        totals = []
        for start in range(0, N, rows):
            xc, yc = x[start : start + rows], labels[start : start + rows]  # (n, d), (n,)
            at, ignored = yc[:, None], yc.eq(ignore_index)[:, None]  # (n, 1) each; ignore_index is a column too
            z = (torch.mm(xc, weight.t()) if bias is None else torch.addmm(bias, xc, weight.t())).to(wide)  # (n, V)
            z_label, z_sum = z.gather(1, at), z.sum(1, keepdim=True)  # (n, 1) each
            top = z.amax(1, keepdim=True)  # (n, 1)
            p = z.sub_(top).exp_()  # (n, V): unnormalised probabilities, in z's memory
            norm = p.sum(1, keepdim=True)  # (n, 1)
            loss = norm.log().add_(top).sub_(z_label, alpha=1 - smoothing).sub_(z_sum, alpha=smoothing / V)
            totals.append(loss.masked_fill_(ignored, 0.0).sum())
            if not (wants_x or wants_weight or wants_bias):
                continue
            p.div_(norm).sub_(smoothing / V)  # (n, V): the gradient in z, but for the label's -(1 - smoothing)
            g = p.scatter_(1, at, smoothing - 1, reduce="add").masked_fill_(ignored, 0.0).to(x.dtype)  # (n, V)
            if wants_x:
                if N <= rows:
                    grad_x = g @ weight  # (N, d)
                else:
                    grad_x[start : start + rows] = g @ weight  # (n, d)
            if wants_weight:
                part = g.t() @ xc  # (V, d)
                grad_weight = part if grad_weight is None else grad_weight.add_(part)
            if wants_bias:
                grad_bias.add_(g.sum(0, dtype=wide))  # (V,)
        total = totals[0] if len(totals) == 1 else torch.stack(totals).sum()
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)
        if grad_bias is not None:
            grad_bias = grad_bias.to(bias.dtype)
        ctx.save_for_backward(grad_x, grad_weight, grad_bias)
        return total

    @staticmethod
    def backward(ctx, grad_total: Tensor):
        return *(None if grad is None else grad * grad_total for grad in ctx.saved_tensors), None, None, None
