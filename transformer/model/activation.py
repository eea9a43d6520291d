"""The feed-forward block's ReLU, whose compiled CPU backward reads the ReLU's output rather than a saved bool mask.

Inductor's partitioner saves relu's backward mask (output <= 0) as a bool tensor, which its CPU code stores slowly
(docs/benchmarks.md, "Compiled training step"). g * sign(output) is the same gradient (output >= 0: sign 1 where the
input was positive, else 0) and needs only the output, in the activation's dtype: the tensor the second linear layer
saves anyway where no activation dropout comes between.
"""

import torch
from torch import Tensor, nn


class _ReLUFromOutput(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor) -> Tensor:
        y = torch.relu(x)
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tensor:
        (y,) = ctx.saved_tensors
        return grad * torch.sign(y)


class ReLU(nn.ReLU):
    """nn.ReLU; compiled for the CPU, with the backward above. Eager, and on GPUs, torch's own."""

    def forward(self, x: Tensor) -> Tensor:
        if torch.compiler.is_compiling() and x.device.type == "cpu":
            return _ReLUFromOutput.apply(x)
        return super().forward(x)
