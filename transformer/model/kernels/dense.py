"""The dense kernel: PyTorch's scaled_dot_product_attention over padded (B, nh, T, hs) tensors with the mask it takes,
whichever fused kernel the caller's sdpa_backend context lets PyTorch pick."""

import torch.nn.functional as F
from torch import Tensor

from ..masks import AttentionMask


def attention(q: Tensor, k: Tensor, v: Tensor, mask: AttentionMask, dropout_p: float) -> tuple[Tensor, None]:
    """The kernel interface (kernels/__init__.py): (output (B, nh, L, hs), no weights)."""
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask.sdpa, dropout_p=dropout_p, is_causal=mask.is_causal
    ), None
