"""CUDA's attention kernel rules, checked on a CPU: every scaled_dot_product_attention call of a training step, a
validation pass, greedy and beam search is recorded and judged by the rules PyTorch 2.13 applies on an sm90 GPU.
Every runtime.attention_backend either gets a kernel for every call, or is refused at config time, and refused only
where some call would have none."""

import pytest
import torch

from common.kernel_calls import PHASES, attention_calls, kernel_table, run_phase, synthetic_batch
from transformer.model import ModelConfig, RuntimeConfig, build_model
from transformer.model.kernels.backends import SDPA_BACKENDS, sdpa_backend
from transformer.model.kernels.rules import DENSE_ORDER, JAGGED_ORDER, RULES, SdpaCall, check_backend, cuda_kernel

BACKENDS = ("auto", "flash", "efficient", "cudnn", "math")
V = 40


def model_and_batch(backend: str, padding_free: bool, **changes):
    """The tiny model with attention dropout, as the GPU recipe trains; sources of different lengths, so that
    padding needs masking and sentences leave the searches at different steps."""
    cfg = ModelConfig.from_size("tiny", src_vocab_size=V, tgt_vocab_size=V, pad_id=0, attention_dropout=0.1, **changes)
    torch.manual_seed(0)
    model = build_model(cfg, RuntimeConfig(attention_backend=backend, padding_free_attention=padding_free))
    return cfg, model, synthetic_batch(V, [5, 9, 3, 9], [4, 7, 6, 2])


def refusal(cfg, runtime, device_type, reduced) -> str | None:
    try:
        check_backend(cfg, runtime, device_type, reduced)
    except ValueError as e:
        return str(e)
    return None


@pytest.mark.parametrize("bf16", [True, False], ids=["bf16", "fp32"])
@pytest.mark.parametrize("padding_free", [False, True], ids=["padded", "padding-free"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_every_backend_runs_every_call_on_a_gpu_or_is_refused(backend, padding_free, bf16):
    cfg, model, batch = model_and_batch(backend, padding_free)
    calls = attention_calls(model, batch, bf16)
    assert all(calls.values()), calls  # every phase reaches SDPA
    without_kernel = [c for recorded in calls.values() for c in recorded if cuda_kernel(c)[0] is None]
    refused = refusal(cfg, model_runtime(model), "cuda", bf16)
    if refused is None:
        assert not without_kernel, kernel_table(calls)
        if backend != "auto":
            assert {cuda_kernel(c)[0] for recorded in calls.values() for c in recorded} == {backend}
    else:
        assert without_kernel, f"refused ({refused}) though every call has a kernel:\n{kernel_table(calls)}"
        assert "\n" not in refused and refused.startswith("runtime.attention_backend=")


def model_runtime(model) -> RuntimeConfig:
    attention = model.encoder.layers[0].self_attn
    return RuntimeConfig(attention_backend=attention.backend, padding_free_attention=attention.padding_free)


def test_flash_with_padding_free_attention_keeps_every_call_maskless_decoding_steps_included():
    """The GPU's flash kernel takes no mask: the searches' cross-attention steps run over the real source tokens as
    nested tensors, also after finished sentences leave the batch."""
    cfg, model, batch = model_and_batch("flash", True)
    calls = attention_calls(model, batch, bf16=True)
    for phase in ("greedy search", "beam search"):
        cross = [c for c in calls[phase] if c.kind == "cross-attention"]
        assert len(cross) > 10 and all(c.mask is None for c in cross)
        assert any(c.nested for c in cross) and any(c.batch < 4 for c in cross if c.nested)  # rows have left
    assert check_backend(cfg, model_runtime(model), "cuda", reduced_precision=True) is None


DENSE = dict(site="decoder.layers.0.self_attn", nested=False, batch=8, heads=8, q_len=20, k_len=20, min_len=20,
             head_dim=64, dtype=torch.bfloat16, mask=None, is_causal=False, dropout=0.0,
             enabled=frozenset(("flash", "efficient", "cudnn", "math")), deterministic=False)  # fmt: skip
KERNEL_NAMES = {int(kernel): name for name, kernel in SDPA_BACKENDS.items() if kernel is not None}


def test_jagged_inputs_are_judged_in_the_order_pytorch_reports(monkeypatch):
    """Nested inputs take the order of PyTorch's nested path, whatever a context sets for dense ones: read from its
    selection (torch.nested._internal.sdpa) by letting every kernel take the call, then refusing the one chosen."""
    import torch.nested._internal.sdpa as jagged

    takes = dict.fromkeys(JAGGED_ORDER, True)
    monkeypatch.setattr(jagged, "SDPAParams", lambda *args: None)
    for rule, kernel in (("can_use_flash_attention", "flash"), ("_can_use_flash_sdpa_jagged", "flash"),
                         ("can_use_efficient_attention", "efficient"), ("_can_use_efficient_sdpa_jagged", "efficient"),
                         ("math_sdp_enabled", "math"), ("_can_use_math_sdpa_jagged", "math"),
                         ("can_use_cudnn_attention", "cudnn")):  # fmt: skip
        monkeypatch.setattr(jagged, rule, lambda *args, kernel=kernel, **kwargs: takes[kernel])
    chosen = []
    while (backend := jagged._select_sdp_backend(None, None, None, None, 0.0, False, False)) in SDPA_BACKENDS.values():
        chosen.append(KERNEL_NAMES[int(backend)])
        takes[chosen[-1]] = False
    assert tuple(chosen) == JAGGED_ORDER


@pytest.mark.parametrize("nested", [False, True], ids=["dense", "jagged"])
def test_a_call_gets_the_first_kernel_of_its_order_that_is_enabled_and_takes_it(nested):
    order = JAGGED_ORDER if nested else DENSE_ORDER
    call = dict(DENSE, nested=nested)
    takers = order[:3] if nested else order  # cuDNN never takes jagged inputs (its rule); the others take this call
    assert [kernel for kernel in order if not RULES[kernel](SdpaCall(**call))] == list(takers)
    for skipped in range(len(order)):
        chosen, passed_over = cuda_kernel(SdpaCall(**call | dict(enabled=frozenset(order[skipped:]))))
        assert chosen == (order[skipped] if skipped < len(takers) else None)
        assert list(passed_over)[: min(skipped, len(takers))] == list(order[: min(skipped, len(takers))])
    refused_by_first = call | dict(dtype=torch.float32, head_dim=64)  # flash (first of both) takes no fp32
    assert cuda_kernel(SdpaCall(**refused_by_first))[0] == order[1] == "efficient"


def test_each_rule_refuses_what_pytorch_2_13s_checks_refuse():
    """Spot checks of the constraints transcribed from sdp_utils.cpp, each through the rule that holds it."""
    refuses = {
        kernel: lambda kernel=kernel, **change: bool(RULES[kernel](SdpaCall(**DENSE | change))) for kernel in RULES
    }
    assert refuses["flash"](mask="bool 4-D") and refuses["flash"](head_dim=320) and not refuses["flash"](head_dim=256)
    assert refuses["flash"](is_causal=True, q_len=1) and not refuses["flash"](is_causal=True)  # causal: square only
    assert refuses["cudnn"](dropout=0.1) and not refuses["cudnn"](dropout=0.125)  # dropout in 1/16 steps
    assert refuses["cudnn"](deterministic=True) and refuses["cudnn"](q_len=1, k_len=1)  # one key
    assert refuses["efficient"](dtype=torch.float32, head_dim=34) and not refuses["efficient"](
        dtype=torch.float32, head_dim=36
    )
    assert refuses["efficient"](head_dim=36) and not refuses["efficient"](mask="bool 4-D", dropout=0.1)
    assert not refuses["math"](mask="bool 4-D") and refuses["math"](nested=True, is_causal=True)
    assert cuda_kernel(SdpaCall(**DENSE | dict(nested=True, mask="bool 4-D")))[0] is None  # jagged takes no mask
    only_flash = frozenset(("flash",))
    assert cuda_kernel(SdpaCall(**DENSE | dict(enabled=only_flash, mask="bool 4-D")))[0] is None


def test_auto_tries_cudnn_after_flash_and_efficient_on_cuda():
    """PyTorch's own order on sm90 puts cuDNN first, whose cost per call made an H200's training steps 2.6x slower:
    auto sets the order the rules judge by (DENSE_ORDER) around each CUDA call, among the kernels enabled, and
    leaves a CPU's alone."""
    default = torch._C._get_sdp_priority_order()
    with sdpa_backend("auto", "cuda"):
        on_cuda = torch._C._get_sdp_priority_order()
    with sdpa_backend("auto", "cpu"):
        on_cpu = torch._C._get_sdp_priority_order()
    assert (
        tuple(KERNEL_NAMES[i] for i in on_cuda if i in KERNEL_NAMES)
        == DENSE_ORDER
        == ("flash", "efficient", "cudnn", "math")
    )
    assert on_cpu == default == torch._C._get_sdp_priority_order()
    torch.backends.cuda.enable_cudnn_sdp(False)  # a user's choice, which auto keeps
    try:
        with sdpa_backend("auto", "cuda"):
            assert not torch.backends.cuda.cudnn_sdp_enabled() and torch.backends.cuda.flash_sdp_enabled()
    finally:
        torch.backends.cuda.enable_cudnn_sdp(True)


@pytest.mark.parametrize("padding_free", [False, True], ids=["padded", "padding-free"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_on_a_cpu_exactly_the_settings_that_fail_are_refused(backend, padding_free):
    """A CPU's kernels differ from a GPU's (its flash takes masks but no nested tensors; it has no efficient or cuDNN
    kernel): the check refuses what fails here and nothing that runs."""
    cfg, model, batch = model_and_batch(backend, padding_free)
    refused = refusal(cfg, model_runtime(model), "cpu", reduced=False)
    try:
        for phase in PHASES:  # not recorded: with this CPU's kernels as they are
            run_phase(model, batch, phase)
        failed = None
    except RuntimeError as e:
        failed = str(e)
    assert (refused is None) == (failed is None), (refused, failed)


def test_refusals_name_the_fix():
    cfg = ModelConfig.from_size("base", src_vocab_size=V, tgt_vocab_size=V, pad_id=0)
    messages = {
        "padding_free_attention=true": (RuntimeConfig(attention_backend="flash"), cfg, True),
        "trainer.precision=bf16-mixed": (RuntimeConfig(attention_backend="flash", padding_free_attention=True), cfg,
                                         False),
        "model.window=8": (RuntimeConfig(attention_backend="flash", padding_free_attention=True),
                           ModelConfig.from_size("base", src_vocab_size=V, tgt_vocab_size=V, pad_id=0, window=8), True),
        "use auto": (RuntimeConfig(attention_backend="cudnn"), cfg, True),
    }  # fmt: skip
    for fix, (runtime, model_cfg, bf16) in messages.items():
        assert fix in refusal(model_cfg, runtime, "cuda", bf16), fix
