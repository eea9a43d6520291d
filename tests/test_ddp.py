"""DDP's promises, each checked against one process: validation gathered from both ranks scores what one process
scores; a step's gradients are normalised by both ranks' target tokens; in-memory ranks train disjoint batches that
make up the epoch. Two gloo ranks on the CPU, forked as torchrun starts them (tests/helpers/ranks.py)."""

import json

import numpy as np
import pytest
import pytorch_lightning as pl
import torch
from omegaconf import OmegaConf

from transformer.data import DataConfig, TranslationDataModule
from transformer.data.batching import Collate
from transformer.model import ModelConfig
from transformer.model.loss import batch_loss_sum
from transformer.training import OptimConfig, TranslationModule
from transformer.training.checkpoint import RunFolderLock
from transformer.training.errors import TrainingError
from transformer.training.initial import check_run_folder_free
from transformer.training.strategy import training_strategy

from .helpers import run_train, tiny_data
from .helpers.ranks import run_ranks

V = 29  # the vocabulary of the gradient test's made-up batches


def ddp() -> dict:
    """The Trainer arguments of 2 CPU ranks, as trainer=ddp trainer.devices=2 gives them."""
    return {"strategy": training_strategy("ddp", 2, accelerator="cpu"), "devices": 2}


def trainer(**arguments) -> pl.Trainer:
    return pl.Trainer(accelerator="cpu", precision="32-true", logger=False, enable_progress_bar=False,
                      enable_model_summary=False, use_distributed_sampler=False, **arguments)  # fmt: skip


# --- validation -----------------------------------------------------------------------------------


def validate(checkpoint, **arguments) -> dict:
    """val/* of a checkpoint's model on its run's dev set, and how many batches this process validated."""
    data = TranslationDataModule(DataConfig.from_dict(torch.load(checkpoint, weights_only=True)["data"]))
    validator = trainer(**arguments)
    validator.validate(TranslationModule.load_from_checkpoint(checkpoint), datamodule=data, verbose=False)
    return {"batches": sum(validator.num_val_batches), **{k: v.item() for k, v in validator.callback_metrics.items()}}


def _validate_in_rank(rank: int, checkpoint, folder) -> None:
    (folder / f"rank{rank}.json").write_text(json.dumps(validate(checkpoint, **ddp())))


def test_validation_over_two_ranks_scores_what_one_process_scores(trained, tmp_path):
    """Each rank decodes its share of the dev set's batches; BLEU, chrF and the loss gathered from both are one
    process's over all of them (a rank scoring its own share alone would differ: the model's BLEU is not 100)."""
    checkpoint = trained[2]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each rank runs: the same kernels, so the same translations bit for bit
    try:
        alone = validate(checkpoint)
    finally:
        torch.set_num_threads(threads)
    assert 0 < alone["val/bleu"] < 100 and alone["batches"] >= 2
    run_ranks(_validate_in_rank, checkpoint, tmp_path)
    ranks = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    assert all(r["batches"] > 0 for r in ranks) and sum(r["batches"] for r in ranks) == alone["batches"]
    for rank, found in enumerate(ranks):
        assert (found["val/bleu"], found["val/chrf"]) == (alone["val/bleu"], alone["val/chrf"]), rank
        assert found["val/loss"] == pytest.approx(alone["val/loss"], rel=1e-6), rank


# --- the loss's normalisation ---------------------------------------------------------------------


class GradientRecorder(TranslationModule):
    """Keeps the gradients the optimizer steps on: normalised (and clipped) by configure_gradient_clipping."""

    def configure_gradient_clipping(self, *args, **kwargs) -> None:
        super().configure_gradient_clipping(*args, **kwargs)
        self.step_grads = {name: p.grad.clone() for name, p in self.named_parameters()}


def module(cls=TranslationModule) -> TranslationModule:
    torch.manual_seed(0)
    model = ModelConfig.from_size("tiny", src_vocab_size=V, tgt_vocab_size=V, pad_id=0, dropout=0.0)
    return cls(**TranslationModule.hyperparameters(model, OptimConfig()))


def batch(n: int, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    examples = [(rng.integers(3, V, rng.integers(2, 12)).astype(np.int32),
                 rng.integers(3, V, rng.integers(1, 12)).astype(np.int32), i) for i in range(n)]  # fmt: skip
    return Collate(pad_id=0, bos_id=1, eos_id=2)(examples)


def _step_in_rank(rank: int, batches: list[dict], folder) -> None:
    recorder = module(GradientRecorder)
    trainer(max_steps=1, limit_val_batches=0, enable_checkpointing=False, **ddp()).fit(
        recorder, torch.utils.data.DataLoader([batches[rank]], batch_size=None)
    )
    torch.save(recorder.step_grads, folder / f"grads.rank{rank}.pt")


def test_two_ranks_step_on_the_loss_per_target_token_of_both_batches(tmp_path):
    """Rank 0 trains on 3 pairs, rank 1 on 5, with different numbers of target tokens: both step on the gradients of
    the two batches' summed loss over all their target tokens, not the mean of each rank's loss per its own."""
    batches = [batch(3, seed=0), batch(5, seed=1)]
    tokens = [b["tgt_tokens"] for b in batches]
    assert tokens[0] != tokens[1]
    reference = module()
    label_smoothing = reference.optim_config.label_smoothing
    total = sum(batch_loss_sum(reference.model, b, label_smoothing)[0] for b in batches)
    (total / sum(tokens)).backward()
    run_ranks(_step_in_rank, batches, tmp_path)
    for rank in (0, 1):
        got = torch.load(tmp_path / f"grads.rank{rank}.pt")
        for name, p in reference.named_parameters():
            torch.testing.assert_close(got[name], p.grad, rtol=1e-5, atol=1e-7, msg=f"rank {rank}: {name}")


# --- the data each rank trains on -----------------------------------------------------------------


def _train_in_rank(rank: int, overrides: list[str], folder) -> None:
    run_train(folder / "run", overrides)


def test_in_memory_ranks_train_disjoint_batches_that_make_up_the_epoch(trained, tmp_path):
    """One epoch on 2 ranks: each trains batches of the epoch's (as one process makes them), no pair on both ranks,
    and together every batch but the one an odd count leaves over (each rank steps as often as the other)."""
    corpus = trained[0]
    overrides = [*tiny_data(corpus / "c", corpus / "cache"), "data.vocab_size=320", "data.max_tokens=101",
                 "model=tiny", "trainer=ddp", "trainer.accelerator=cpu", "trainer.devices=2", "trainer.precision=32",
                 "trainer.max_epochs=1", "trainer.limit_val_batches=0", "trainer.num_sanity_val_steps=0", "~logger",
                 "trainer.enable_progress_bar=false", "+callbacks.recorder._target_=tests.helpers.runs.LossFile",
                 f"+callbacks.recorder.folder={tmp_path}"]  # fmt: skip
    run_ranks(_train_in_rank, overrides, tmp_path)
    trained_by = [json.loads((tmp_path / f"losses.rank{rank}.json").read_text())["batches"] for rank in (0, 1)]
    ranks = [[tuple(sorted(b)) for b in batches.values()] for batches in trained_by]
    checkpoint = torch.load(tmp_path / "run" / "checkpoints" / "last.ckpt", weights_only=True)
    data = TranslationDataModule(DataConfig.from_dict(checkpoint["data"]))  # the run's data, in one process
    epoch = [tuple(sorted(b)) for b in data.train_dataloader().batch_sampler]
    assert len(epoch) >= 4 and len(ranks[0]) == len(ranks[1])
    assert not {i for b in ranks[0] for i in b} & {i for b in ranks[1] for i in b}
    both = ranks[0] + ranks[1]
    assert len(set(both)) == len(both) and set(both) <= set(epoch) and len(epoch) - len(both) < 2


# --- the run folder ---------------------------------------------------------------------------------


@pytest.mark.parametrize("launcher, rank_zero", [
    ({}, True), ({"RANK": "0", "LOCAL_RANK": "0"}, True), ({"RANK": "1", "LOCAL_RANK": "0"}, False),  # torchrun
    ({"SLURM_PROCID": "0"}, True), ({"SLURM_PROCID": "2"}, False),  # srun sets no LOCAL_RANK for the program
    ({"LOCAL_RANK": "1"}, False), ({"LOCAL_RANK": "0", "NODE_RANK": "1"}, False),  # Lightning's own launcher
])  # fmt: skip
def test_only_rank_zero_checks_that_the_run_folder_is_free(launcher, rank_zero, monkeypatch, tmp_path):
    """Rank 0 holds the run folder's lock while the other ranks start on it: a rank that took itself for rank 0
    would find the lock held and stop, leaving rank 0 waiting for it."""
    for name in ("RANK", "SLURM_PROCID", "LOCAL_RANK", "NODE_RANK"):
        monkeypatch.delenv(name, raising=False)
    for name, value in launcher.items():
        monkeypatch.setenv(name, value)
    held = RunFolderLock(tmp_path)  # rank 0's, as a running training holds it
    try:
        if rank_zero:
            with pytest.raises(TrainingError, match="is in use by a training run"):
                check_run_folder_free(OmegaConf.create({"hydra": {"run": {"dir": str(tmp_path)}}}))
        else:
            check_run_folder_free(OmegaConf.create({"hydra": {"run": {"dir": str(tmp_path)}}}))
    finally:
        held.release()
