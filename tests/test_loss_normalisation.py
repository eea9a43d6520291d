"""The training loss is normalised per target token over the whole optimizer step (fairseq's way): gradient
accumulation gives the gradients of one batch holding all its micro-batches, not a mean of per-batch means."""

import numpy as np
import pytorch_lightning as pl
import torch

from transformer.data.batching import Collate
from transformer.model import ModelConfig
from transformer.model.loss import batch_loss_sum
from transformer.training import OptimConfig, TranslationModule

V = 29


class GradientRecorder(TranslationModule):
    """Keeps the gradients the optimizer steps on: normalised and clipped by configure_gradient_clipping."""

    def configure_gradient_clipping(self, *args, **kwargs) -> None:
        super().configure_gradient_clipping(*args, **kwargs)
        self.step_grads = [p.grad.clone() for p in self.parameters()]


def module() -> GradientRecorder:
    torch.manual_seed(0)
    model = ModelConfig.from_size("tiny", src_vocab_size=V, tgt_vocab_size=V, pad_id=0, dropout=0.0)
    return GradientRecorder(**TranslationModule.hyperparameters(model, OptimConfig()))


def step_gradients(batches: list[dict], accumulate: int) -> list[torch.Tensor]:
    recorder = module()
    trainer = pl.Trainer(max_steps=1, accumulate_grad_batches=accumulate, precision="32", accelerator="cpu",
                         devices=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, limit_val_batches=0)  # fmt: skip
    trainer.fit(recorder, torch.utils.data.DataLoader(batches, batch_size=None))
    return recorder.step_grads


def examples(n: int, seed: int) -> list[tuple[np.ndarray, np.ndarray, int]]:
    rng = np.random.default_rng(seed)
    return [(rng.integers(3, V, rng.integers(2, 12)).astype(np.int32),
             rng.integers(3, V, rng.integers(1, 12)).astype(np.int32), i) for i in range(n)]  # fmt: skip


def test_two_accumulated_micro_batches_give_the_gradients_of_one_batch_holding_both():
    collate = Collate(pad_id=0, bos_id=1, eos_id=2)
    first, second = examples(3, seed=0), examples(5, seed=1)  # different sizes: their means would weigh them wrongly
    assert collate(first)["tgt_tokens"] != collate(second)["tgt_tokens"]
    accumulated = step_gradients([collate(first), collate(second)], accumulate=2)
    together = step_gradients([collate(first + second)], accumulate=1)
    for (name, _), a, b in zip(module().named_parameters(), accumulated, together):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7, msg=name)


def test_one_batch_step_gets_the_gradients_of_its_loss_per_target_token():
    """A plain run (no accumulation, one device) steps on the same gradients as before the normalisation moved."""
    batch = Collate(pad_id=0, bos_id=1, eos_id=2)(examples(4, seed=2))
    got = step_gradients([batch], accumulate=1)
    reference = module().model
    total, tokens = batch_loss_sum(reference, batch, label_smoothing=0.1)
    (total / tokens).backward()
    for (name, p), g in zip(reference.named_parameters(), got):
        torch.testing.assert_close(g, p.grad, rtol=1e-5, atol=1e-7, msg=name)
