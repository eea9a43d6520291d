"""Which keys each query may attend, in the forms the attention kernels take.

Callers speak nn.MultiheadAttention's convention: key_padding_mask True = padding, a boolean attn_mask True = may
NOT attend, a float mask is added to the scores. `attention_mask` is the one place that turns them into the kernels'.
"""

import operator
from dataclasses import dataclass, replace
from functools import reduce

import torch
from torch import Tensor

from .layout import SequenceLayout


@dataclass(frozen=True)
class AttentionMask:
    """Built once per batch and attention kind (encoder self-attention, cross-attention, decoder self-attention) and
    read by every layer of that kind. Each field broadcasts to (B, nh, L, S); None means nothing to apply.

    sdpa: what scaled_dot_product_attention takes: bool True = may attend, or float added to the scores;
    is_causal: SDPA's own causal mask applies too (only where it is exactly right, L == S), which keeps the fused
      kernels eligible; the explicit kernel finds it in `explicit`;
    explicit: everything, causal part included, for the explicit kernel: bool True = may NOT attend, or float added;
    dead: bool (B|1, nh|1, L, 1), query rows with no key at all: opened in the masks to keep softmax finite, the
      kernel's output there is zeroed;
    keys, queries: the padding-free kernel may pack the keys (and, in self-attention, the queries) by these layouts.
    """

    sdpa: Tensor | None = None
    is_causal: bool = False
    explicit: Tensor | None = None
    dead: Tensor | None = None
    keys: SequenceLayout | None = None
    queries: SequenceLayout | None = None


def check_mask(mask: Tensor, name: str, shapes: list[tuple[int, ...]]) -> None:
    if mask.dtype != torch.bool and not mask.is_floating_point():
        raise ValueError(f"{name} must be bool or floating point, got dtype {mask.dtype}")
    if tuple(mask.shape) not in shapes:
        raise ValueError(f"{name} has shape {tuple(mask.shape)}, expected one of {shapes}")


def attention_mask(
    key_padding_mask: Tensor | None,
    attn_mask: Tensor | None,
    *,
    batch: int,
    heads: int,
    q_len: int,
    k_len: int,
    is_causal: bool = False,
    window: int | None = None,
    dtype: torch.dtype = torch.float32,
    device: torch.device | None = None,
    every_query_has_a_key: bool = False,
) -> AttentionMask:
    """nn.MultiheadAttention-style masks (plus causal and window masks) as an AttentionMask: boolean_mask where every
    part is boolean, additive_mask where some part is a float mask (cast to `dtype`), empty where there is nothing.

    Causal and window masks align the last query with the last key, which is what a key/value cache needs (query i
    sits at position k_len - q_len + i). With `every_query_has_a_key` (the caller knows it on the host) no dead rows
    are looked for.
    """
    if key_padding_mask is not None:
        check_mask(key_padding_mask, "key_padding_mask", [(batch, k_len)])
    if attn_mask is not None:
        check_mask(attn_mask, "attn_mask", [(q_len, k_len), (batch * heads, q_len, k_len)])
    positional = window is not None or (is_causal and q_len > 1)
    if key_padding_mask is None and attn_mask is None and not positional:
        return AttentionMask()  # a single cached query sees every earlier key
    allowed, additive = [], []  # bool masks as True = may attend; float masks to add to the scores
    if positional:
        allowed.append(positions_allowed(q_len, k_len, is_causal, window, device))
    padding = None if key_padding_mask is None else key_padding_mask[:, None, None, :]  # (B, 1, 1, S)
    if attn_mask is not None:
        attn_mask = attn_mask.view(batch, heads, q_len, k_len) if attn_mask.dim() == 3 else attn_mask[None, None]
    for m in (padding, attn_mask):
        if m is not None and m.dtype == torch.bool:
            allowed.append(~m)
        elif m is not None:
            additive.append(m.to(dtype))
    keep = reduce(operator.and_, allowed) if allowed else None
    if additive:
        return additive_mask(reduce(operator.add, additive), keep)
    alone = key_padding_mask is None and attn_mask is None  # causal and window masks alone: ...
    # ... each query keeps its own position (causal: when no query precedes the keys)
    if every_query_has_a_key or (alone and (not is_causal or q_len <= k_len)):
        return boolean_mask(keep, causal=alone and is_causal and window is None and q_len == k_len)
    return boolean_mask_with_dead_rows(keep)


def positions_allowed(q_len: int, k_len: int, is_causal: bool, window: int | None, device) -> Tensor:
    """(1, 1, L, S) bool, True = may attend: the keys within `window` positions (and, causal, not ahead) of each
    query, the last query at the last key."""
    q_pos = torch.arange(k_len - q_len, k_len, device=device)
    behind = q_pos[:, None] - torch.arange(k_len, device=device)[None, :]  # (L, S): how far back each key is
    near = torch.ones_like(behind, dtype=torch.bool) if window is None else behind.abs() <= window
    return (near & (behind >= 0) if is_causal else near)[None, None]  # (1, 1, L, S)


def boolean_mask(keep: Tensor, causal: bool = False) -> AttentionMask:
    """`keep` (True = may attend), every query with at least one key. `causal`: keep is exactly the causal mask
    over as many queries as keys, which SDPA's own flag applies (keeping the fused kernels eligible)."""
    return AttentionMask(None if causal else keep, causal, ~keep)


def boolean_mask_with_dead_rows(keep: Tensor) -> AttentionMask:
    """`keep` (True = may attend) where some query may have no key: those rows are opened in the masks (softmax
    stays finite) and marked dead, for the kernel's output there to be zeroed."""
    dead = ~keep.any(dim=-1, keepdim=True)
    return AttentionMask(keep | dead, False, ~(keep | dead), dead)


def additive_mask(scores: Tensor, keep: Tensor | None) -> AttentionMask:
    """A float mask added to the scores, -inf where `keep` (if any) says no; rows left all -inf are dead, opened
    (0) in the mask and zeroed after."""
    if keep is not None:
        scores = scores.masked_fill(~keep, float("-inf"))
    dead = torch.isneginf(scores).all(dim=-1, keepdim=True)
    scores = scores.masked_fill(dead, 0.0)
    return AttentionMask(scores, False, scores, dead)


# The efficient kernel reads a float mask whose rows start 16 elements apart; another is copied, padded, at each call
ALIGNMENT = 16


def padding_bias(padding: Tensor, dtype: torch.dtype) -> Tensor:
    """(B, S) True = padding -> (B, 1, 1, S) additive mask in `dtype` (0, or -inf at padding): the form every SDPA
    kernel takes as it is, built once per batch. Its rows are ALIGNMENT-aligned slices of a wider buffer, wider
    even where S is a multiple of ALIGNMENT, so that the mask is never contiguous: one compiled graph for every S."""
    B, S = padding.shape
    width = (S // ALIGNMENT + 1) * ALIGNMENT
    bias = torch.zeros(B, 1, 1, width, dtype=dtype, device=padding.device)[..., :S]  # (B, 1, 1, S), aligned rows
    return bias.masked_fill_(padding[:, None, None, :], float("-inf"))


def key_padding(layout: SequenceLayout, self_attention: bool = False, dtype: torch.dtype = torch.float32
                ) -> AttentionMask:  # fmt: skip
    """Keys padded as `layout` says (encoder self-attention, cross-attention), nothing else, as padding_bias in the
    dtype attention computes in; packable where the layout packs and no sentence is empty."""
    if layout.padding is None:
        mask = AttentionMask()
    elif not layout.empty_rows:
        bias = padding_bias(layout.padding, dtype)
        mask = AttentionMask(bias, False, bias)
    else:  # a row without keys: its queries are opened in the mask and zeroed after (`dead`)
        # q_len=1: key padding is the same for every query, and broadcasts to any number of them
        batch, width = layout.padding.shape
        return attention_mask(layout.padding, None, batch=batch, heads=1, q_len=1, k_len=width)
    if layout.index is None:
        return mask
    return replace(mask, keys=layout, queries=layout if self_attention else None)


def future_table(size: int, device: torch.device | None = None) -> Tensor:
    """(size, size) bool, True above the diagonal: the keys each position may NOT attend in causal attention. The
    model keeps one and slices causal masks out of it (views), rather than building them for every batch."""
    return torch.ones(size, size, dtype=torch.bool, device=device).triu(1)


def causal(q_len: int, k_len: int, window: int | None, future: Tensor) -> AttentionMask:
    """Decoder self-attention over right-padded targets: padded keys lie in every real query's future, so causal
    alone suffices. With a cache, the q_len new queries are the last of k_len positions. `future` is a future_table
    at least k_len wide: training's mask (q_len == k_len) is SDPA's own causal flag, the explicit kernel's a view."""
    if window is None and q_len == k_len:
        return AttentionMask(None, True, future[:q_len, :k_len][None, None])  # (1, 1, L, S)
    return attention_mask(None, None, batch=1, heads=1, q_len=q_len, k_len=k_len, is_causal=True, window=window,
                          device=future.device)  # fmt: skip
