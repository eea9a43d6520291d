"""What a training step asks of a GPU's host, counted on a CPU (tools/common/dispatch.py): the ops it
dispatches, the masks and kernel contexts its attention calls get, and the fused output layer and loss against
PyTorch's own."""

import contextlib
from collections import Counter
from unittest import mock

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.exc import BackendCompilerFailed
from torch.utils._python_dispatch import TorchDispatchMode

from common.dispatch import (
    OpCounter,
    compiled_kernels,
    count_training_step,
    gpu_like_dispatch,
    kernel_calls,
)
from common.kernel_calls import synthetic_batch
from transformer.model import ModelConfig, RuntimeConfig, build_model
from transformer.model import cross_entropy as fused
from transformer.model.compiling import compile_dynamic
from transformer.model.kernels import backends, explicit
from transformer.model.loss import batch_loss_sum, target_logits
from transformer.model.masks import ALIGNMENT

V = 8000
# The GPU recipe's model (base depth and dropout) at a width a CPU steps through in a moment: no op count depends on it
BASE_DEPTH = dict(d_model=64, n_heads=8, d_ff=256, dropout=0.3, attention_dropout=0.1, activation_dropout=0.1)
# Measured at 1,081 before the eager path was trimmed (commit 42436b8), 949 after; a few ops of slack, no more
OPS_BUDGET = 955


def base_depth_model(**runtime) -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = ModelConfig.from_size("base", src_vocab_size=V, tgt_vocab_size=V, pad_id=0, **BASE_DEPTH)
    return build_model(cfg, RuntimeConfig(**runtime))


def multi30k_like_batch(rows: int = 32, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    return synthetic_batch(V, rng.integers(8, 25, rows).tolist(), rng.integers(8, 25, rows).tolist(), seed)


def test_a_base_training_step_dispatches_no_more_ops_than_its_budget():
    """The count the issue bounds, and the ops that were trimmed and must not come back: per-part slices of the fused
    in-projection (each slice's backward a zero-filled copy), the boolean padding mask converted inside every masked
    SDPA call, the causal mask built for every batch, and a float32 copy of the logits."""
    ops = count_training_step(base_depth_model(), multi30k_like_batch())
    assert ops.total <= OPS_BUDGET, (ops.total, ops.forward.most_common(12), ops.backward.most_common(12))
    everything = ops.forward + ops.backward
    for trimmed in ("slice_backward", "where", "scalar_tensor", "tril", "triu", "_log_softmax", "nll_loss_forward"):
        assert everything[trimmed] == 0, trimmed


class ParameterCasts(TorchDispatchMode):
    """Counts the casts (_to_copy) that read each parameter's memory."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.names = {p.data_ptr(): name for name, p in model.named_parameters()}
        self.casts: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket is torch.ops.aten._to_copy and args[0].untyped_storage().data_ptr() in self.names:
            self.casts[self.names[args[0].untyped_storage().data_ptr()]] += 1
        return func(*args, **(kwargs or {}))


def test_each_parameter_is_cast_to_bf16_once_per_forward():
    """Autocast casts a parameter once per forward, but a slice of one at every use: the in-projection's parts are
    views of one cast, as the tied output layer's weight is cast once, not per chunk of the loss."""
    model = base_depth_model().train()
    casts = ParameterCasts(model)
    with gpu_like_dispatch(), casts, torch.autocast("cpu", dtype=torch.bfloat16):
        batch_loss_sum(model, multi30k_like_batch(), 0.1)
    matrices = {name for name, p in model.named_parameters() if p.dim() == 2 and "embed" not in name}
    assert set(casts.casts) >= matrices and max(casts.casts.values()) == 1, casts.casts.most_common(3)


def test_every_masked_attention_call_gets_a_float_mask_in_its_dtype_with_aligned_rows():
    """What the efficient kernel takes without a copy: an additive mask in the query's dtype, its rows 16 elements
    apart, built once per batch (the same tensor in every layer, encoder and cross-attention)."""
    model = base_depth_model().train()
    batch = multi30k_like_batch()
    masks = []
    real = F.scaled_dot_product_attention

    def seen(q, k, v, attn_mask=None, **kwargs):
        if attn_mask is not None:
            masks.append((attn_mask, q.dtype))
        return real(q, k, v, attn_mask=attn_mask, **kwargs)

    with mock.patch.object(F, "scaled_dot_product_attention", seen), \
            mock.patch.object(explicit, "explicit_is_faster", lambda *a: False), \
            torch.autocast("cpu", dtype=torch.bfloat16):  # fmt: skip
        batch_loss_sum(model, batch, 0.1)
    assert len(masks) == 12  # encoder self-attention and cross-attention, 6 layers each
    for mask, dtype in masks:
        assert mask.dtype == dtype == torch.bfloat16
        assert all(stride % ALIGNMENT == 0 for stride in mask.stride()[:-1]) and mask.stride(-1) == 1
    assert len({mask.data_ptr() for mask, _ in masks}) == 1  # the encoder's serves cross-attention too


@pytest.mark.parametrize("checkpointed", [False, True], ids=["plain", "activation-checkpointing"])
def test_the_kernel_order_is_set_once_around_the_encoder_and_once_around_the_decoder(checkpointed):
    """Not around each of the 18 attention calls; with activation checkpointing each layer's recomputation in
    backward is inside it too, so that it runs the forward's kernels."""
    model = base_depth_model(attention_backend="math", activation_checkpointing=checkpointed).train()
    entered = []
    real = backends.sdpa_kernel

    @contextlib.contextmanager
    def counted(*args, **kwargs):
        entered.append(args)  # on entering, not on making the context
        with real(*args, **kwargs):
            yield

    with mock.patch.object(backends, "sdpa_kernel", counted):
        loss, _ = batch_loss_sum(model, multi30k_like_batch(), 0.1)
        assert len(entered) == 2
        loss.backward()
    assert len(entered) == (2 + 12 if checkpointed else 2)


def smoothed_cross_entropy(logits: torch.Tensor, labels: torch.Tensor, smoothing: float, ignore_index: int):
    """PyTorch's documented label-smoothed cross-entropy, summed, written out: F.cross_entropy itself rounds 1 -
    smoothing to float32 in its gradient (2.4e-8 off in float64)."""
    log_p = logits.log_softmax(-1)
    nll = -log_p.gather(1, labels.clamp(min=0)[:, None]).squeeze(1)
    loss = (1 - smoothing) * nll - smoothing * log_p.mean(-1)
    return loss[labels != ignore_index].sum()


@pytest.fixture(params=["compiled", "in-place"])
def logit_kernel(request, monkeypatch):
    """Which kernel computes the loss and its gradient in the logits: inductor's (a CPU's) or the eager one."""
    if request.param == "in-place":
        monkeypatch.setattr(fused, "eager_only", True)
    eager = mock.Mock(wraps=fused.in_place_logit_loss_and_grad)
    monkeypatch.setattr(fused, "in_place_logit_loss_and_grad", eager)
    yield request.param
    assert eager.called == (request.param == "in-place")


@pytest.mark.parametrize("ignore_index", [3, -100], ids=["pad", "minus-100"])
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("chunk_rows", [None, 7], ids=["one-chunk", "chunked"])
def test_the_fused_output_layer_and_loss_equal_the_plain_formulation_in_float64(monkeypatch, chunk_rows, bias,
                                                                               ignore_index, logit_kernel):  # fmt: skip
    torch.manual_seed(0)
    N, d, vocab = 50, 16, 37
    if chunk_rows:
        monkeypatch.setattr(fused, "CHUNK_ELEMENTS", chunk_rows * vocab)
    x = torch.randn(N, d, dtype=torch.float64, requires_grad=True)
    w = torch.randn(vocab, d, dtype=torch.float64, requires_grad=True)
    b = torch.randn(vocab, dtype=torch.float64, requires_grad=True) if bias else None  # Marian's final_logits_bias
    params = (x, w) if b is None else (x, w, b)
    labels = torch.randint(0, vocab, (N,))
    labels[::6] = ignore_index  # rows that count for nothing; -100 is F.cross_entropy's default
    want = smoothed_cross_entropy(F.linear(x, w, b), labels, 0.1, ignore_index)
    got = fused.linear_cross_entropy(x, w, labels, 0.1, ignore_index, b)
    torch.testing.assert_close(got, want)
    for g, h in zip(torch.autograd.grad(2.5 * got, params), torch.autograd.grad(2.5 * want, params)):
        torch.testing.assert_close(g, h)
    with torch.no_grad():
        torch.testing.assert_close(fused.linear_cross_entropy(x, w, labels, 0.1, ignore_index, b), want)


def test_a_cpu_without_a_working_compiler_computes_the_loss_in_eager_ops(monkeypatch):
    """inductor's kernel cannot be built (no C++ compiler): one warning, the same loss from the eager kernel, and no
    second try."""

    def fails(*args):
        raise BackendCompilerFailed(lambda: None, RuntimeError("no C++ compiler"), None)

    monkeypatch.setattr(fused, "_compiled_kernel", lambda formula: fails)
    monkeypatch.setattr(fused, "eager_only", False)
    z, labels = torch.randn(5, 9), torch.tensor([1, 2, 0, 8, 4])
    with pytest.warns(UserWarning, match="no C.. compiler"):
        total, grad = fused.logit_kernel(z.clone(), labels, 0.1, 0, True)  # the eager kernel overwrites z
    assert fused.eager_only is True
    want, want_grad = fused.in_place_logit_loss_and_grad(z.clone(), labels, 0.1, 0, True)
    torch.testing.assert_close((total, grad), (want, want_grad))


def test_the_fused_loss_computes_no_gradient_without_grad_mode_and_leaves_float16_to_the_plain_one():
    """Validation (no grad mode, float32 parameters that require gradients) runs the logits' matmul alone. float16's
    gradient in the logits would flush to zero before the loss scale reaches it: the plain formulation takes it."""
    x, w = torch.randn(6, 8), torch.nn.Parameter(torch.randn(11, 8))
    labels = torch.randint(0, 11, (6,))
    ops = OpCounter()
    with torch.no_grad(), ops:
        fused.linear_cross_entropy(x, w, labels, 0.1, 0)
    assert ops.ops["mm"] == 1 and not ops.ops["scatter"]
    with mock.patch.object(fused._LinearCrossEntropy, "apply", side_effect=AssertionError("fused")):
        half = fused.linear_cross_entropy(x.half(), w.half(), labels, 0.1, 0)
    want = F.cross_entropy(
        F.linear(x.half(), w.half()).float(), labels, ignore_index=0, label_smoothing=0.1, reduction="sum"
    )
    torch.testing.assert_close(half, want)


@pytest.mark.parametrize("chunks", [1, 3], ids=["one-chunk", "chunked"])
def test_the_bf16_training_loss_and_gradients_match_the_float32_logits_path(monkeypatch, chunks):
    """Within bf16 rounding of the logits path the loss used before: logits in bf16, copied to float32, PyTorch's
    label-smoothed cross-entropy; in one chunk (the weight's gradient one bf16 GEMM) and in several (bf16 parts
    summed in float32)."""
    model = base_depth_model().train()
    batch = multi30k_like_batch()
    rows = batch["tgt_labels"].numel()
    monkeypatch.setattr(fused, "CHUNK_ELEMENTS", -(-rows // chunks) * V)
    kernel = mock.Mock(wraps=fused.logit_kernel)
    monkeypatch.setattr(fused, "logit_kernel", kernel)
    results = []
    for fused_loss in (True, False):
        model.zero_grad()
        torch.manual_seed(1)  # the same dropout masks
        with torch.autocast("cpu", dtype=torch.bfloat16):
            if fused_loss:
                loss, _ = batch_loss_sum(model, batch, 0.1)
            else:
                logits, targets = target_logits(model, batch["src"], batch["tgt_in"], batch["tgt_out"])
                loss = F.cross_entropy(logits, targets, label_smoothing=0.1, reduction="sum")
        loss.backward()
        results.append((loss.detach(), torch.cat([p.grad.flatten() for p in model.parameters()])))
    (loss, grads), (want_loss, want_grads) = results
    assert kernel.call_count == chunks
    torch.testing.assert_close(loss, want_loss, rtol=1e-3, atol=0)
    assert (grads - want_grads).norm() <= 2e-2 * want_grads.norm()


def test_inductor_output_code_is_read_for_its_kernel_launches():
    code = """
def call(args):
    buf0 = empty_strided_cpu((4, 4), (4, 1), torch.float32)
    cpp_fused_add_mul_0(arg0_1, buf0)
    extern_kernels.mm(buf0, arg1_1, out=buf1)
    buf2 = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default(buf1, buf1, buf1)
    triton_poi_fused_relu_1.run(buf2, buf3, 16, stream=stream0)
    del buf0
    return (buf3, )
"""
    assert kernel_calls(code) == Counter(
        {"generated": 2, "extern_kernels.mm": 1, "torch.ops.aten._scaled_dot_product_flash_attention_for_cpu": 1}
    )


@pytest.mark.slow  # inductor compiles C++ kernels for a 6+6-layer step: about a minute on 2 cores
def test_the_compiled_step_launches_fewer_kernels_than_the_eager_step_dispatches_ops():
    model = base_depth_model()
    eager = count_training_step(model, multi30k_like_batch()).total
    compile_dynamic(model)
    forward, backward = compiled_kernels(model, multi30k_like_batch())
    assert forward["extern_kernels.addmm"] + forward["extern_kernels.mm"] >= 12 * 4  # the projections, as extern GEMMs
    assert forward.total() + backward.total() < eager / 2, (forward, backward, eager)
