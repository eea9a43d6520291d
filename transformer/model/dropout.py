"""Dropout that is cheap on CPU.

torch's CPU dropout draws one bernoulli sample per element, which costs about 15 times the multiply it feeds:
on a 2-core CPU, 6-16% of a small Transformer's training step. Here the keep mask comes from 15-bit random
integers instead (one 64-bit draw per four elements), about 4 times faster. GPUs keep torch's own fused dropout.

A model compiled for a CPU draws the same mask through an opaque op, `transformer::keep_mask`, kept in x's dtype:
inductor's own CPU dropout (a Philox number per element, a bool mask) made the compiled step slower than eager
(docs/benchmarks.md, "Compiled training step").
"""

import torch
import torch.nn.functional as F
from torch import Tensor, nn

_RESOLUTION = 1 << 15  # p is rounded to a multiple of 1/32768


def keep_mask(shape: torch.Size, dropped: int) -> Tensor:
    """A bool tensor of `shape`, each element True with probability 1 - dropped / 32768."""
    n = shape.numel()
    bits = torch.empty((n + 3) // 4, dtype=torch.int64).random_()  # 63 random bits each, from the global generator
    chunks = bits.view(torch.int16)[:n].view(shape)  # four 16-bit chunks per draw, the top one's high bit is 0
    return chunks.bitwise_and_(_RESOLUTION - 1).ge_(dropped)


def _scale(dropped: int) -> float:
    """1 / P(keep), exactly; applied in float, not rounded to x's dtype first."""
    return _RESOLUTION / (_RESOLUTION - dropped)


class _CPUDropout(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, dropped: int) -> Tensor:
        keep = keep_mask(x.shape, dropped)
        ctx.scale = _scale(dropped)
        ctx.save_for_backward(keep)
        return (x * keep).mul_(ctx.scale)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:
        (keep,) = ctx.saved_tensors
        return (grad * keep).mul_(ctx.scale), None


# seeded: the partitioner must save its result for backward, never draw it again there
@torch.library.custom_op("transformer::keep_mask", mutates_args=(), tags=(torch.Tag.nondeterministic_seeded,))
def keep_mask_like(x: Tensor, dropped: int) -> Tensor:
    """keep_mask in x's shape and dtype, 1 where kept and 0 where dropped: what a compiled graph multiplies by."""
    return keep_mask(x.shape, dropped).to(x.dtype)


@keep_mask_like.register_fake
def _(x: Tensor, dropped: int) -> Tensor:
    return x.new_empty(x.shape)  # contiguous, as keep_mask's


class Dropout(nn.Dropout):
    """nn.Dropout with the cheap CPU mask above; the same module otherwise (no parameters, same state dict)."""

    def forward(self, x: Tensor) -> Tensor:
        if not self.training or self.p == 0.0:
            return x
        dropped = round(self.p * _RESOLUTION)  # p in steps of 1/32768
        if x.device.type != "cpu" or not 0 < dropped < _RESOLUTION:
            return F.dropout(x, self.p, True, self.inplace)
        if torch.compiler.is_compiling():  # the mask saved in x's dtype
            return x * keep_mask_like(x.detach(), dropped) * _scale(dropped)
        return _CPUDropout.apply(x, dropped)
