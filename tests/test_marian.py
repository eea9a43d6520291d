"""A Marian (OPUS-MT) checkpoint in the Hugging Face format read into this project's model: a tiny MarianMTModel built
here with random weights (no download), saved with save_pretrained, read back through transformer.pretrained.marian,
gives the same teacher-forced logits as transformers in float32; what the model cannot represent is refused."""

import pytest
import torch

from transformer.model import build_model
from transformer.pretrained.marian import UnsupportedMarian, model_config, read_folder, state_dict

from .helpers.prerequisites import require_module

V, PAD, EOS = 50, 49, 0  # OPUS-MT's layout: </s> first, <pad> last, the decoder starting from <pad>
SETTINGS = dict(vocab_size=V, decoder_vocab_size=V, d_model=16, encoder_layers=2, decoder_layers=2,
                encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=32, decoder_ffn_dim=32,
                activation_function="swish", scale_embedding=True, pad_token_id=PAD, decoder_start_token_id=PAD,
                eos_token_id=EOS, max_position_embeddings=64)  # fmt: skip


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """(the folder save_pretrained wrote, the MarianMTModel): weights drawn wide (N(0, 0.5)), a non-zero output bias,
    the position table left as Marian builds it."""
    transformers = require_module("transformers", 'pip install -e ".[dev]"')
    torch.manual_seed(0)
    model = transformers.MarianMTModel(transformers.MarianConfig(**SETTINGS)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "embed_positions" not in name:
                p.normal_(0, 0.5)
        model.final_logits_bias.normal_()
    folder = tmp_path_factory.mktemp("opus-mt-tiny")
    model.save_pretrained(folder)
    return folder, model


def test_teacher_forced_logits_equal_transformers_in_float32(saved):
    folder, theirs = saved
    config, weights = read_folder(folder)
    cfg = model_config(config)
    ours = build_model(cfg).eval()
    ours.load_state_dict(state_dict(weights, cfg))  # strict: every weight placed, none left over
    src = torch.randint(1, PAD, (4, 9))  # right-padded sources ending with </s>, of different lengths
    for row, length in enumerate((9, 6, 3, 8)):
        src[row, length - 1], src[row, length:] = EOS, PAD
    tgt = torch.randint(1, PAD, (4, 7))
    tgt[:, 0] = PAD  # the decoder's start
    with torch.no_grad():
        want = theirs(input_ids=src, attention_mask=src.ne(PAD), decoder_input_ids=tgt).logits
        got = ours(src, tgt)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    "change, field",
    [({"decoder_ffn_dim": 64}, "encoder_ffn_dim=32 but decoder_ffn_dim=64"),
     ({"decoder_attention_heads": 2}, "encoder_attention_heads=4 but decoder_attention_heads=2"),
     ({"scale_embedding": False}, "scale_embedding=false"), ({"activation_function": "tanh"}, "activation_function='tanh'"),
     ({"normalize_before": True}, "normalize_before=true")],
)  # fmt: skip
def test_what_the_model_cannot_represent_is_refused_in_one_line_naming_the_field(change, field):
    with pytest.raises(UnsupportedMarian) as refused:
        model_config({**SETTINGS, **change})
    assert str(refused.value).startswith(field) and "\n" not in str(refused.value)
