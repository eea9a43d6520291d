"""Attention's kernels behind one interface: each file's `attention(q, k, v, mask, dropout_p)` takes q, k, v
(B, nh, T, hs) and the batch's AttentionMask and returns (output (B, nh, L, hs), weights (B, nh, L, S) or None).

- dense.py: PyTorch's scaled_dot_product_attention, masked (its fused kernels, as sdpa_backend allows);
- padding_free.py: the same over each sequence's real tokens, as nested jagged tensors, unmasked;
- explicit.py: matmul, softmax, matmul, weights kept.

`attend` picks one per call; backends.py names the SDPA kernels a call may use; rules.py judges, on a CPU, which
fused kernel each call would get on a GPU."""

from collections.abc import Callable

from torch import Tensor

from ..masks import AttentionMask
from . import dense, explicit, padding_free

Kernel = Callable[[Tensor, Tensor, Tensor, AttentionMask, float], tuple[Tensor, Tensor | None]]


def attend(q: Tensor, k: Tensor, v: Tensor, mask: AttentionMask, dropout_p: float, backend: str,
           need_weights: bool) -> tuple[Tensor, Tensor | None]:  # fmt: skip
    """The kernel for these inputs: padding-free where the mask packs, explicit where weights are wanted or it is
    faster (explicit.explicit_is_faster), else dense, among the SDPA kernels the caller's sdpa_backend context allows.
    q, k, v (B, nh, T, hs) -> (output (B, nh, L, hs), weights or None); query rows with no key at all are zeroed."""
    y, weights = choose(q, k, mask, backend, need_weights)(q, k, v, mask, dropout_p)
    weights = weights if need_weights else None
    if mask.dead is not None:
        y = y.masked_fill(mask.dead, 0.0)
        weights = None if weights is None else weights.masked_fill(mask.dead, 0.0)
    return y, weights


def choose(q: Tensor, k: Tensor, mask: AttentionMask, backend: str, need_weights: bool) -> Kernel:
    if mask.keys is not None and not need_weights:
        return padding_free.attention
    if need_weights or (backend == "auto" and explicit.explicit_is_faster(q.device.type, q.dtype, q.requires_grad,
                                                                           k.size(2))):  # fmt: skip
        return explicit.attention
    if backend == "flash" and mask.sdpa is not None and q.is_cuda:  # SDPA would only say "No available kernel"
        raise ValueError("a GPU's flash attention takes no mask: pack the real tokens instead (padding_free=True, "
                         "runtime.padding_free_attention=true) or choose another backend")  # fmt: skip
    return dense.attention
