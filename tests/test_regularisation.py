"""Training regularisers: R-Drop (optim.rdrop_alpha) and word dropout (model.token_dropout)."""

import pytest
import torch
from torch.distributions import Categorical, kl_divergence

from transformer.data.batching import Collate
from transformer.model import ModelConfig, build_model
from transformer.model.loss import batch_loss_sum, rdrop_loss, target_logits

from .helpers import RECORD, LossRecorder, callback, run_train, tiny_data, write_text_corpus

PAD, BOS, EOS, V = 0, 2, 3, 29


def tiny(**overrides):
    torch.manual_seed(0)
    cfg = ModelConfig.from_size("tiny", src_vocab_size=V, tgt_vocab_size=V, pad_id=PAD, **overrides)
    return build_model(cfg).train()


def batch() -> dict:
    g = torch.Generator().manual_seed(1)
    pairs = [(torch.randint(4, V, (n,), generator=g).numpy(), torch.randint(4, V, (m,), generator=g).numpy(), i)
             for i, (n, m) in enumerate([(5, 7), (3, 2), (6, 4)])]  # fmt: skip
    return Collate(PAD, BOS, EOS)(pairs)


def test_rdrop_loss_is_the_mean_cross_entropy_plus_the_symmetric_kl():
    g = torch.Generator().manual_seed(0)
    logits, targets = torch.randn(10, V, generator=g), torch.randint(0, V, (5,), generator=g)
    one, two = Categorical(logits=logits[:5]), Categorical(logits=logits[5:])
    kl = (kl_divergence(one, two) + kl_divergence(two, one)).sum()
    ce = -(one.log_prob(targets) + two.log_prob(targets)).sum()
    torch.testing.assert_close(rdrop_loss(logits, targets, 0.0, 3.0), ce / 2 + 3.0 / 4 * kl)


def test_rdrop_adds_the_kl_between_two_dropout_masks_and_nothing_without_dropout():
    b = batch()
    plain = tiny(dropout=0.0)
    torch.testing.assert_close(batch_loss_sum(plain, b, 0.1, rdrop_alpha=5.0)[0], batch_loss_sum(plain, b, 0.1)[0])

    model = tiny(dropout=0.3)
    losses, grads = {}, {}
    for alpha in (0.0, 2.0):
        model.zero_grad()
        torch.manual_seed(3)  # the same two dropout masks
        losses[alpha], tokens = batch_loss_sum(model, b, 0.1, rdrop_alpha=alpha)
        losses[alpha].backward()
        grads[alpha] = model.output.weight.grad.clone()
    assert int(tokens) == b["tgt_tokens"]
    torch.manual_seed(3)
    doubled = {k: b[k].repeat(2, 1) for k in ("src", "tgt_in", "tgt_out")}
    logits, _ = target_logits(model, doubled["src"], doubled["tgt_in"], doubled["tgt_out"])
    n = b["tgt_tokens"]
    one, two = Categorical(logits=logits[:n].detach()), Categorical(logits=logits[n:].detach())
    kl = (kl_divergence(one, two) + kl_divergence(two, one)).sum()
    assert kl > 0  # the two passes saw different masks
    torch.testing.assert_close(losses[2.0] - losses[0.0], 2.0 / 4 * kl, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(grads[2.0], grads[0.0])  # the KL term is trained through


def test_token_dropout_drops_whole_token_embeddings_in_training_only():
    model = tiny(dropout=0.0, token_dropout=0.5)
    embed = model.src_embed
    tokens = torch.randint(4, V, (4, 50))
    positions = embed.positions[:50]
    token_part = embed(tokens) - positions  # (B, T, d)
    full = embed.tokens(tokens) * embed.scale
    dropped = token_part.abs().sum(-1) == 0  # (B, T)
    assert 0.3 < dropped.float().mean() < 0.7
    torch.testing.assert_close(token_part[~dropped], 2 * full[~dropped])  # the rest scaled by 1 / (1 - p)
    model.eval()
    torch.testing.assert_close(embed(tokens) - positions, full)


@pytest.mark.slow  # three small training runs
def test_training_applies_rdrop_and_token_dropout(tmp_path):
    write_text_corpus(tmp_path / "c")
    common = [*tiny_data(tmp_path / "c", tmp_path / "cache"), *RECORD, "model=tiny", "trainer.precision=32",
              "~logger", "trainer.max_steps=3", "trainer.limit_val_batches=0", "trainer.enable_progress_bar=false"]  # fmt: skip
    runs = {name: callback(run_train(tmp_path / name, [*common, *extra]), LossRecorder).losses
            for name, extra in (("plain", []), ("rdrop", ["optim.rdrop_alpha=5"]),
                                ("token_dropout", ["model.token_dropout=0.2"]))}  # fmt: skip
    assert runs["rdrop"][1] != runs["plain"][1] and runs["token_dropout"][1] != runs["plain"][1]
