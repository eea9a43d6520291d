"""Training regularisers: R-Drop (optim.rdrop_alpha), word dropout (model.token_dropout) and BPE-dropout."""

import warnings
from unittest import mock

import pytest
import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from torch.distributions import Categorical, kl_divergence

from transformer.data import TranslationDataModule
from transformer.data.batching import Collate
from transformer.model import ModelConfig, build_model
from transformer.model import cross_entropy as fused
from transformer.model.loss import batch_loss_sum, target_logits

from .helpers import callback, config, run_train, tiny_data, write_text_corpus

PAD, BOS, EOS, V = 0, 2, 3, 29


def tiny(**overrides):
    torch.manual_seed(0)
    cfg = ModelConfig.from_size("tiny", src_vocab_size=V, tgt_vocab_size=V, pad_id=PAD, **overrides)
    return build_model(cfg).train()


def batch(length_rungs: int | None = None) -> dict:
    g = torch.Generator().manual_seed(1)
    pairs = [(torch.randint(4, V, (n,), generator=g).numpy(), torch.randint(4, V, (m,), generator=g).numpy(), i)
             for i, (n, m) in enumerate([(5, 7), (3, 2), (6, 4)])]  # fmt: skip
    return Collate(PAD, BOS, EOS, length_rungs)(pairs)


def rdrop_reference(logits: torch.Tensor, labels: torch.Tensor, smoothing: float, alpha: float, ignore_index: int):
    """R-Drop's loss from torch.distributions: the mean of two passes' label-smoothed cross-entropies plus alpha / 4 x
    their symmetric KL divergence, summed over the labelled pairs of rows (pass one's rows first)."""
    n, keep = len(labels), labels != ignore_index
    one, two = Categorical(logits=logits[:n][keep]), Categorical(logits=logits[n:][keep])
    y = labels[keep]

    def smoothed(p: Categorical) -> torch.Tensor:
        return ((1 - smoothing) * -p.log_prob(y) - smoothing * p.logits.mean(-1)).sum()  # logits: normalised

    return (smoothed(one) + smoothed(two)) / 2 + alpha / 4 * (kl_divergence(one, two) + kl_divergence(two, one)).sum()


@pytest.mark.parametrize("kernel", ["compiled", "eager"])
@pytest.mark.parametrize("chunk_rows", [None, 7], ids=["one-chunk", "chunked"])
@pytest.mark.parametrize(("bias", "ignore_index"), [(True, PAD), (False, -100)], ids=["bias-pad", "minus-100"])
def test_the_fused_rdrop_loss_equals_the_reference_in_float64(monkeypatch, bias, ignore_index, chunk_rows, kernel):
    """The output layer and R-Drop's loss in one piece: the value and the gradients in x, weight and bias of
    torch.distributions' formulation, rows labelled ignore_index counting for nothing in either pass."""
    torch.manual_seed(0)
    n, d, vocab = 25, 16, 37
    monkeypatch.setattr(fused, "eager_only", kernel == "eager")
    if chunk_rows:
        monkeypatch.setattr(fused, "CHUNK_ELEMENTS", 2 * chunk_rows * vocab)  # pairs of rows
    x = torch.randn(2 * n, d, dtype=torch.float64, requires_grad=True)
    w = torch.randn(vocab, d, dtype=torch.float64, requires_grad=True)
    b = torch.randn(vocab, dtype=torch.float64, requires_grad=True) if bias else None
    params = (x, w) if b is None else (x, w, b)
    labels = torch.randint(0, vocab, (n,))
    labels[::6] = ignore_index
    compiled = mock.Mock(wraps=fused._compiled_kernel)
    monkeypatch.setattr(fused, "_compiled_kernel", compiled)
    want = rdrop_reference(F.linear(x, w, b), labels, 0.1, 3.0, ignore_index)
    got = fused.linear_cross_entropy(x, w, labels, 0.1, ignore_index, b, rdrop_alpha=3.0)
    torch.testing.assert_close(got, want)
    for g, h in zip(torch.autograd.grad(2.5 * got, params), torch.autograd.grad(2.5 * want, params)):
        torch.testing.assert_close(g, h)
    calls = 0 if kernel == "eager" else 4 if chunk_rows else 1
    assert compiled.call_args_list == calls * [mock.call(fused.rdrop_logit_loss_and_grad)]
    with pytest.raises(ValueError, match="x has 50 rows for 24 labels: the loss needs two rows a label"):
        fused.linear_cross_entropy(x, w, labels[1:], 0.1, ignore_index, b, rdrop_alpha=3.0)


def test_float16_rdrop_is_differentiated_by_autograd_from_float32_logits():
    """float16's gradient in the logits would flush to zero in the fused piece (as the cross-entropy's): the formula
    runs on float32 copies of float16 logits and autograd differentiates it."""
    torch.manual_seed(0)
    n, d, vocab = 6, 8, 11
    x, w = torch.randn(2 * n, d).half().requires_grad_(), torch.randn(vocab, d).half().requires_grad_()
    labels = torch.randint(1, vocab, (n,))
    with mock.patch.object(fused._LinearCrossEntropy, "apply", side_effect=AssertionError("fused")):
        got = fused.linear_cross_entropy(x, w, labels, 0.1, PAD, rdrop_alpha=3.0)
    want = rdrop_reference(F.linear(x, w).float(), labels, 0.1, 3.0, PAD)
    torch.testing.assert_close(got, want)
    for g, h in zip(torch.autograd.grad(got, (x, w)), torch.autograd.grad(want, (x, w))):
        assert g.dtype == torch.float16
        torch.testing.assert_close(g, h)


def test_rdrop_adds_the_kl_between_two_dropout_masks_and_nothing_without_dropout():
    b = batch()
    plain = tiny(dropout=0.0)
    torch.testing.assert_close(batch_loss_sum(plain, b, 0.1, rdrop_alpha=5.0)[0], batch_loss_sum(plain, b, 0.1)[0])
    rungs = batch(length_rungs=4)  # padded to a rung, the loss asked at every position: pad labels count for nothing
    assert rungs["tgt_positions"].numel() > rungs["tgt_tokens"]
    torch.testing.assert_close(batch_loss_sum(plain, rungs, 0.1, rdrop_alpha=5.0)[0], batch_loss_sum(plain, b, 0.1)[0])

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


class FirstStep(pl.Callback):
    """What the first optimizer step starts from (the weights, the random state, the batch), and the loss it logs."""

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        if trainer.global_step == 0:
            self.weights = {name: value.clone() for name, value in module.model.state_dict().items()}
            self.rng, self.batch = torch.get_rng_state(), batch

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if trainer.global_step == 1:
            self.logged = module.ledger.readout.loss  # train/loss


@pytest.mark.slow  # a training run
def test_training_applies_rdrop_and_token_dropout(tmp_path):
    """The first step's logged loss is R-Drop's, recomputed here from the same weights, batch and random state: the
    mean label-smoothed cross-entropy of two passes plus alpha / 4 x their symmetric KL divergence, each pass with
    word dropout (model.token_dropout) as well as dropout."""
    write_text_corpus(tmp_path / "c")
    trainer = run_train(tmp_path / "run", [
        *tiny_data(tmp_path / "c", tmp_path / "cache"), "model=tiny", "trainer.precision=32-true", "~logger",
        "trainer.max_steps=1", "trainer.limit_val_batches=0", "trainer.enable_progress_bar=false",
        "trainer.log_every_n_steps=1",  # the step's loss is read from the device at once
        "optim.label_smoothing=0.1", "optim.rdrop_alpha=5", "model.token_dropout=0.2",
        f"+callbacks.first._target_={__name__}.FirstStep",
    ])  # fmt: skip
    first = callback(trainer, FirstStep)
    model_config = trainer.lightning_module.hparams["model"]

    def loss_per_token(token_dropout: float, alpha: float) -> float:
        model = build_model(ModelConfig.from_dict({**model_config, "token_dropout": token_dropout})).train()
        model.load_state_dict(first.weights)
        torch.set_rng_state(first.rng)
        b, n = first.batch, first.batch["tgt_tokens"]
        doubled = {k: b[k].repeat(2, 1) for k in ("src", "tgt_in", "tgt_out")}  # both passes in one, as trained
        with torch.no_grad():
            logits, targets = target_logits(model, doubled["src"], doubled["tgt_in"], doubled["tgt_out"])
        ce = torch.nn.functional.cross_entropy(logits, targets, label_smoothing=0.1, reduction="sum") / 2
        one, two = Categorical(logits=logits[:n]), Categorical(logits=logits[n:])
        kl = (kl_divergence(one, two) + kl_divergence(two, one)).sum()
        return ((ce + alpha / 4 * kl) / n).item()

    expected = loss_per_token(0.2, 5.0)
    assert first.logged == pytest.approx(expected, rel=1e-5)
    for without in (loss_per_token(0.2, 0.0), loss_per_token(0.0, 5.0)):  # neither part too small to tell
        assert abs(without - expected) > 1e-3 * expected


def test_bpe_dropout_warns_that_a_resumed_run_segments_its_epochs_differently(tmp_path):
    """BPE-dropout draws from sentencepiece's unseeded generator; unigram sampling among the n best, seeded, does not
    warn."""
    write_text_corpus(tmp_path / "c", sizes={"train": 60, "val": 5, "test": 5})
    for tokenizer_type, warns in (("bpe", True), ("unigram", False)):
        overrides = {"tokenizer_type": tokenizer_type, "sampling_alpha": 0.1, "vocab_size": 320}
        data = TranslationDataModule(config(tmp_path / "c", tmp_path, **overrides))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            data.train_dataloader().dataset.lengths(0)
        said = [str(w.message) for w in caught if "a resumed run segments its epochs differently" in str(w.message)]
        assert len(said) == warns, (tokenizer_type, [str(w.message) for w in caught])
        assert not said or "BPE-dropout" in said[0]
