"""Which fused attention kernel each scaled_dot_product_attention (SDPA) call gets on a GPU, checked on a CPU.

CUDA's kernels take less than a CPU's: a CPU's flash kernel accepts masks and float32, a GPU's takes neither. So what
reaches SDPA (recorded by tools/common/kernel_calls.py) is judged by the rules PyTorch 2.13 applies on an sm90 GPU (H100, H200)
with the cuDNN its wheel ships (9.20) (`cuda_kernel`); the config check (`check_backend`) refuses, in one line, the
settings some call could not run with. Sources: aten/src/ATen/native/transformers/cuda/sdp_utils.cpp (dense inputs:
the order kernels are tried in, each kernel's checks) and torch/nested/_internal/sdpa.py (nested jagged inputs, the
padding-free path) of PyTorch 2.13.
"""

from dataclasses import dataclass

import torch

from ..config import ModelConfig, RuntimeConfig
from .backends import AUTO_ORDER_CUDA, SDPA_BACKENDS

# On sm90 with cuDNN >= 9.15, PyTorch 2.13 would try cuDNN first for dense inputs (check_prefer_cudnn_attention);
# backend=auto sets the order that backends.AUTO_ORDER_CUDA names instead. Nested jagged inputs keep a fixed order
# of their own, with cuDNN after math
_NAMES = {kernel: name for name, kernel in SDPA_BACKENDS.items()}
DENSE_ORDER = tuple(_NAMES[kernel] for kernel, _ in AUTO_ORDER_CUDA)
JAGGED_ORDER = ("flash", "efficient", "math", "cudnn")
REDUCED = (torch.float16, torch.bfloat16)
MAX_HEAD_DIM = 256  # flash; cuDNN on sm90 from cuDNN 9.10


@dataclass(frozen=True)
class SdpaCall:
    """One scaled_dot_product_attention call as a GPU's kernel selection sees it. For nested (padding-free) inputs
    the lengths are the longest and shortest real sequence."""

    site: str  # the attention module that made it, e.g. decoder.layers.0.cross_attn
    nested: bool
    batch: int
    heads: int
    q_len: int
    k_len: int
    min_len: int  # the shortest query or key sequence
    head_dim: int
    dtype: torch.dtype
    mask: str | None  # None, or "bool"/"float" and its number of dimensions, e.g. "bool 4-D"
    is_causal: bool
    dropout: float
    enabled: frozenset[str]  # the kernels sdpa_kernel allowed at the call
    deterministic: bool  # torch.use_deterministic_algorithms(True)

    @property
    def kind(self) -> str:
        """encoder self-attention, decoder self-attention or cross-attention, from the module's name."""
        if self.site.endswith("cross_attn"):
            return "cross-attention"
        return ("decoder" if ".decoder." in f".{self.site}" else "encoder") + " self-attention"


def _flash(c: SdpaCall) -> list[str]:
    why = []
    if c.mask:
        why.append("takes no mask")
    if c.dtype not in REDUCED:
        why.append(f"takes fp16/bf16, not {c.dtype}")
    if c.head_dim > MAX_HEAD_DIM or (c.nested and c.head_dim % 8):
        why.append(f"head dim {c.head_dim} (at most {MAX_HEAD_DIM}; nested: a multiple of 8)")
    if c.is_causal and not c.nested and c.q_len != c.k_len:
        why.append("causal only with as many queries as keys")
    if c.min_len == 0:
        why.append("an empty sequence")
    return why


def _efficient(c: SdpaCall) -> list[str]:
    # PyTorch 2.13 takes nested inputs that need gradients here (later versions add check_requires_grad_and_nested)
    why = []
    if c.dtype not in (*REDUCED, torch.float32):
        why.append(f"takes fp16/bf16/fp32, not {c.dtype}")
    alignment = 8 if c.dtype in REDUCED else 4
    if c.head_dim % alignment:
        why.append(f"head dim {c.head_dim} is not a multiple of {alignment}")
    if c.min_len == 0:
        why.append("an empty sequence")
    return why


def _cudnn(c: SdpaCall) -> list[str]:
    why = []
    if c.nested:
        why.append("nested jagged inputs reach cuDNN only when math is disabled, on an unchecked path")
    if c.dtype not in REDUCED:
        why.append(f"takes fp16/bf16, not {c.dtype}")
    if c.dropout and (c.dropout * 16) % 1:
        why.append(f"dropout {c.dropout} is not a multiple of 1/16")
    if c.head_dim % 8 or c.head_dim > MAX_HEAD_DIM:
        why.append(f"head dim {c.head_dim} (a multiple of 8, at most {MAX_HEAD_DIM})")
    if c.k_len == 1 or (c.q_len == 1 and c.dropout):
        why.append("a single key (or a single query with dropout)")
    if max(c.batch, c.heads) > 65535:
        why.append("batch or heads above 65535")
    if c.mask and not c.mask.endswith(("2-D", "4-D")):
        why.append(f"a {c.mask} mask (2-D or 4-D only)")
    if c.deterministic:
        why.append("not deterministic")
    return why


def _math(c: SdpaCall) -> list[str]:
    return ["causal nested inputs"] if c.nested and c.is_causal else []


RULES = {"flash": _flash, "efficient": _efficient, "cudnn": _cudnn, "math": _math}


def cuda_kernel(call: SdpaCall) -> tuple[str | None, dict[str, list[str]]]:
    """The kernel PyTorch 2.13 runs `call` with on an sm90 GPU (None: it raises "No available kernel"), and why each
    kernel tried before it was passed over."""
    if call.nested and call.mask:
        return None, {"all": ["nested inputs take no mask"]}
    passed_over = {}
    for kernel in JAGGED_ORDER if call.nested else DENSE_ORDER:
        why = RULES[kernel](call) if kernel in call.enabled else ["not enabled"]
        if not why:
            return kernel, passed_over
        passed_over[kernel] = why
    return None, passed_over


def check_backend(model: ModelConfig, runtime: RuntimeConfig, device_type: str, reduced_precision: bool,
                  training: bool = True) -> None:  # fmt: skip
    """Refuse, in one line, an attention backend that some attention call of this model would find no kernel for on
    this device (decoding steps included; `training`: its training steps too), before anything runs.
    tests/test_kernels.py checks every refusal against the calls recorded for it, and every accepted setting against
    the rules above (a CPU's: against the calls run)."""
    backend, head_dim = runtime.attention_backend, model.d_model // model.n_heads
    if device_type == "cpu":
        if backend in ("efficient", "cudnn"):
            raise ValueError(f"runtime.attention_backend={backend} has no CPU kernel; use auto, flash or math")
        if backend == "flash" and runtime.padding_free_attention:
            raise ValueError("runtime.attention_backend=flash: a CPU's flash kernel takes no nested tensors, which "
                             "runtime.padding_free_attention=true makes; drop one of them on a CPU")  # fmt: skip
        if backend == "flash" and training and model.attention_dropout:
            raise ValueError(f"runtime.attention_backend=flash: a CPU's flash kernel takes no dropout, and "
                             f"model.attention_dropout={model.attention_dropout}; use auto on a CPU")  # fmt: skip
        return
    if device_type != "cuda" or backend in ("auto", "math"):
        return
    if backend == "cudnn":
        raise ValueError("runtime.attention_backend=cudnn: cuDNN's kernel takes no attention over a single key, which "
                         "every search's first decoding step is; use auto (flash, efficient, then cuDNN)")  # fmt: skip
    if backend == "efficient" and head_dim % 8:
        raise ValueError(f"runtime.attention_backend=efficient needs a head dim that is a multiple of 8, this model "
                         f"has d_model / n_heads = {head_dim}; change model.d_model or model.n_heads")  # fmt: skip
    if backend != "flash":
        return
    if not runtime.padding_free_attention:
        raise ValueError("runtime.attention_backend=flash: a GPU's flash kernel takes no mask, which padded encoder "
                         "and cross attention need; add runtime.padding_free_attention=true")  # fmt: skip
    if model.window is not None:
        raise ValueError(f"runtime.attention_backend=flash takes no window mask (model.window={model.window}); "
                         "use auto")  # fmt: skip
    if head_dim % 8 or head_dim > MAX_HEAD_DIM:
        raise ValueError(f"runtime.attention_backend=flash needs a head dim that is a multiple of 8 up to "
                         f"{MAX_HEAD_DIM}, this model has {head_dim}; change model.d_model or model.n_heads")  # fmt: skip
    if not reduced_precision:
        raise ValueError("runtime.attention_backend=flash runs in bf16 or fp16 on a GPU; train with "
                         "trainer.precision=bf16-mixed (evaluate and translate: precision=bf16)")  # fmt: skip
