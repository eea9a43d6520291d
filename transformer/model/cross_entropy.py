"""The output layer and the label-smoothed cross-entropy in one piece, a chunk of rows at a time: no (tokens x
vocabulary) logits in float32, nor their log-probabilities and gradient beside them. Under torch.compile, one chunk
in the model's graph: its loss and gradient in the logits are one inductor kernel with the graph's others, and its
gradients are computed in forward there too, so that backward saves no logits and passes over them no more
(docs/benchmarks.md, "Compiled training step").

Between the logits' matmul and the gradient's two, the loss and the gradient in the logits are elementwise work
over tokens x vocabulary: on a CPU a fifth of the small model's step in eager ops, which pass over the logits a dozen
times. There one kernel compiled by inductor (logit_loss_and_grad, the plain formula) reads the bf16 logits once per
row and writes the bf16 gradient once; elsewhere, or where inductor cannot build it, the in-place eager sequence.
R-Drop's loss over two passes' logits is the same piece with another formula (rdrop_logit_loss_and_grad), a row of
each pass in one kernel: the plain ops (float32 logits, log-softmaxes, KL divergences, autograd through them) took
2.3-2.6x as long at the small model's shapes (docs/benchmarks.md, "The output layer and loss")."""

import warnings
from collections.abc import Callable

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
                         bias: Tensor | None = None, rdrop_alpha: float | None = None) -> Tensor:  # fmt: skip
    """F.cross_entropy(F.linear(x, weight, bias), labels, label_smoothing=..., ignore_index=..., reduction="sum") for
    x (N, d), weight (V, d), bias (V,) or None, labels (N,): the same value and gradients, to rounding, in the dtype
    matmuls run in. With rdrop_alpha, x holds two passes' rows (2N, d), pass one's first, and the loss is R-Drop's
    (rdrop_logit_loss_and_grad) with labels (N,) for both.
    The plain formulation in float16, whose gradient in the logits (probabilities down to 1e-6 and below, before the
    loss scale reaches them) the fused one would flush to zero."""
    passes = 1 if rdrop_alpha is None else 2
    if x.size(0) != passes * labels.size(0):
        need = "two rows a label (its two passes)" if rdrop_alpha is not None else "one row a label"
        raise ValueError(f"x has {x.size(0)} rows for {labels.size(0)} labels: the loss needs {need}")
    x, weight, bias = cast_once(x), cast_once(weight), None if bias is None else cast_once(bias)
    if x.dtype == torch.float16:
        logits = F.linear(x, weight, bias).float()  # (passes * N, V)
        if rdrop_alpha is not None:  # its loss differentiated by autograd
            return rdrop_logit_loss_and_grad(logits, labels, label_smoothing, rdrop_alpha, ignore_index, False)[0]
        return F.cross_entropy(logits, labels, ignore_index=ignore_index, label_smoothing=label_smoothing,
                               reduction="sum")  # fmt: skip
    if not torch.is_grad_enabled():  # validation: no gradient computed in forward (needs_input_grad would ask)
        x, weight, bias = x.detach(), weight.detach(), None if bias is None else bias.detach()
    return _LinearCrossEntropy.apply(x, weight, bias, labels, label_smoothing, ignore_index, rdrop_alpha)


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


def rdrop_logit_loss_and_grad(z: Tensor, labels: Tensor, smoothing: float | Tensor, alpha: float | Tensor,
                              ignore_index: int | Tensor, wants_grad: bool) -> tuple[Tensor, Tensor | None]:  # fmt: skip
    """R-Drop's loss (Liang et al. 2021) on two passes' logits z (2n, V), pass one's n rows first, labels (n,) both's,
    summed over the pairs of rows not labelled ignore_index, and its gradient in z or None: the plain formula, which
    inductor compiles into one kernel over each pair of rows. Per pair, the mean of the passes' label-smoothed
    cross-entropies plus alpha / 4 x the symmetric KL divergence between their distributions P and Q: the paper's
    NLL1 + NLL2 + alpha / 2 (KL(P||Q) + KL(Q||P)) halved, so that the loss stays on one pass's scale (as the paper's
    fairseq criterion over its doubled batch). With a = log P, b = log Q, KL(P||Q) + KL(Q||P) = sum (P - Q)(a - b),
    whose gradient in pass one's logits is P (a - b - KL(P||Q)) + P - Q; pass two's by symmetry."""
    wide = _wide(z.dtype)
    n, V = labels.size(0), z.size(1)
    one, two = z[:n].to(wide), z[n:].to(wide)  # (n, V) each
    ignored = labels.eq(ignore_index)[:, None]  # (n, 1)
    is_label = torch.arange(V, device=z.device) == labels[:, None]  # (n, V)

    def log_softmax_and_loss(zw: Tensor) -> tuple[Tensor, Tensor]:  # (n, V) log-probabilities, (n, 1) loss
        lse = torch.logsumexp(zw, 1, keepdim=True)  # (n, 1)
        z_label = torch.where(is_label, zw, 0).sum(1, keepdim=True)  # (n, 1)
        return zw - lse, lse - (1 - smoothing) * z_label - smoothing / V * zw.sum(1, keepdim=True)

    a, ce_one = log_softmax_and_loss(one)
    b, ce_two = log_softmax_and_loss(two)
    p, q, log_ratio = a.exp(), b.exp(), a - b  # (n, V) each
    kl_pq, kl_qp = (p * log_ratio).sum(1, keepdim=True), -(q * log_ratio).sum(1, keepdim=True)  # (n, 1) each
    loss = (ce_one + ce_two) / 2 + alpha / 4 * (kl_pq + kl_qp)  # (n, 1)
    total = torch.where(ignored, 0, loss).sum()
    if not wants_grad:
        return total, None
    label_part = smoothing / V + (1 - smoothing) * is_label.to(wide)  # (n, V)
    g_one = (p - label_part) / 2 + alpha / 4 * (p * (log_ratio - kl_pq) + p - q)  # (n, V)
    g_two = (q - label_part) / 2 + alpha / 4 * (q * (-log_ratio - kl_qp) + q - p)
    return total, torch.cat([torch.where(ignored, 0, g) for g in (g_one, g_two)]).to(z.dtype)  # (2n, V)


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


eager_only = False  # True where inductor cannot build the kernels here (or a benchmark measures eager ops)
_compiled = {}  # each plain formula compiled by inductor
# Its variants: float32, bf16 and float64 logits, with and without the gradient, one-row chunks (dynamo specialises
# sizes 0 and 1); smoothing, alpha and ignore_index come as tensors, so that their values need none
VARIANTS = 16


def _compiled_kernel(formula: Callable) -> Callable:
    if formula not in _compiled:
        _compiled[formula] = torch.compile(formula, dynamic=True, fullgraph=True)
    return _compiled[formula]


def logit_kernel(z: Tensor, labels: Tensor, smoothing: float, ignore_index: int, wants_grad: bool,
                 rdrop_alpha: float | None = None) -> tuple[Tensor, Tensor | None]:  # fmt: skip
    """(the loss, its gradient in z or None): logit_loss_and_grad's, or with rdrop_alpha rdrop_logit_loss_and_grad's.
    Compiled on a CPU. In eager ops elsewhere (a GPU's eager path is not yet measured with inductor's kernel); under a
    dispatch or function mode (an op, FLOP or sync counter: dynamo would compile nothing, or anew for each mode); and
    where inductor cannot build it (no C++ compiler: said once). The cross-entropy's eager ops work in place."""
    global eager_only
    formula = logit_loss_and_grad if rdrop_alpha is None else rdrop_logit_loss_and_grad
    weights = (smoothing,) if rdrop_alpha is None else (smoothing, rdrop_alpha)  # the formula's float arguments
    if torch.compiler.is_compiling():  # in a compiled model's graph, whose kernel inductor builds with the rest
        return formula(z, labels, *weights, ignore_index, wants_grad)
    eager = in_place_logit_loss_and_grad if rdrop_alpha is None else rdrop_logit_loss_and_grad
    if (z.device.type != "cpu" or eager_only or _get_current_dispatch_mode() is not None
            or _get_current_function_mode_stack()):  # fmt: skip
        return eager(z, labels, *weights, ignore_index, wants_grad)
    wide = _wide(z.dtype)
    values = (torch.tensor(v, dtype=wide) for v in weights)
    try:
        with torch._dynamo.config.patch(recompile_limit=VARIANTS):
            return _compiled_kernel(formula)(z, labels, *values, torch.tensor(ignore_index), wants_grad)
    except BackendCompilerFailed as error:
        reason = f"{error.inner_exception!r:.200}"
        warnings.warn(f"the loss runs in eager ops: inductor could not build its kernel ({reason})", stacklevel=2)
        eager_only = True
        return eager(z, labels, *weights, ignore_index, wants_grad)


class _LinearCrossEntropy(torch.autograd.Function):
    """Forward computes the loss and, where gradients are wanted, both gradients at once, chunk by chunk (a chunk's
    logits are dropped before the next is made); backward scales them by the incoming gradient."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Tensor | None, labels: Tensor, smoothing: float,
                ignore_index: int, rdrop_alpha: float | None) -> Tensor:  # fmt: skip
        n, V = labels.size(0), weight.size(0)  # rows per pass, vocabulary
        passes = 1 if rdrop_alpha is None else 2  # R-Drop's: row i of pass one pairs with row n + i of pass two
        wants_x, wants_weight, wants_bias = ctx.needs_input_grad[:3]
        wants_grad = wants_x or wants_weight or wants_bias
        rows = max(1, CHUNK_ELEMENTS // (passes * V))  # a chunk's rows per pass
        # one chunk in a compiled model's graph, which knows no row count to loop over (nor guards on one)
        chunked = not torch.compiler.is_compiling() and n > rows
        wide = _wide(x.dtype)  # where sums over chunks are kept
        grad_x = torch.empty_like(x) if wants_x and chunked else None  # one chunk's is x's gradient
        grad_weight = weight.new_zeros(weight.shape, dtype=wide) if wants_weight and chunked else None  # summed
        grad_bias = weight.new_zeros(V, dtype=wide) if wants_bias else None  # summed over rows
        totals = []
        for start in range(0, n, rows) if chunked else [None]:
            if start is None:  # the whole batch in one chunk: pass one's rows, then pass two's
                xc, yc = x, labels  # (passes * n, d), (n,)
            else:  # a chunk of c rows from each pass, kept in that order
                parts = [slice(k * n + start, k * n + min(start + rows, n)) for k in range(passes)]
                xc = torch.cat([x[r] for r in parts]) if passes > 1 else x[parts[0]]  # (passes * c, d)
                yc = labels[parts[0]]  # (c,)
            z = torch.mm(xc, weight.t()) if bias is None else torch.addmm(bias, xc, weight.t())  # (passes * c, V)
            total, g = logit_kernel(z, yc, smoothing, ignore_index, wants_grad, rdrop_alpha)
            totals.append(total)
            if not wants_grad:
                continue
            g = g.to(x.dtype)  # (passes * c, V)
            if wants_x:
                if chunked:
                    for r, part in zip(parts, (g @ weight).split(len(yc))):  # (c, d) each
                        grad_x[r] = part
                else:
                    grad_x = g @ weight  # (passes * n, d)
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
        return *(None if grad is None else grad * grad_total for grad in ctx.saved_tensors), None, None, None, None
