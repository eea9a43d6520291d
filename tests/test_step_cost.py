"""bench_mfu.py's FLOP count (tools/step_cost.py) on batches whose count is known: an unpadded batch's FLOPs equal
the GPU check's analytic formula (tools/common/gpu.py) plus what the kernels compute beyond it: the causal half, and
the flash kernel's backward recomputing the scores."""

import copy

import numpy as np
import pytest
import torch

from common.gpu import training_flops
from step_cost import step_flops
from transformer.data.batching import Collate
from transformer.model import ModelConfig, build_model
from transformer.model.compiling import compile_dynamic

V = 53


def unpadded_batch(sentences: int, src_len: int, tgt_len: int) -> dict:
    rng = np.random.default_rng(0)
    examples = [(rng.integers(3, V, src_len).astype(np.int32), rng.integers(3, V, tgt_len).astype(np.int32), i)
                for i in range(sentences)]  # fmt: skip
    return Collate(pad_id=0, bos_id=1, eos_id=2)(examples)


@pytest.mark.parametrize("precision", ["bf16", "32"])  # explicit attention (bmm), and the CPU's flash kernel
def test_an_unpadded_batch_counts_the_analytic_flops_and_the_causal_half(precision):
    cfg = ModelConfig(src_vocab_size=V, tgt_vocab_size=V, pad_id=0, d_model=32, n_heads=4, d_ff=64,
                      n_encoder_layers=2, n_decoder_layers=3, dropout=0.0)  # fmt: skip
    model = build_model(cfg).train()
    batch = unpadded_batch(sentences=3, src_len=6, tgt_len=4)
    B, S, T = 3, 7, 5  # with EOS
    assert batch["src"].shape == (B, S) and batch["tgt_out"].shape == (B, T) and not batch["src_padded"]

    def autocast():
        return torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16")

    counted = step_flops(model, [batch], label_smoothing=0.1, context=autocast)
    analytic = training_flops(cfg, B * S, B * T, B * S * S, B * T * T, B * S * T)
    causal_half = 6 * cfg.n_decoder_layers * B * T * T * cfg.d_model  # computed, masked, left out of "model FLOPs"
    scores = 2 * cfg.d_model * B * (cfg.n_encoder_layers * S * S + cfg.n_decoder_layers * (T * T + T * S))  # QK^T
    recomputed = scores if precision == "32" else 0  # the CPU's flash backward, counted as FlopCounterMode counts GPUs'
    assert counted == analytic + causal_half + recomputed
    assert all(p.grad is None for p in model.parameters())


def test_two_batches_count_the_sum_of_each():
    cfg = ModelConfig(src_vocab_size=V, tgt_vocab_size=V, pad_id=0, d_model=32, n_heads=4, d_ff=64,
                      n_encoder_layers=1, n_decoder_layers=1, dropout=0.0)  # fmt: skip
    model = build_model(cfg).train()
    first, second = unpadded_batch(2, 5, 3), unpadded_batch(4, 3, 8)
    each = step_flops(model, [first], 0.1) + step_flops(model, [second], 0.1)
    assert step_flops(model, [first, second], 0.1) == each


def test_a_compiled_model_counts_the_flops_of_its_eager_ops():
    """Under FlopCounterMode (a dispatch mode) a compiled model runs eagerly: bench_mfu's compiled rows count model
    FLOPs, the same as eager's, not inductor's kernels'."""
    cfg = ModelConfig(src_vocab_size=V, tgt_vocab_size=V, pad_id=0, d_model=32, n_heads=4, d_ff=64,
                      n_encoder_layers=1, n_decoder_layers=1, dropout=0.0)  # fmt: skip
    eager = build_model(cfg).train()
    compiled = copy.deepcopy(eager)
    torch._dynamo.reset()
    compile_dynamic(compiled, backend="aot_eager")
    batch = unpadded_batch(2, 5, 3)
    assert step_flops(compiled, [batch], 0.1) == step_flops(eager, [batch], 0.1)
