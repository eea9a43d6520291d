"""The padding-free kernel: SDPA over each sequence's real tokens only, as nested jagged tensors, with no mask at all,
so that the fused kernels stay eligible (on a GPU, flash attention over variable lengths)."""

import torch
import torch.nn.functional as F
from torch import Tensor

from ..layout import SequenceLayout
from ..masks import AttentionMask


def attention(q: Tensor, k: Tensor, v: Tensor, mask: AttentionMask, dropout_p: float) -> tuple[Tensor, None]:
    """The kernel interface (kernels/__init__.py): q, k, v (B, nh, T, hs) -> (output (B, nh, L, hs), no weights),
    the output zero at padded queries (which nothing downstream reads). mask.keys (and mask.queries, in
    self-attention) say where the real tokens are."""
    keys, queries = mask.keys, mask.queries
    y = F.scaled_dot_product_attention(_pack(q, queries), _pack(k, keys), _pack(v, keys), dropout_p=dropout_p)
    y = y.transpose(1, 2).values()  # (total queries, nh, hs)
    B, H, L, hs = q.shape
    if queries is not None:
        y = y.new_zeros(B * L, H, hs).index_copy(0, queries.index, y)  # (B*L, nh, hs)
    return y.view(B, L, H, hs).transpose(1, 2), None  # (B, nh, L, hs)


def _pack(x: Tensor, layout: SequenceLayout | None) -> Tensor:
    """(B, nh, T, hs) -> nested jagged (B, nh, j, hs): each row's real tokens as `layout` packs them, or all T."""
    B, H, T, hs = x.shape
    values = x.transpose(1, 2).reshape(B * T, H, hs)  # (B*T, nh, hs)
    if layout is None:
        offsets = torch.arange(0, B * T + 1, T, device=x.device)
        packed = torch.nested.nested_tensor_from_jagged(values, offsets, min_seqlen=T, max_seqlen=T)
    else:  # packable layouts have no empty row, so at least one token each
        values = values.index_select(0, layout.index)  # (total, nh, hs)
        packed = torch.nested.nested_tensor_from_jagged(values, layout.offsets, min_seqlen=1, max_seqlen=layout.longest)
    return packed.transpose(1, 2)  # (B, nh, j, hs)
