"""Which SDPA kernels a call may use: runtime.attention_backend's names, and the context that restricts them."""

from contextlib import AbstractContextManager, nullcontext

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

SDPA_BACKENDS = {
    "auto": None,
    "flash": SDPBackend.FLASH_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "math": SDPBackend.MATH,
}

# On sm90 and sm100 PyTorch tries cuDNN first, and cuDNN's host cost per call (a plan per new shape, it seems) made
# an H200's training steps 2.6x slower than the efficient kernel's over batches by length (docs/gpu_runs.md): auto
# tries it after flash and efficient. (Nested jagged inputs keep PyTorch's fixed order.)
AUTO_ORDER_CUDA = (  # each kernel with the switch that says whether it is enabled
    (SDPBackend.FLASH_ATTENTION, torch.backends.cuda.flash_sdp_enabled),
    (SDPBackend.EFFICIENT_ATTENTION, torch.backends.cuda.mem_efficient_sdp_enabled),
    (SDPBackend.CUDNN_ATTENTION, torch.backends.cuda.cudnn_sdp_enabled),
    (SDPBackend.MATH, torch.backends.cuda.math_sdp_enabled),
)


def sdpa_backend(backend: str, device_type: str) -> AbstractContextManager:
    """The context that restricts scaled_dot_product_attention to `backend`'s kernel; "auto": PyTorch's choice, on
    CUDA among the kernels enabled (torch.backends.cuda.enable_*_sdp) in AUTO_ORDER_CUDA's order."""
    kernel = SDPA_BACKENDS[backend]
    if kernel is not None:
        return sdpa_kernel(kernel)
    return nullcontext() if device_type != "cuda" else sdpa_kernel(_auto_order(), set_priority=True)


@torch.compiler.assume_constant_result  # global settings: a compiled graph reads them once
def _auto_order() -> list[SDPBackend]:
    return [kernel for kernel, enabled in AUTO_ORDER_CUDA if enabled()]
