"""Multi-head attention: one fused in-projection, heads computed by scaled_dot_product_attention.

Parameters and forward arguments follow torch.nn.MultiheadAttention(batch_first=True), so state
dicts load either way and masks mean the same thing: key_padding_mask True = padding, a boolean
attn_mask True = may NOT attend, a float mask is added to the scores.
"""

from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .casting import cast_once
from .kernels import attend
from .kernels.backends import SDPA_BACKENDS, sdpa_backend
from .kv_cache import KVCache
from .layout import SequenceLayout
from .masks import AttentionMask, attention_mask, check_mask, key_padding


def _parts(w: Tensor, b: Tensor | None, sizes: list[int]) -> tuple[tuple[Tensor, ...], tuple[Tensor | None, ...]]:
    """The fused in-projection's weight and bias split by output rows into views: (weights, biases)."""
    return w.split(sizes), (None,) * len(sizes) if b is None else b.split(sizes)


def grouped(q: Tensor, g: int) -> Tensor:
    """(g*Bk, nh, L, hs) -> (Bk, nh, g*L, hs): each g consecutive query rows as one row's queries, which attend the
    same keys (cross-attention from a sentence's beams reads its encoder output once, not once per beam)."""
    if g == 1:
        return q
    B, H, L, hs = q.shape
    return q.view(B // g, g, H, L, hs).transpose(1, 2).reshape(B // g, H, g * L, hs)  # (Bk, nh, g*L, hs)


def ungrouped(y: Tensor, g: int) -> Tensor:
    """grouped's inverse: (Bk, nh, g*L, X) -> (g*Bk, nh, L, X)."""
    if g == 1:
        return y
    Bk, H, gL, X = y.shape
    return y.view(Bk, H, g, gL // g, X).transpose(1, 2).reshape(Bk * g, H, gL // g, X)  # (B, nh, L, X)


class MultiHeadAttention(nn.Module):
    """Self- or cross-attention over (B, T, d) tensors.

    Self-attention (key is query) projects Q, K, V in one matmul; cross-attention (key is value) projects Q alone and
    K, V in one matmul. `window=W` restricts each query to keys within W positions; `backend` picks the SDPA kernel
    (auto, flash, efficient, cudnn, math). With `padding_free`, attention with only a key padding mask runs over each
    sequence's real tokens (nested jagged tensors) instead of masking padded ones.

    Masks come nn.MultiheadAttention's way (key_padding_mask, attn_mask, is_causal), built on each call, which also
    sets the kernel order (`backend`) around the call; or as an AttentionMask (`mask=`) that the model builds once
    per batch for all layers, inside the kernel order its forward set once (sdpa_backend): the faster way in.
    """

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        dropout: float = 0.0,
        bias: bool = True,
        window: int | None = None,
        backend: str = "auto",
        padding_free: bool = False,
    ):
        super().__init__()
        if embed_dim % num_heads != 0:
            raise ValueError(f"embed_dim={embed_dim} is not divisible by num_heads={num_heads}")
        if backend not in SDPA_BACKENDS:
            raise ValueError(f"unknown attention backend {backend!r}; choose one of {', '.join(SDPA_BACKENDS)}")
        if window is not None and window < 0:
            raise ValueError(f"window={window} must be a non-negative number of positions (or None)")
        self.embed_dim, self.num_heads, self.head_dim = embed_dim, num_heads, embed_dim // num_heads
        self.dropout, self.window, self.backend = dropout, window, backend
        self.padding_free = padding_free
        # initialised as nn.MultiheadAttention's: xavier-uniform in-projection, zero biases
        self.in_proj_weight = nn.Parameter(nn.init.xavier_uniform_(torch.empty(3 * embed_dim, embed_dim)))
        self.in_proj_bias = nn.Parameter(torch.zeros(3 * embed_dim)) if bias else None
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=bias)
        if bias:
            nn.init.zeros_(self.out_proj.bias)

    def _in_proj(self) -> tuple[Tensor, Tensor | None]:
        """The fused in-projection's weight (3d, d) and bias, each cast once for all of this call's matmuls: the parts
        are views of it, whose gradients meet in one op (slices of the parameter would each be cast, and each
        slice's backward would write a zero-filled (3d, d) copy)."""
        return cast_once(self.in_proj_weight), None if self.in_proj_bias is None else cast_once(self.in_proj_bias)

    def _split_heads(self, x: Tensor) -> Tensor:
        B, T, _ = x.shape
        return x.view(B, T, self.num_heads, self.head_dim).transpose(1, 2)  # (B, nh, T, hs)

    def _check_inputs(self, query: Tensor, key: Tensor, value: Tensor) -> None:
        d = self.embed_dim
        for name, x in (("query", query), ("key", key), ("value", value)):
            if x.dim() != 3 or x.size(-1) != d:
                raise ValueError(f"{name} must be (batch, length, {d}), got shape {tuple(x.shape)}")
        if key.size(0) != value.size(0) or query.size(0) % key.size(0):
            raise ValueError(
                f"batch sizes differ: query {tuple(query.shape)}, key {tuple(key.shape)}, value {tuple(value.shape)}"
                " (query's may be a multiple of key's: consecutive query rows sharing one key row)"
            )
        if key.size(1) != value.size(1):
            raise ValueError(f"key and value lengths differ: key {tuple(key.shape)}, value {tuple(value.shape)}")

    def _qkv(self, query: Tensor, key: Tensor, value: Tensor, cache: KVCache | None) -> tuple[Tensor, Tensor, Tensor]:
        """Projected heads, each (B, nh, T, hs); with a cache, keys and values so far."""
        d = self.embed_dim
        if cache is not None and cache.k is not None and cache.k.size(0) != key.size(0):
            raise ValueError(
                f"cache holds batch {cache.k.size(0)}, keys have batch {key.size(0)}; reorder or reset the cache"
            )
        w, b = self._in_proj()
        if cache is not None and cache.static and cache.k is not None:  # cross-attention: K, V projected on step one
            (w_q, _), (b_q, _) = _parts(w, b, [d, 2 * d])
            return self._split_heads(F.linear(query, w_q, b_q)), cache.k, cache.v
        if key is query and value is query:  # self-attention: Q, K, V in one matmul
            q, k, v = F.linear(query, w, b).split(d, dim=-1)
        elif key is value:  # K and V from one source: one matmul
            (w_q, w_kv), (b_q, b_kv) = _parts(w, b, [d, 2 * d])
            q = F.linear(query, w_q, b_q)
            k, v = F.linear(key, w_kv, b_kv).split(d, dim=-1)
        else:
            (w_q, w_k, w_v), (b_q, b_k, b_v) = _parts(w, b, [d, d, d])
            q, k, v = F.linear(query, w_q, b_q), F.linear(key, w_k, b_k), F.linear(value, w_v, b_v)
        q, k, v = self._split_heads(q), self._split_heads(k), self._split_heads(v)
        if cache is not None:
            k, v = cache.append(k, v)  # (B, nh, S, hs): every step's so far
        return q, k, v

    def forward(
        self,
        query: Tensor,
        key: Tensor | None = None,
        value: Tensor | None = None,
        key_padding_mask: Tensor | None = None,
        need_weights: bool = False,
        attn_mask: Tensor | None = None,
        average_attn_weights: bool = True,
        is_causal: bool = False,
        cache: KVCache | None = None,
        mask: AttentionMask | None = None,
    ) -> tuple[Tensor, Tensor | None]:
        """Returns (output (B, L, d), weights or None); weights are (B, L, S) averaged over heads,
        or (B, nh, L, S) with average_attn_weights=False, and are computed only with need_weights."""
        key = query if key is None else key
        value = key if value is None else value
        self._check_inputs(query, key, value)
        if mask is not None and (key_padding_mask is not None or attn_mask is not None or is_causal):
            raise ValueError("give either mask= or key_padding_mask/attn_mask/is_causal, not both")
        q, k, v = self._qkv(query, key, value, cache)
        g = query.size(0) // key.size(0)  # query rows per key row: a sentence's beams in beam search, else 1
        if g > 1 and (attn_mask is not None or is_causal):
            raise ValueError(
                "query rows sharing a key row take a key_padding_mask or mask= only, not attn_mask/is_causal"
            )
        q = grouped(q, g)  # (Bk, nh, g*L, hs): a key row's queries side by side
        dropout = self.dropout if self.training else 0.0
        if mask is None:  # nn.MultiheadAttention's way: this call builds its masks and sets its kernel order
            mask = self._mask(q, k, key_padding_mask, attn_mask, is_causal, need_weights or cache is not None,
                              key is query)  # fmt: skip
            with sdpa_backend(self.backend, q.device.type):
                y, weights = attend(q, k, v, mask, dropout, self.backend, need_weights)
        else:  # the model's way: its forward set the kernel order once for every layer (EncoderDecoder)
            y, weights = attend(q, k, v, mask, dropout, self.backend, need_weights)
        y, weights = ungrouped(y, g), None if weights is None else ungrouped(weights, g)  # (B, nh, L, hs|S)
        B, L, d = query.shape
        y = y.transpose(1, 2).reshape(B, L, d)  # (B, L, d)
        if weights is not None and average_attn_weights:
            weights = weights.mean(dim=1)  # (B, L, S)
        return self.out_proj(y), weights

    def _mask(self, q: Tensor, k: Tensor, key_padding_mask, attn_mask, is_causal, unpackable, self_attention):
        """nn.MultiheadAttention-style masks as an AttentionMask, per call: host facts come from syncs here (the model
        passes one built per batch instead)."""
        B, _, L, _ = q.shape
        only_padding = key_padding_mask is not None and key_padding_mask.dtype == torch.bool and attn_mask is None
        if self.padding_free and only_padding and not (is_causal or self.window is not None or unpackable):
            check_mask(key_padding_mask, "key_padding_mask", [(B, k.size(2))])
            layout = SequenceLayout.from_padding(key_padding_mask, packed=True)
            return key_padding(layout, self_attention)  # packs unless a row has no real key
        mask = attention_mask(
            key_padding_mask, attn_mask,
            batch=B, heads=self.num_heads, q_len=L, k_len=k.size(2),
            is_causal=is_causal, window=self.window, dtype=q.dtype, device=q.device,
        )  # fmt: skip
        if mask.dead is not None and q.device.type == "cpu" and not mask.dead.any():  # free on CPU, not on a GPU
            mask = replace(mask, dead=None)
        return mask
