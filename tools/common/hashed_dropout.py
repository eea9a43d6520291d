"""A candidate CPU dropout measured against the package's (tools/bench_dropout.py) and not adopted: each element's keep
decision a hash of its index and of one seed per call drawn from the global generator (a counter-based generator, as
GPUs' Philox), computed by the kernel that applies the mask, vectorized and on every thread, and again in backward
from the seed, so that no mask is stored or saved. Eager, the kernel is inductor's, compiled once; in a compiled
model, the graph's own, the dropout alone checkpointed (the graph's common-subexpression pass would otherwise share
forward's mask with backward and save it as a bool). Why not adopted: docs/benchmarks.md, "The CPU dropout"."""

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from transformer.model.dropout import _RESOLUTION, Dropout, _scale

_M32 = 0xFFFFFFFF
_MULTIPLIER = 0x45D9F3B  # below 2**27: a 32-bit value times it stays below 2**59, so int64 never overflows


def _mix(h: Tensor) -> Tensor:
    """A 32-bit integer hash of h in [0, 2**32), in int64: each bit of the result depends on every bit of h."""
    h = ((h >> 16) ^ h) * _MULTIPLIER & _M32
    h = ((h >> 16) ^ h) * _MULTIPLIER & _M32
    return (h >> 16) ^ h


def hashed_keep_mask(seed: Tensor, shape: torch.Size, dropped: int) -> Tensor:
    """Each element True with probability 1 - dropped / 32768, from its row-major index and `seed` (0-dim int64)."""
    index = torch.arange(shape.numel(), dtype=torch.int64, device=seed.device).view(shape)
    return (_mix(_mix(index) ^ seed) & (_RESOLUTION - 1)) >= dropped


def dropped_out(x: Tensor, seed: Tensor, dropped: int, scale: float | Tensor) -> Tensor:
    return torch.where(hashed_keep_mask(seed, x.shape, dropped), x * scale, 0)


@torch.library.custom_op("candidates::dropout_seed", mutates_args=(), tags=(torch.Tag.nondeterministic_seeded,))
def dropout_seed(x: Tensor) -> Tensor:
    return torch.empty((), dtype=torch.int64, device=x.device).random_(1 << 32)


@dropout_seed.register_fake
def _(x: Tensor) -> Tensor:
    return x.new_empty((), dtype=torch.int64)


_compiled = torch.compile(dropped_out, dynamic=True, fullgraph=True)


def _kernel(x: Tensor, seed: Tensor, dropped: int) -> Tensor:
    # the scale as a tensor: computed from a symbolic `dropped` it would be a double and round otherwise than eager
    scale = torch.tensor(_scale(dropped), dtype=torch.float32)
    with torch._dynamo.config.patch(recompile_limit=16):
        return _compiled(x, seed, dropped, scale)


class _HashedDropout(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, seed: Tensor, dropped: int) -> Tensor:
        ctx.save_for_backward(seed)
        ctx.dropped = dropped
        return _kernel(x, seed, dropped)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None, None]:
        (seed,) = ctx.saved_tensors
        return _kernel(grad, seed, ctx.dropped), None, None


class HashedDropout(Dropout):
    """Our Dropout (training on a CPU, 0 < p < 1) with the hashed mask."""

    def forward(self, x: Tensor) -> Tensor:
        if not self.training or self.p == 0.0:
            return x
        dropped = round(self.p * _RESOLUTION)
        seed = dropout_seed(x.detach())
        if torch.compiler.is_compiling():
            return checkpoint(dropped_out, x, seed, dropped, _scale(dropped), use_reentrant=False)
        return _HashedDropout.apply(x, seed, dropped)


def with_hashed_dropout(model: torch.nn.Module) -> torch.nn.Module:
    """model with each of our Dropout modules hashing its mask (in place)."""
    for module in model.modules():
        if type(module) is Dropout:
            module.__class__ = HashedDropout
    return model
