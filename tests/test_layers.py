"""Encoder and decoder layers against torch.nn.TransformerEncoderLayer / TransformerDecoderLayer, and the CPU dropout."""

import pytest
import torch
from torch import nn

from transformer.model import ModelConfig, SequenceLayout, masks
from transformer.model.dropout import Dropout
from transformer.model.layers import DecoderLayer, EncoderLayer

# our parameter names -> torch's
ENCODER_NAMES = {"ff.fc1": "linear1", "ff.fc2": "linear2", "attn_block.norm": "norm1", "ff_block.norm": "norm2"}
DECODER_NAMES = {
    "cross_attn": "multihead_attn", "ff.fc1": "linear1", "ff.fc2": "linear2",
    "self_attn_block.norm": "norm1", "cross_attn_block.norm": "norm2", "ff_block.norm": "norm3",
}  # fmt: skip


def copy_into(ref: nn.Module, ours: nn.Module, names: dict[str, str]) -> None:
    state = {}
    for key, value in ours.state_dict().items():
        for mine, theirs in names.items():
            if key.startswith(mine + "."):
                key = theirs + key[len(mine) :]
        state[key] = value
    ref.load_state_dict(state)


def randomise(module: nn.Module) -> None:
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0, 0.3)


def config(norm_first: bool, activation: str) -> ModelConfig:
    return ModelConfig.from_size(
        "tiny", src_vocab_size=10, tgt_vocab_size=10, pad_id=0, norm_first=norm_first, activation=activation
    )


@pytest.mark.parametrize("norm_first", [True, False])
@pytest.mark.parametrize("activation", ["relu", "gelu"])
def test_encoder_layer_matches_torch(norm_first, activation):
    cfg = config(norm_first, activation)
    ours = EncoderLayer(cfg).eval()
    randomise(ours)
    ref = nn.TransformerEncoderLayer(
        cfg.d_model, cfg.n_heads, cfg.d_ff, dropout=0.0, activation=activation, batch_first=True, norm_first=norm_first
    ).eval()
    copy_into(ref, ours, ENCODER_NAMES)
    x = torch.randn(3, 6, cfg.d_model)
    padding = torch.arange(6)[None, :] >= torch.tensor([6, 2, 4])[:, None]
    expected = ref(x, src_key_padding_mask=padding)
    got = ours(x, masks.key_padding(SequenceLayout.from_padding(padding), self_attention=True))
    real = ~padding  # torch's fast path may leave padded positions as zeros
    torch.testing.assert_close(got[real], expected[real], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("norm_first", [True, False])
def test_decoder_layer_matches_torch(norm_first):
    cfg = config(norm_first, "relu")
    ours = DecoderLayer(cfg).eval()
    randomise(ours)
    ref = nn.TransformerDecoderLayer(
        cfg.d_model, cfg.n_heads, cfg.d_ff, dropout=0.0, batch_first=True, norm_first=norm_first
    ).eval()
    copy_into(ref, ours, DECODER_NAMES)
    x, memory = torch.randn(2, 5, cfg.d_model), torch.randn(2, 7, cfg.d_model)
    src_padding = torch.arange(7)[None, :] >= torch.tensor([7, 3])[:, None]
    causal = nn.Transformer.generate_square_subsequent_mask(5)
    expected = ref(x, memory, tgt_mask=causal, tgt_is_causal=True, memory_key_padding_mask=src_padding)
    attention = (
        masks.causal(5, 5, None, masks.future_table(5)),
        masks.key_padding(SequenceLayout.from_padding(src_padding)),
    )
    torch.testing.assert_close(ours(x, memory, *attention), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_dropout_keeps_each_element_with_probability_1_minus_p_and_scales_by_its_inverse(dtype):
    p = 0.3
    x = torch.rand(200, 1000, dtype=dtype).add_(0.5).requires_grad_()  # no zeros, so zeros in y are dropped ones
    torch.manual_seed(0)
    y = Dropout(p).train()(x)
    kept = y.ne(0)
    n, rate = kept.numel(), kept.float().mean().item()
    assert abs(rate - (1 - p)) < 5 * (p * (1 - p) / n) ** 0.5  # 5 standard deviations
    assert kept.float().mean(0).std() < 0.05 and kept.float().mean(1).std() < 0.05  # no row or column bias
    scale = 32768 / (32768 - round(p * 32768))
    torch.testing.assert_close(y[kept], (x * scale).to(dtype)[kept])
    y.backward(torch.ones_like(y))
    torch.testing.assert_close(x.grad, kept.to(dtype) * scale)
    torch.manual_seed(0)
    assert torch.equal(Dropout(p).train()(x), y)  # the global generator: seeds and resumed RNG states hold


def test_cpu_dropout_is_identity_in_eval_and_at_p_0_and_falls_back_where_p_cannot_be_represented():
    x = torch.randn(64, 64)
    assert Dropout(0.3).eval()(x) is x and Dropout(0.0).train()(x) is x
    assert Dropout(1.0).train()(x).eq(0).all()
    tiny_p = Dropout(1e-6).train()(torch.ones(10, 10))  # rounds to 0 steps of 1/32768: torch's own dropout
    assert tiny_p.min() > 0.99
