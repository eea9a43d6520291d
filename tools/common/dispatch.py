"""The compute ops a training step dispatches, counted on a CPU: on a GPU each one is a kernel launch and its host
work (Python, the dispatcher, autograd's bookkeeping), so their number is what the eager step asks of the host.

The method (what tools/count_ops.py prints and tests/test_dispatch.py bounds): one optimizer step's forward and
loss, then its backward, under bf16 autocast, after a warm-up step; every ATen op that reaches PyTorch's dispatcher
below autograd (a TorchDispatchMode) is counted, except views, which launch nothing. Where a CPU dispatches
differently from a GPU, the GPU's way is taken: dropout is the one fused op a GPU runs (native_dropout, and its
backward), attention is one fused SDPA kernel each way (the CPU's flash kernel stands in; a GPU's fused kernels take
the dropout inside), the explicit path that `backend=auto` takes for a CPU's bf16 training is off, and a compiled
ReLU keeps torch's backward (a compiled CPU model's reads the ReLU's output, transformer/model/activation.py)."""

import contextlib
import re
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from unittest import mock

import torch
import torch.nn.functional as F
from torch._inductor.utils import run_and_get_code
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils._python_dispatch import TorchDispatchMode

from transformer.model.activation import ReLU
from transformer.model.dropout import Dropout
from transformer.model.kernels import explicit
from transformer.model.loss import batch_loss_sum


class OpCounter(TorchDispatchMode):
    """Counts the non-view ATen ops dispatched inside the block, by name."""

    def __init__(self):
        super().__init__()
        self.ops: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not func.is_view:
            self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def _fused_dropout(self: Dropout, x: torch.Tensor) -> torch.Tensor:
    if not self.training or self.p == 0.0:
        return x
    return torch.native_dropout(x, self.p, True)[0]  # what F.dropout dispatches on a GPU


def _one_kernel_sdpa(sdpa):
    def call(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, **kwargs):
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):  # one op each way; a GPU's kernel drops out inside
            return sdpa(q, k, v, attn_mask=attn_mask, dropout_p=0.0, is_causal=is_causal, **kwargs)

    return call


@contextlib.contextmanager
def gpu_like_dispatch() -> Iterator[None]:
    """Dropout and attention dispatched as a GPU dispatches them (module docstring)."""
    with mock.patch.object(Dropout, "forward", _fused_dropout), \
            mock.patch.object(F, "scaled_dot_product_attention", _one_kernel_sdpa(F.scaled_dot_product_attention)), \
            mock.patch.object(explicit, "explicit_is_faster", lambda *args: False), \
            mock.patch.object(ReLU, "forward", torch.nn.ReLU.forward):  # fmt: skip
        yield


@dataclass(frozen=True)
class StepOps:
    forward: Counter  # forward and loss
    backward: Counter

    @property
    def total(self) -> int:
        return self.forward.total() + self.backward.total()


def count_training_step(model: torch.nn.Module, batch: dict, loss: Callable | None = None) -> StepOps:
    """The ops of one training step of `model` (in train mode) on a collated batch, as the method above counts them:
    the second of two steps, so that nothing done once (a lazily built buffer) is counted. `loss(model, batch)`
    gives the step's loss; by default the training loss (batch_loss_sum, label smoothing 0.1)."""
    loss = loss or (lambda model, batch: batch_loss_sum(model, batch, 0.1)[0])
    model.train()
    for _ in range(2):
        model.zero_grad(set_to_none=True)
        forward, backward = OpCounter(), OpCounter()
        with gpu_like_dispatch():
            with forward, torch.autocast("cpu", dtype=torch.bfloat16):
                value = loss(model, batch)
            with backward:
                value.backward()
    model.zero_grad(set_to_none=True)
    return StepOps(forward.ops, backward.ops)


# A kernel call in inductor's output code: a generated kernel (C++ on a CPU, Triton's `.run` on a GPU) or an extern
# one (matmuls, attention)
_KERNEL_CALL = re.compile(
    r"^\s+(?:\w+ = )?(cpp_fused_\w+|triton_\w+\.run|extern_kernels\.\w+|torch\.ops\.\w+\.\w+)(?:\.\w+)?\(", re.M
)


def kernel_calls(code: str) -> Counter:
    """The kernels one run of an inductor output module launches, by kind (generated kernels counted together)."""
    body = code[code.index("def call(") :] if "def call(" in code else code
    return Counter("generated" if not name.startswith(("extern", "torch.ops")) else name
                   for name in _KERNEL_CALL.findall(body))  # fmt: skip


def compiled_kernels(model: torch.nn.Module, batch: dict, label_smoothing: float = 0.1) -> list[Counter]:
    """The kernels of one training step of a model compiled with inductor (compile_dynamic), per graph it compiled
    (forward, backward), read from inductor's output code; dispatched as a GPU would (gpu_like_dispatch)."""
    model.train()

    def step():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss, _ = batch_loss_sum(model, batch, label_smoothing)
        loss.backward()

    with gpu_like_dispatch():
        _, codes = run_and_get_code(step)
    return [kernel_calls(code) for code in codes]
