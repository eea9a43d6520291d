import pytest
import torch
import torch.nn.functional as F

from transformer.model import MODEL_SIZES, ModelConfig, MultiHeadAttention, RuntimeConfig, SequenceLayout, build_model
from transformer.model.loss import target_positions

PAD, V = 0, 23


def tiny(**overrides):
    torch.manual_seed(0)
    cfg = ModelConfig.from_size("tiny", **{"src_vocab_size": V, "tgt_vocab_size": V, "pad_id": PAD, **overrides})
    return build_model(cfg).eval()


def tokens(lengths, total, vocab=V):
    """Right-padded random token ids (B, total), none of them PAD inside a sentence."""
    x = torch.randint(1, vocab, (len(lengths), total))
    return x.masked_fill(torch.arange(total)[None, :] >= torch.tensor(lengths)[:, None], PAD)


VARIANTS = [
    {},
    {"norm_first": False},
    {"positions": "learned", "activation": "gelu"},
    {"share_embeddings": False, "tie_output": False, "tgt_vocab_size": 31},
    {"window": 2},
    {"norm_first": False, "activation": "swish", "output_bias": True, "positions": "sinusoidal_concat"},  # Marian's
]


@pytest.mark.parametrize("overrides", VARIANTS)
def test_cached_decoding_equals_full_forward(overrides):
    model = tiny(**overrides)
    src, tgt = tokens([6, 3, 5], 6), tokens([5, 5, 5], 5, vocab=model.output.out_features)
    full = model(src, tgt)
    assert full.shape == (3, 5, model.output.out_features)
    memory, src_padding = model.encode(src)
    cache = model.new_cache()
    steps = [model.decode(tgt[:, t : t + 1], memory, src_padding, cache) for t in range(5)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-5, atol=1e-5)


def test_source_padding_does_not_change_outputs():
    model = tiny()
    src, tgt = tokens([6, 3], 6), tokens([4, 4], 4)
    padded = torch.cat([src, torch.full((2, 5), PAD)], dim=1)
    torch.testing.assert_close(model(padded, tgt), model(src, tgt), rtol=1e-5, atol=1e-5)
    # and a sentence alone equals the same sentence padded inside a batch
    torch.testing.assert_close(model(src[1:, :3], tgt[1:]), model(src, tgt)[1:], rtol=1e-5, atol=1e-5)


def test_future_target_tokens_do_not_change_earlier_logits():
    model = tiny()
    src, tgt = tokens([5, 5], 5), tokens([6, 6], 6)
    changed = tgt.clone()
    changed[:, 4:] = (changed[:, 4:] % (V - 1)) + 1
    a, b = model(src, tgt), model(src, changed)
    torch.testing.assert_close(a[:, :4], b[:, :4])
    assert not torch.allclose(a[:, 4:], b[:, 4:])


def test_embeddings_shared_tied_and_scaled():
    model = tiny()
    assert model.src_embed.tokens is model.tgt_embed.tokens
    assert model.output.weight is model.tgt_embed.tokens.weight
    assert torch.all(model.tgt_embed.tokens.weight[PAD] == 0)
    untied = tiny(share_embeddings=False, tie_output=False)
    assert untied.src_embed.tokens is not untied.tgt_embed.tokens
    assert untied.output.weight is not untied.tgt_embed.tokens.weight
    d = model.src_embed.tokens.embedding_dim
    # sqrt(d) scaling: token part of the embedding has about unit variance
    ids = torch.arange(1, V)[None]
    scaled = model.src_embed(ids) - model.src_embed.positions[: V - 1]
    assert 0.5 < scaled.std().item() < 1.5
    assert model.src_embed.scale == pytest.approx(d**0.5)


@pytest.mark.parametrize("overrides", VARIANTS)
def test_a_model_built_from_weights_is_the_model_they_came_from(overrides, tmp_path):
    """build_model(cfg, weights=...) builds on the meta device and takes the tensors: the same logits, tied tables
    still one parameter, and the buffers no checkpoint holds (causal table, sinusoidal positions) computed."""
    model = tiny(**overrides)
    torch.save(model.state_dict(), tmp_path / "weights.pt")
    rebuilt = build_model(ModelConfig.from_size("tiny", **{"src_vocab_size": V, "tgt_vocab_size": V, "pad_id": PAD,
                                                           **overrides}),
                          weights=torch.load(tmp_path / "weights.pt", weights_only=True)).eval()  # fmt: skip
    src, tgt = tokens([5, 3], 6), tokens([4, 2], 5)
    with torch.no_grad():
        torch.testing.assert_close(rebuilt(src, tgt), model(src, tgt), rtol=0, atol=0)
    assert not any(t.is_meta for t in [*rebuilt.parameters(), *rebuilt.buffers()])
    for name, buffer in model.named_buffers():
        assert torch.equal(dict(rebuilt.named_buffers())[name], buffer), name
    assert (rebuilt.output.weight is rebuilt.tgt_embed.tokens.weight) == (model.output.weight is
                                                                          model.tgt_embed.tokens.weight)  # fmt: skip
    assert sum(p.numel() for p in rebuilt.parameters()) == sum(p.numel() for p in model.parameters())


def test_sinusoidal_positions_follow_the_paper():
    model = tiny()
    pe = model.src_embed.positions
    d = pe.size(1)
    pos, i = 7, 3
    assert pe[pos, 2 * i].item() == pytest.approx(torch.sin(torch.tensor(pos / 10000 ** (2 * i / d))).item(), abs=1e-6)
    assert pe[pos, 2 * i + 1].item() == pytest.approx(
        torch.cos(torch.tensor(pos / 10000 ** (2 * i / d))).item(), abs=1e-6
    )
    assert "src_embed.positions" not in model.state_dict()  # rebuilt from the config, not saved


def test_sinusoidal_concat_positions_are_marians():
    """Marian's table as Hugging Face's MarianSinusoidalPositionalEmbedding writes it: pos / 10000^(2 (j // 2) / d)
    for feature j, the sines of the even features in the first half, the cosines of the odd ones in the second."""
    pe = tiny(positions="sinusoidal_concat").src_embed.positions
    n, d = pe.shape
    angle = torch.tensor(
        [[pos / 10000 ** (2 * (j // 2) / d) for j in range(d)] for pos in range(n)], dtype=torch.float64
    )
    marian = torch.cat([torch.sin(angle[:, 0::2]), torch.cos(angle[:, 1::2])], dim=1).float()
    torch.testing.assert_close(pe, marian, rtol=0, atol=1e-5)


def test_swish_and_an_output_bias_are_what_they_say():
    model = tiny(activation="swish", output_bias=True)
    ff, x = model.encoder.layers[0].ff, torch.randn(2, 3, 32)
    torch.testing.assert_close(ff(x), ff.fc2(ff.fc1(x) * torch.sigmoid(ff.fc1(x))))
    assert model.output.bias is not None and not model.output.bias.any()  # zeros at first, as the other biases
    with torch.no_grad():
        model.output.bias.normal_()
        src, tgt = tokens([5, 3], 5), tokens([4, 2], 4)
        shifted = model(src, tgt) - model.output.bias  # (B, T, V): the logits less the bias
        model.output.bias.zero_()
        torch.testing.assert_close(shifted, model(src, tgt))


def test_attention_layers_are_state_dict_compatible_with_torch():
    model = tiny()
    for module in model.modules():
        if isinstance(module, MultiHeadAttention):
            ref = torch.nn.MultiheadAttention(module.embed_dim, module.num_heads, batch_first=True)
            ref.load_state_dict(module.state_dict())


def test_base_parameter_count_matches_the_paper():
    cfg = ModelConfig.from_size("base", src_vocab_size=37000, tgt_vocab_size=37000, pad_id=0)
    n = sum(p.numel() for p in build_model(cfg).parameters())
    assert 60e6 < n < 66e6  # the paper reports 65M for base with a shared 37k vocabulary


def test_named_sizes_and_config_errors():
    assert set(MODEL_SIZES) >= {"tiny", "small", "base", "big"}
    small = ModelConfig.from_size("small", src_vocab_size=8000, tgt_vocab_size=8000, pad_id=0)
    assert (small.d_model, small.n_encoder_layers, small.n_decoder_layers) == (256, 3, 3)
    with pytest.raises(ValueError, match="unknown model size 'huge'; choose one of tiny, small, base, big"):
        ModelConfig.from_size("huge", src_vocab_size=8, tgt_vocab_size=8, pad_id=0)
    with pytest.raises(ValueError, match="unknown model config field"):
        ModelConfig.from_size("tiny", src_vocab_size=8, tgt_vocab_size=8, pad_id=0, dmodel=3)
    with pytest.raises(ValueError, match="d_model=30 is not divisible by n_heads=4"):
        ModelConfig.from_size("tiny", src_vocab_size=8, tgt_vocab_size=8, pad_id=0, d_model=30)
    with pytest.raises(ValueError, match="share_embeddings needs one vocabulary"):
        ModelConfig.from_size("tiny", src_vocab_size=8, tgt_vocab_size=9, pad_id=0)
    with pytest.raises(ValueError, match="activation='tanh' is not one of relu, gelu, swish"):
        ModelConfig.from_size("tiny", src_vocab_size=8, tgt_vocab_size=8, pad_id=0, activation="tanh")
    with pytest.raises(ValueError, match="pad_id=8 is outside src_vocab_size=8"):
        ModelConfig.from_size("tiny", src_vocab_size=8, tgt_vocab_size=8, pad_id=8)


def test_too_long_input_names_max_positions():
    model = tiny(max_positions=8)
    with pytest.raises(ValueError, match="max_positions=8"):
        model(tokens([9], 9), tokens([3], 3))


@pytest.mark.parametrize("overrides", [{}, {"norm_first": False}])
def test_tiny_model_overfits_a_few_sentence_pairs(overrides):
    torch.manual_seed(0)
    cfg = ModelConfig.from_size("tiny", src_vocab_size=V, tgt_vocab_size=V, pad_id=PAD, dropout=0.0, **overrides)
    model = build_model(cfg).train()
    bos = 1
    src = tokens([7, 5, 6, 4], 7)
    tgt = torch.cat([torch.full((4, 1), bos), tokens([6, 4, 5, 3], 6)], dim=1)  # (B, 7): BOS + target
    tgt_in, tgt_out = tgt[:, :-1], tgt[:, 1:]
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)  # 100 steps reach a loss of 0.002 either way

    def loss_fn():
        logits = model(src, tgt_in)
        return F.cross_entropy(logits.reshape(-1, V), tgt_out.reshape(-1), ignore_index=PAD)

    first = loss_fn().item()
    for _ in range(100):
        opt.zero_grad()
        loss = loss_fn()
        loss.backward()
        opt.step()
    assert first > 2.0
    assert loss.item() < 0.05


@pytest.mark.parametrize("dropout", [0.0, 0.3])
def test_activation_checkpointing_gives_the_same_gradients(dropout):
    torch.manual_seed(0)
    cfg = ModelConfig.from_size("tiny", src_vocab_size=50, tgt_vocab_size=50, pad_id=0, dropout=dropout)
    plain = build_model(cfg)
    checkpointed = build_model(cfg, RuntimeConfig(activation_checkpointing=True))
    checkpointed.load_state_dict(plain.state_dict())
    src, tgt = torch.randint(1, 50, (3, 7)), torch.randint(1, 50, (3, 5))
    for model in (plain, checkpointed):
        torch.manual_seed(1)  # the recomputed forward must draw the same dropout masks
        model(src, tgt).square().mean().backward()
    for (name, p), q in zip(plain.named_parameters(), checkpointed.parameters()):
        torch.testing.assert_close(q.grad, p.grad, msg=name)
    assert checkpointed.encoder.checkpointed and checkpointed.decoder.checkpointed


def test_padding_free_attention_gives_the_same_logits_and_gradients():
    torch.manual_seed(0)
    cfg = ModelConfig.from_size("tiny", src_vocab_size=V, tgt_vocab_size=V, pad_id=PAD, dropout=0.0)
    padded = build_model(cfg)
    free = build_model(cfg, RuntimeConfig(padding_free_attention=True))
    free.load_state_dict(padded.state_dict())
    src, tgt = tokens([7, 2, 5], 7), tokens([4, 6, 3], 6)
    logits = []
    for model in (padded, free):
        logits.append(model(src, tgt))
        logits[-1].masked_fill(tgt[..., None].eq(PAD), 0).square().mean().backward()
    torch.testing.assert_close(logits[1], logits[0], rtol=1e-5, atol=1e-5)
    for (name, p), q in zip(padded.named_parameters(), free.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-5, atol=1e-6, msg=name)
    assert all(m.padding_free for m in free.modules() if isinstance(m, MultiHeadAttention))


def test_loss_from_logits_at_real_tokens_equals_the_loss_over_all_positions():
    """The training loss computes logits only where the target is not padding; the loss and every gradient
    must equal cross-entropy over all positions with padding ignored."""
    model = tiny(share_embeddings=False, tie_output=False, tgt_vocab_size=31, output_bias=True).train()
    with torch.no_grad():
        model.output.bias.normal_()  # the fused loss's bias and its gradient too
    src, tgt = tokens([7, 2, 5], 7), tokens([4, 6, 3], 6, vocab=31)
    tgt_in, tgt_out = tgt[:, :-1], tgt[:, 1:]
    grads = []
    for reference in (True, False):
        model.zero_grad()
        torch.manual_seed(2)  # same dropout masks
        if reference:
            logits = model(src, tgt_in).flatten(0, 1)  # (B*T, V)
            loss = F.cross_entropy(logits, tgt_out.flatten(), ignore_index=PAD, label_smoothing=0.1, reduction="sum")
            tokens_counted = tgt_out.ne(PAD).sum()
        else:
            where = target_positions(tgt_out, PAD)  # (N,) the real target tokens' flat positions
            loss = model.loss(src, tgt_in, tgt_out.flatten()[where], where=where, label_smoothing=0.1)
            tokens_counted = where.numel()
        (loss / tokens_counted).backward()
        grads.append((loss.detach(), int(tokens_counted), [p.grad.clone() for p in model.parameters()]))
    (ref_loss, ref_tokens, ref_grads), (loss, n, got) = grads
    assert n == ref_tokens == 4 + 6 + 3 - 3  # targets are tgt[:, 1:]
    torch.testing.assert_close(loss, ref_loss)
    for (name, _), g, r in zip(model.named_parameters(), got, ref_grads):
        torch.testing.assert_close(g, r, msg=name)


def test_runtime_is_apart_from_the_architecture():
    """Old checkpoints saved attention_backend & co. with the model: they still load, and any runtime runs any
    checkpoint with the same outputs."""
    cfg = ModelConfig.from_size("tiny", src_vocab_size=V, tgt_vocab_size=V, pad_id=PAD, dropout=0.0)
    saved = {
        **vars(cfg),
        "attention_backend": "flash",
        "padding_free_attention": True,
        "activation_checkpointing": True,
    }
    assert ModelConfig.from_dict(saved) == cfg
    src, tgt = tokens([7, 2, 5], 7), tokens([4, 6, 3], 6)
    trained = tiny(dropout=0.0)
    expected = trained(src, tgt)
    for runtime in (RuntimeConfig(attention_backend="math"), RuntimeConfig(padding_free_attention=True)):
        other = build_model(ModelConfig.from_dict(saved), runtime).eval()
        other.load_state_dict(trained.state_dict())
        torch.testing.assert_close(other(src, tgt), expected, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="attention_backend='fast' is not one of auto, flash"):
        RuntimeConfig(attention_backend="fast")
    with pytest.raises(ValueError, match="runtime.activation_checkpointing='yes' must be one of: bool"):
        RuntimeConfig(activation_checkpointing="yes")


@pytest.mark.parametrize("padding_free", [False, True])
def test_collator_layout_gives_the_same_logits_as_one_derived_from_the_tokens(padding_free):
    """Training describes the source padding from the collator's host values (no sync); decoding derives it."""
    model = build_model(ModelConfig.from_size("tiny", src_vocab_size=V, tgt_vocab_size=V, pad_id=PAD),
                        RuntimeConfig(padding_free_attention=padding_free)).eval()  # fmt: skip
    lengths = [7, 2, 5]
    src, tgt = tokens(lengths, 7), tokens([4, 6, 3], 6)
    layout = SequenceLayout.right_padded(torch.tensor(lengths), 7, padded=True, tokens=sum(lengths),
                                         packed=padding_free)  # fmt: skip
    real = tgt.ne(PAD)
    where = torch.nonzero_static(real.flatten(), size=int(real.sum())).squeeze(1)
    torch.testing.assert_close(model(src, tgt, where=where, src_layout=layout), model(src, tgt)[real])


def test_a_source_of_padding_only_gives_finite_logits():
    model = tiny()
    src, tgt = tokens([5, 0], 5), tokens([3, 3], 3)  # the second source has no token: no key to attend to
    logits = model(src, tgt)
    assert torch.isfinite(logits).all()
    torch.testing.assert_close(logits[:1], model(src[:1], tgt[:1]))
