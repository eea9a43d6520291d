"""The explicit kernel: softmax(QK^T / sqrt(hs) + mask) V in three ops, the attention weights kept. What returns
weights, and what a CPU's bf16 training runs fastest with short keys."""

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from ..masks import AttentionMask

# Up to this many keys, CPU training in bf16/fp16 computes attention explicitly (matmul, softmax,
# matmul): there it runs 2-6x faster than SDPA's CPU kernels, whose bf16 backward is slow
# (fp32 and longer keys favour SDPA's flash kernel; docs/benchmarks.md).
CPU_EXPLICIT_MAX_KEYS = 256


def explicit_is_faster(device_type: str, dtype: torch.dtype, needs_grad: bool, k_len: int) -> bool:
    """Whether `backend="auto"` skips SDPA for the explicit path: only in that measured case."""
    reduced = dtype in (torch.bfloat16, torch.float16)
    return device_type == "cpu" and reduced and needs_grad and k_len <= CPU_EXPLICIT_MAX_KEYS


def attention(q: Tensor, k: Tensor, v: Tensor, mask: AttentionMask, dropout_p: float) -> tuple[Tensor, Tensor]:
    """The kernel interface (kernels/__init__.py): (output (B, nh, L, hs), weights (B, nh, L, S))."""
    return explicit_attention(q, k, v, mask.explicit, dropout_p)


def explicit_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, dropout_p: float):
    """softmax(QK^T / sqrt(hs) + mask) V, with the probabilities (before dropout) kept for inspection; mask as
    AttentionMask.explicit. bf16 stays bf16: softmax kernels accumulate in float32 internally."""
    scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(q.size(-1)))  # (B, nh, L, S)
    if mask is not None:
        scores = scores.masked_fill(mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
    probs = scores.softmax(dim=-1)
    return F.dropout(probs, dropout_p) @ v, probs
