"""The output layer and the label-smoothed cross-entropy in one piece, a chunk of rows at a time: no (tokens x
vocabulary) logits in float32, nor their log-probabilities and gradient beside them. Under torch.compile, one chunk
in the model's graph: its loss and gradient in the logits are one inductor kernel with the graph's others, and its
gradients are computed in forward there too, so that backward saves no logits and passes over them no more
(docs/benchmarks.md, "Compiled training step").

Between the logits' matmul and the gradient's two, the loss and the gradient in the logits are elementwise work
over tokens x vocabulary: on a CPU a fifth of the small model's step in eager ops, which pass over the logits a dozen
times. There one kernel compiled by inductor (logit_loss_and_grad, the plain formula) reads the bf16 logits once per
row and writes the bf16 gradient once; elsewhere, or where inductor cannot build it, the in-place eager sequence."""

import warnings

import torch
import torch.nn.functional as F
from torch import Tensor
from torch._dynamo.exc import BackendCompilerFailed
from torch.overrides import _get_current_function_mode_stack
from torch.utils._python_dispatch import _get_current_dispatch_mode

from .casting import cast_once

# Rows per chunk: as many as keep a chunk's float32 logits within this many elements (256 MiB)
CHUNK_ELEMENTS = 1 << 26


def linear_cross_entropy(x: Tensor, weight: Tensor, labels: Tensor, label_smoothing: float, ignore_index: int,
                         bias: Tensor | None = None) -> Tensor:  # fmt: skip
    """F.cross_entropy(F.linear(x, weight, bias), labels, label_smoothing=..., ignore_index=..., reduction="sum") for
    x (N, d), weight (V, d), bias (V,) or None, labels (N,): the same value and gradients, to rounding, in the dtype
    matmuls run in.
    The plain formulation in float16, whose gradient in the logits (probabilities down to 1e-6 and below, before the
    loss scale reaches them) the fused one would flush to zero."""
    x, weight, bias = cast_once(x), cast_once(weight), None if bias is None else cast_once(bias)
    if x.dtype == torch.float16:
        logits = F.linear(x, weight, bias).float()  # (N, V)
        return F.cross_entropy(logits, labels, ignore_index=ignore_index, label_smoothing=label_smoothing,
                               reduction="sum")  # fmt: skip
    if not torch.is_grad_enabled():  # validation: no gradient computed in forward (needs_input_grad would ask)
        x, weight, bias = x.detach(), weight.detach(), None if bias is None else bias.detach()
    return _LinearCrossEntropy.apply(x, weight, bias, labels, label_smoothing, ignore_index)


def _wide(dtype: torch.dtype) -> torch.dtype:
    """Where logits and sums are kept: float64's in float64, everything else's in float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def logit_loss_and_grad(z: Tensor, labels: Tensor, smoothing: float | Tensor, ignore_index: int | Tensor,
                        wants_grad: bool) -> tuple[Tensor, Tensor | None]:  # fmt: skip
    """(the label-smoothed cross-entropy of logits z (n, V) summed over rows, its gradient in z in z's dtype or None),
    rows labelled ignore_index counting for nothing: the plain formula, which inductor compiles into one pass over
    each row (_compiled_kernel). Per row, with lse the log-sum-exp of z and e the smoothing: loss = lse - (1 - e)
    z[label] - e / V * sum(z), PyTorch's; its gradient softmax(z) - (1 - e) onehot - e / V."""
    wide = _wide(z.dtype)  # where logits and sums are kept
    zw, V = z.to(wide), z.size(1)
    ignored = labels.eq(ignore_index)[:, None]  # (n, 1)
    is_label = torch.arange(V, device=z.device) == labels[:, None]  # (n, V): no gather, so any ignore_index works
    top = zw.amax(1, keepdim=True)  # (n, 1)
    p = (zw - top).exp()  # (n, V): unnormalised probabilities
    norm = p.sum(1, keepdim=True)  # (n, 1)
    z_label = torch.where(is_label, zw, 0).sum(1, keepdim=True)  # (n, 1)
    loss = norm.log() + top - (1 - smoothing) * z_label - smoothing / V * zw.sum(1, keepdim=True)  # (n, 1)
    total = torch.where(ignored, 0, loss).sum()
    if not wants_grad:
        return total, None
    g = p / norm - smoothing / V - (1 - smoothing) * is_label.to(wide)  # (n, V); a bool's product would be float32
    return total, torch.where(ignored, 0, g).to(z.dtype)


def in_place_logit_loss_and_grad(z: Tensor, labels: Tensor, smoothing: float, ignore_index: int,
                                 wants_grad: bool) -> tuple[Tensor, Tensor | None]:  # fmt: skip
    """logit_loss_and_grad in eager ops, in place in z (float32's and float64's) or in one float32 copy of it: where
    no compiled kernel runs."""
    wide = _wide(z.dtype)
    V = z.size(1)
    ignored = labels.eq(ignore_index)[:, None]  # (n, 1)
    # (n, 1): an ignore_index outside the vocabulary (-100) gathers a row's first logit, masked below
    at = (labels if 0 <= ignore_index < V else labels.clamp(0, V - 1))[:, None]
    z = z.to(wide)
    z_label, z_sum = z.gather(1, at), z.sum(1, keepdim=True)  # (n, 1) each
    top = z.amax(1, keepdim=True)  # (n, 1)
    p = z.sub_(top).exp_()  # (n, V): unnormalised probabilities, in z's memory
    norm = p.sum(1, keepdim=True)  # (n, 1)
    loss = norm.log().add_(top).sub_(z_label, alpha=1 - smoothing).sub_(z_sum, alpha=smoothing / V)
    total = loss.masked_fill_(ignored, 0.0).sum()
    if not wants_grad:
        return total, None
    p.div_(norm).sub_(smoothing / V)  # (n, V): the gradient in z, but for the label's -(1 - smoothing)
    if wide == torch.float32:  # one launch fewer than a tensor of the value
        return total, p.scatter_(1, at, smoothing - 1, reduce="add").masked_fill_(ignored, 0.0)
    minus_one = torch.full(at.shape, smoothing - 1, dtype=wide, device=z.device)  # a scalar would be rounded to float
    return total, p.scatter_add_(1, at, minus_one).masked_fill_(ignored, 0.0)


_compiled = None  # logit_loss_and_grad compiled by inductor; False where it cannot be built here
# Its variants: float32, bf16 and float64 logits, with and without the gradient, one-row chunks (dynamo specialises
# sizes 0 and 1); smoothing and ignore_index come as tensors, so that their values need none
VARIANTS = 16


def _compiled_kernel():
    global _compiled
    if _compiled is None:
        _compiled = torch.compile(logit_loss_and_grad, dynamic=True, fullgraph=True)
    return _compiled


def logit_kernel(z: Tensor, labels: Tensor, smoothing: float, ignore_index: int,
                 wants_grad: bool) -> tuple[Tensor, Tensor | None]:  # fmt: skip
    """The compiled kernel on a CPU. The in-place one elsewhere (a GPU's eager path is not yet measured with it);
    under a dispatch or function mode (an op, FLOP or sync counter: dynamo would compile nothing, or anew for each
    mode); and where inductor cannot build it (no C++ compiler: said once)."""
    global _compiled
    args = labels, smoothing, ignore_index, wants_grad
    if torch.compiler.is_compiling():  # in a compiled model's graph, whose kernel inductor builds with the rest
        return logit_loss_and_grad(z, *args)
    if (z.device.type != "cpu" or _compiled is False or _get_current_dispatch_mode() is not None
            or _get_current_function_mode_stack()):  # fmt: skip
        return in_place_logit_loss_and_grad(z, *args)
    wide = _wide(z.dtype)
    values = torch.tensor(smoothing, dtype=wide), torch.tensor(ignore_index)
    try:
        with torch._dynamo.config.patch(recompile_limit=VARIANTS):
            return _compiled_kernel()(z, labels, *values, wants_grad)
    except BackendCompilerFailed as error:
        reason = f"{error.inner_exception!r:.200}"
        warnings.warn(f"the loss runs in eager ops: inductor could not build its kernel ({reason})", stacklevel=2)
        _compiled = False
        return in_place_logit_loss_and_grad(z, *args)


class _LinearCrossEntropy(torch.autograd.Function):
    """Forward computes the loss and, where gradients are wanted, both gradients at once, chunk by chunk (a chunk's
    logits are dropped before the next is made); backward scales them by the incoming gradient."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Tensor | None, labels: Tensor, smoothing: float,
                ignore_index: int) -> Tensor:  # fmt: skip
        N, V = x.size(0), weight.size(0)
        wants_x, wants_weight, wants_bias = ctx.needs_input_grad[:3]
        wants_grad = wants_x or wants_weight or wants_bias
        rows = max(1, CHUNK_ELEMENTS // V)
        # one chunk in a compiled model's graph, which knows no row count to loop over (nor guards on one)
        chunked = not torch.compiler.is_compiling() and N > rows
        wide = _wide(x.dtype)  # where sums over chunks are kept
        grad_x = torch.empty_like(x) if wants_x and chunked else None  # one chunk's is x's gradient
        grad_weight = weight.new_zeros(weight.shape, dtype=wide) if wants_weight and chunked else None  # summed
        grad_bias = weight.new_zeros(V, dtype=wide) if wants_bias else None  # summed over rows
        totals = []
        for start in range(0, N, rows) if chunked else [0]:
            xc, yc = (x[start : start + rows], labels[start : start + rows]) if chunked else (x, labels)  # (n, d), (n,)
            z = torch.mm(xc, weight.t()) if bias is None else torch.addmm(bias, xc, weight.t())  # (n, V)
            total, g = logit_kernel(z, yc, smoothing, ignore_index, wants_grad)
            totals.append(total)
            if not wants_grad:
                continue
            g = g.to(x.dtype)  # (n, V)
            if wants_x:
                if chunked:
                    grad_x[start : start + rows] = g @ weight  # (n, d)
                else:
                    grad_x = g @ weight  # (N, d)
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
