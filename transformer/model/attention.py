"""Multi-head attention: one fused in-projection, heads computed by scaled_dot_product_attention.

Parameters and forward arguments follow torch.nn.MultiheadAttention(batch_first=True), so state
dicts load either way and masks mean the same thing: key_padding_mask True = padding, a boolean
attn_mask True = may NOT attend, a float mask is added to the scores.
"""

import math
import operator
from contextlib import nullcontext
from dataclasses import dataclass
from functools import reduce

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.attention import SDPBackend, sdpa_kernel

SDPA_BACKENDS = {
    "auto": None,
    "flash": SDPBackend.FLASH_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "math": SDPBackend.MATH,
}


# Up to this many keys, CPU training in bf16/fp16 computes attention explicitly (matmul, softmax,
# matmul): there it runs 2-6x faster than SDPA's CPU kernels, whose bf16 backward is slow
# (fp32 and longer keys favour SDPA's flash kernel; docs/benchmarks.md).
CPU_EXPLICIT_MAX_KEYS = 256


def explicit_is_faster(device_type: str, dtype: torch.dtype, needs_grad: bool, k_len: int) -> bool:
    """Whether `backend="auto"` skips SDPA for the explicit path: only in that measured case."""
    reduced = dtype in (torch.bfloat16, torch.float16)
    return device_type == "cpu" and reduced and needs_grad and k_len <= CPU_EXPLICIT_MAX_KEYS


@dataclass
class KVCache:
    """Projected keys and values kept between decoding steps, each (B, nh, S, hs).

    By default each step's keys and values are appended (self-attention). A static cache
    (cross-attention) is filled from the encoder output on the first step and reused after.
    """

    static: bool = False
    k: Tensor | None = None
    v: Tensor | None = None

    def __len__(self) -> int:
        return 0 if self.k is None else self.k.size(2)

    def reorder(self, index: Tensor) -> None:
        """Keep batch rows `index` (beam search: the surviving hypotheses)."""
        if self.k is not None:
            self.k = self.k.index_select(0, index)
            self.v = self.v.index_select(0, index)


def _check_mask(mask: Tensor, name: str, shapes: list[tuple[int, ...]]) -> None:
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
    is_causal: bool,
    window: int | None,
    dtype: torch.dtype,
    device: torch.device,
    native_causal: bool = True,
) -> tuple[Tensor | None, bool, Tensor | None]:
    """Turn nn.MultiheadAttention-style masks into what scaled_dot_product_attention takes.

    The only place masks change polarity. Causal and window masks align the last query with
    the last key, which is what a key/value cache needs (query i sits at position
    k_len - q_len + i). Returns (mask, is_causal, dead):
      mask: None, bool (True = may attend) or float (added), broadcastable to (B, nh, L, S);
      is_causal: True only where SDPA's own causal mask is exactly right (it aligns top-left),
        so that the fused kernels stay eligible;
      dead: None, or a bool (B|1, nh|1, L, 1) marking query rows with no key to attend to;
        their mask rows are opened to keep softmax finite, and the caller zeroes their output.
    """
    if key_padding_mask is not None:
        _check_mask(key_padding_mask, "key_padding_mask", [(batch, k_len)])
    if attn_mask is not None:
        _check_mask(attn_mask, "attn_mask", [(q_len, k_len), (batch * heads, q_len, k_len)])

    positional = window is not None or (is_causal and q_len > 1)
    if key_padding_mask is None and attn_mask is None and not positional:
        return None, False, None  # a single cached query sees every earlier key
    if (
        native_causal
        and is_causal
        and window is None
        and q_len == k_len
        and key_padding_mask is None
        and attn_mask is None
    ):
        return None, True, None

    allowed, additive = [], []  # bool masks as True = may attend; float masks to add to the scores
    if positional:
        q_pos = torch.arange(k_len - q_len, k_len, device=device)
        behind = q_pos[:, None] - torch.arange(k_len, device=device)[None, :]  # (L, S): how far back each key is
        near = torch.ones_like(behind, dtype=torch.bool) if window is None else behind.abs() <= window
        allowed.append((near & (behind >= 0) if is_causal else near)[None, None])  # (1, 1, L, S)
    padding = None if key_padding_mask is None else key_padding_mask[:, None, None, :]  # (B, 1, 1, S)
    if attn_mask is not None:
        attn_mask = attn_mask.view(batch, heads, q_len, k_len) if attn_mask.dim() == 3 else attn_mask[None, None]
    for m in (padding, attn_mask):
        if m is None:
            continue
        if m.dtype == torch.bool:
            allowed.append(~m)
        else:
            additive.append(m.to(dtype))

    keep = reduce(operator.and_, allowed) if allowed else None
    if not additive:
        dead = ~keep.any(dim=-1, keepdim=True)
        if device.type == "cpu" and not dead.any():  # free to check on CPU; on a GPU the sync costs more
            return keep, False, None
        return keep | dead, False, dead

    mask = reduce(operator.add, additive)
    if keep is not None:
        mask = mask.masked_fill(~keep, float("-inf"))
    dead = torch.isneginf(mask).all(dim=-1, keepdim=True)
    return mask.masked_fill(dead, 0.0), False, dead


def _pack(x: Tensor, keep: Tensor | None) -> Tensor:
    """(B, nh, T, hs) with keep (B, T) True = real token, or None = all real -> nested jagged (B, nh, j, hs)."""
    B, H, T, hs = x.shape
    if keep is None:
        values = x.transpose(1, 2).reshape(B * T, H, hs)  # (B*T, nh, hs)
        offsets = torch.arange(0, B * T + 1, T, device=x.device)
    else:
        values = x.transpose(1, 2)[keep]  # (total, nh, hs): the real tokens of each row, in order
        offsets = F.pad(keep.sum(1).cumsum(0), (1, 0))
    return torch.nested.nested_tensor_from_jagged(values, offsets).transpose(1, 2)  # (B, nh, j, hs)


def padding_free_attention(
    q: Tensor, k: Tensor, v: Tensor, key_padding_mask: Tensor, query_padding_mask: Tensor | None, dropout_p: float
) -> Tensor:
    """SDPA over each sequence's real tokens only, as nested jagged tensors: no mask at all, so that the fused
    kernels stay eligible (on a GPU, flash attention over variable lengths). q, k, v are (B, nh, T, hs), masks
    True = padding. Returns (B, nh, L, hs), zero at padded queries (which nothing downstream reads)."""
    q_keep = None if query_padding_mask is None else ~query_padding_mask
    k_keep = ~key_padding_mask
    y = F.scaled_dot_product_attention(_pack(q, q_keep), _pack(k, k_keep), _pack(v, k_keep), dropout_p=dropout_p)
    y = y.transpose(1, 2).values()  # (total queries, nh, hs)
    B, H, L, hs = q.shape
    if q_keep is None:
        return y.view(B, L, H, hs).transpose(1, 2)  # (B, nh, L, hs)
    out = y.new_zeros(B, L, H, hs)
    out[q_keep] = y
    return out.transpose(1, 2)  # (B, nh, L, hs)


class MultiHeadAttention(nn.Module):
    """Self- or cross-attention over (B, T, d) tensors.

    Self-attention (key is query) projects Q, K, V in one matmul; cross-attention (key is value)
    projects Q alone and K, V in one matmul. `window=W` restricts each query to keys within W
    positions; `backend` picks the SDPA kernel (auto, flash, efficient, cudnn, math). With
    `padding_free`, attention with only a key padding mask runs over each sequence's real tokens
    (nested jagged tensors) instead of masking padded ones.
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
        self.in_proj_weight = nn.Parameter(torch.empty(3 * embed_dim, embed_dim))
        self.in_proj_bias = nn.Parameter(torch.zeros(3 * embed_dim)) if bias else None
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=bias)
        nn.init.xavier_uniform_(self.in_proj_weight)
        if bias:
            nn.init.zeros_(self.out_proj.bias)

    def _project(self, x: Tensor, part: slice) -> Tensor:
        w = self.in_proj_weight[part]
        b = None if self.in_proj_bias is None else self.in_proj_bias[part]
        return F.linear(x, w, b)

    def _split_heads(self, x: Tensor) -> Tensor:
        B, T, _ = x.shape
        return x.view(B, T, self.num_heads, self.head_dim).transpose(1, 2)  # (B, nh, T, hs)

    def _check_inputs(self, query: Tensor, key: Tensor, value: Tensor) -> None:
        d = self.embed_dim
        for name, x in (("query", query), ("key", key), ("value", value)):
            if x.dim() != 3 or x.size(-1) != d:
                raise ValueError(f"{name} must be (batch, length, {d}), got shape {tuple(x.shape)}")
        if not query.size(0) == key.size(0) == value.size(0):
            raise ValueError(
                f"batch sizes differ: query {tuple(query.shape)}, key {tuple(key.shape)}, value {tuple(value.shape)}"
            )
        if key.size(1) != value.size(1):
            raise ValueError(f"key and value lengths differ: key {tuple(key.shape)}, value {tuple(value.shape)}")

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
    ) -> tuple[Tensor, Tensor | None]:
        """Returns (output (B, L, d), weights or None); weights are (B, L, S) averaged over heads,
        or (B, nh, L, S) with average_attn_weights=False, and are computed only with need_weights."""
        key = query if key is None else key
        value = key if value is None else value
        self._check_inputs(query, key, value)
        B, L, d = query.shape

        if cache is not None and cache.k is not None and cache.k.size(0) != B:
            raise ValueError(f"cache holds batch {cache.k.size(0)}, query has batch {B}; reorder or reset the cache")
        if cache is not None and cache.static and cache.k is not None:  # cross-attention: K, V projected on step one
            q = self._split_heads(self._project(query, slice(0, d)))
            k, v = cache.k, cache.v
        else:
            if key is query and value is query:  # self-attention: Q, K, V in one matmul
                q, k, v = self._project(query, slice(None)).split(d, dim=-1)
            else:
                q = self._project(query, slice(0, d))
                if key is value:  # K and V from one source: one matmul
                    k, v = self._project(key, slice(d, None)).split(d, dim=-1)
                else:
                    k, v = self._project(key, slice(d, 2 * d)), self._project(value, slice(2 * d, None))
            q, k, v = self._split_heads(q), self._split_heads(k), self._split_heads(v)
            if cache is not None:
                if cache.k is not None:  # (static caches never get here with keys)
                    k, v = torch.cat([cache.k, k], dim=2), torch.cat([cache.v, v], dim=2)  # (B, nh, S, hs)
                cache.k, cache.v = k, v

        dropout_p = self.dropout if self.training else 0.0
        if self.padding_free and key_padding_mask is not None:
            _check_mask(key_padding_mask, "key_padding_mask", [(B, k.size(2))])
        if self._can_skip_padding(key_padding_mask, attn_mask, is_causal, need_weights, cache):
            # in self-attention the padded queries are the padded keys; they are dropped too
            query_padding = key_padding_mask if key is query else None
            with self._kernel():
                y = padding_free_attention(q, k, v, key_padding_mask, query_padding, dropout_p)
            return self.out_proj(y.transpose(1, 2).reshape(B, L, d)), None  # (B, L, d)

        explicit = need_weights or (
            self.backend == "auto" and explicit_is_faster(q.device.type, q.dtype, q.requires_grad, k.size(2))
        )
        mask, causal, dead = attention_mask(
            key_padding_mask, attn_mask,
            batch=B, heads=self.num_heads, q_len=L, k_len=k.size(2),
            is_causal=is_causal, window=self.window, dtype=q.dtype, device=q.device,
            native_causal=not explicit,
        )  # fmt: skip
        weights = None
        if explicit:
            y, weights = self._explicit_attention(q, k, v, mask, dropout_p)
            weights = weights if need_weights else None
        else:
            with self._kernel():
                y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=causal)
        if dead is not None:
            y = y.masked_fill(dead, 0.0)
            weights = None if weights is None else weights.masked_fill(dead, 0.0)
        y = y.transpose(1, 2).reshape(B, L, d)  # (B, L, d)
        if weights is not None and average_attn_weights:
            weights = weights.mean(dim=1)  # (B, L, S)
        return self.out_proj(y), weights

    def _can_skip_padding(self, key_padding_mask, attn_mask, is_causal, need_weights, cache) -> bool:
        """The padding-free path takes boolean key padding alone, and every sequence needs a real key (a row with
        none would have nothing to attend to; the padded path zeroes it)."""
        if not self.padding_free or key_padding_mask is None or key_padding_mask.dtype != torch.bool:
            return False
        if attn_mask is not None or is_causal or self.window is not None or need_weights or cache is not None:
            return False
        return bool((~key_padding_mask).any(dim=1).all())

    def _kernel(self):
        backend = SDPA_BACKENDS[self.backend]
        return nullcontext() if backend is None else sdpa_kernel(backend)

    def _explicit_attention(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, dropout_p: float):
        """softmax(QK^T / sqrt(hs) + mask) V with the probabilities kept (before dropout), for inspection.
        bf16 stays bf16: softmax kernels accumulate in float32 internally."""
        scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(self.head_dim))  # (B, nh, L, S)
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
        probs = scores.softmax(dim=-1)
        return F.dropout(probs, dropout_p) @ v, probs
