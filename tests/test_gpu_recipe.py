"""The GPU recipe spends its minutes training: loader workers kept, page-locked batches on a GPU, fused AdamW,
validation and checkpoints by steps rather than every short epoch, and a closing line with the training steps'
share of the wall clock. Run here with the tiny model on a small corpus, the recipe's cadence otherwise."""

import multiprocessing
import re
from types import SimpleNamespace

import pytorch_lightning as pl
import torch

from transformer.data import TranslationDataModule

from .helpers import callback, config, run_train, tiny_data, write_text_corpus


class Overheads(pl.Callback):
    """What a run does besides training steps: loader worker processes it starts, validations, checkpoints."""

    def __init__(self):
        self.workers: set[int] = set()
        self.validations = self.checkpoints = 0

    def on_fit_start(self, trainer, module):
        self.before = {p.pid for p in multiprocessing.active_children()}  # other tests' loaders, if any are alive

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        self.workers |= {p.pid for p in multiprocessing.active_children()} - self.before

    def on_validation_end(self, trainer, module):
        self.validations += not trainer.sanity_checking

    def on_save_checkpoint(self, trainer, module, checkpoint):
        self.checkpoints += 1


def test_the_gpu_recipe_trains_through_epochs_without_restarting_validating_or_checkpointing(tmp_path, capfd):
    write_text_corpus(tmp_path / "c")
    trainer = run_train(tmp_path / "run", [
        "experiment=multi30k_de_en_gpu", "model.size=tiny", *tiny_data(tmp_path / "c", tmp_path / "cache"),
        "trainer.max_steps=24", "trainer.precision=32", "trainer.enable_progress_bar=false",
        "+callbacks.overheads._target_=tests.test_gpu_recipe.Overheads",
    ])  # fmt: skip
    assert trainer.current_epoch >= 2  # three epochs of the small corpus, or more
    seen = callback(trainer, Overheads)
    assert len(seen.workers) == 4  # the recipe's 2 per loader (training, validation), started once, not per epoch
    assert seen.validations == 0 and seen.checkpoints == 1  # by steps (every 1,000 and 500): only the final last.ckpt
    assert trainer.optimizers[0].defaults["fused"] is True
    line = capfd.readouterr().err.strip().splitlines()[-1]
    share = re.fullmatch(r"wall clock: training steps (\d+\.\d)% of \d+ s in trainer\.fit \(24 steps; .*\)", line)
    assert share and 0 < float(share.group(1)) <= 100, line


def test_batches_are_page_locked_for_a_gpu_and_workers_persist(tmp_path):
    """As the data module makes its loaders for a run on a GPU (the trainer stands in: none is here)."""
    write_text_corpus(tmp_path / "c")
    data = TranslationDataModule(config(tmp_path / "c", tmp_path, num_workers=1))
    data.trainer = SimpleNamespace(strategy=SimpleNamespace(root_device=torch.device("cuda", 0)), world_size=1,
                                   global_rank=0)  # fmt: skip
    for loader in (data.train_dataloader(), data.val_dataloader()):
        assert loader.pin_memory and loader.persistent_workers
    data.trainer = None
    assert not data.train_dataloader().pin_memory  # on a CPU there is nothing to copy


def test_a_checkpoint_of_an_unfused_optimizer_resumes_fused(tmp_path):
    """Checkpoints before fused AdamW saved "fused": None in their parameter groups, which loading would keep."""
    write_text_corpus(tmp_path / "c")
    common = [*tiny_data(tmp_path / "c", tmp_path / "cache"), "model=tiny", "trainer.precision=32", "~logger",
              "trainer.enable_progress_bar=false"]  # fmt: skip
    run_train(tmp_path / "run", [*common, "trainer.max_steps=2"])
    path = tmp_path / "run" / "checkpoints" / "last.ckpt"
    checkpoint = torch.load(path, weights_only=True)
    for group in checkpoint["optimizer_states"][0]["param_groups"]:
        group["fused"], group["foreach"] = None, None  # as an unfused AdamW saved them
    torch.save(checkpoint, path)
    resumed = run_train(tmp_path / "run", [*common, "trainer.max_steps=3", "ckpt_path=last"])
    assert resumed.global_step == 3 and all(g["fused"] is True for g in resumed.optimizers[0].param_groups)
