"""Exact resume, in one place: what a checkpoint holds for it, and when a checkpoint may be written.

The invariant: a run stopped after optimizer step k and resumed from that step's checkpoint continues with
exactly the batches, dropout masks and validations that the run never stopped has after step k, so that its
losses and weights are that run's. It takes:
- the train sampler's place: the batch after the last one trained (loader workers fetch ahead, so the
  sampler's own count is too far), or the next epoch's first once the epoch has ended; streamed data
  (data.streaming), each stream's state as of the last batch trained from it (carried in the batch);
- the random state (dropout) of every rank, each set again just before the first batch trained after resuming, so
  that the sanity check and the loader's start in between do not shift it;
- the count of validations (BLEU is scored every N) and of fp16 steps the gradient scaler skipped;
- writing a checkpoint only where resuming from it is exact (`save_moment`): at an optimizer step's end, after a
  validation due after this batch (else resuming would skip it), and not at the end of an epoch's last batch
  (Lightning loses the next epoch's first batches when resuming from there; on_train_epoch_end is fine);
- undoing a Lightning quirk on resuming a max_steps run from a checkpoint written in on_train_epoch_end;
- every callback that writes checkpoints being a Checkpoint (Lightning runs those last), so that this one's
  bookkeeping in the same hook comes first.
Lightning's loop internals decide the last two, so a newer Lightning is checked by the resume tests:
tests/test_train.py::test_resumed_run_continues_exactly and tests/test_reliability.py::test_killed_at_random...
"""

import math
import random
from enum import Enum

import torch
from pytorch_lightning import Callback, LightningModule, Trainer

from ..data import TranslationDataModule
from ..machine.distributed import every_rank


class SaveMoment(Enum):
    NOW = "now"
    MID_STEP = "mid_step"  # the optimizer step has micro-batches to go: wait for its last
    AFTER_VALIDATION = "after_validation"  # a validation runs after this batch: write after it
    AT_EPOCH_END = "at_epoch_end"  # the epoch's last batch: write in on_train_epoch_end


def save_moment(trainer: Trainer, batch_idx: int) -> SaveMoment:
    """When a checkpoint due after training batch `batch_idx` (in on_train_batch_end) resumes exactly."""
    if batch_idx + 1 >= trainer.num_training_batches:
        return SaveMoment.AT_EPOCH_END
    if (batch_idx + 1) % trainer.accumulate_grad_batches:
        return SaveMoment.MID_STEP
    if _validation_due(trainer, batch_idx):
        return SaveMoment.AFTER_VALIDATION
    return SaveMoment.NOW


def _validation_due(trainer: Trainer, batch_idx: int) -> bool:
    """True when a validation runs after this training batch, which is not the epoch's last (val_check_interval)."""
    every = trainer.val_check_batch
    if not trainer.enable_validation or every is None or math.isinf(every):
        return False
    if trainer.check_val_every_n_epoch is None:  # validation every N steps across epochs
        return trainer.global_step % every == 0 or trainer.should_stop
    validating_epoch = (trainer.current_epoch + 1) % trainer.check_val_every_n_epoch == 0
    # a run told to stop (max_time, a callback) validates first, in an epoch that validates
    return validating_epoch and ((batch_idx + 1) % every == 0 or trainer.should_stop)


class ExactResume(Callback):
    """Keeps the invariant above for a TranslationModule trained on a TranslationDataModule. Its entries are
    top-level checkpoint keys ("rng", "validations", "skipped_steps"; the sampler's under the data module's)."""

    def __init__(self):
        self._rng_to_restore: dict | None = None

    def on_save_checkpoint(self, trainer: Trainer, module: LightningModule, checkpoint: dict) -> None:
        checkpoint["rng"] = every_rank(rng_state())  # each rank's dropout has drawn for its own batches
        checkpoint["validations"] = module.validations
        checkpoint["skipped_steps"] = module.ledger.skipped_steps

    def on_load_checkpoint(self, trainer: Trainer, module: LightningModule, checkpoint: dict) -> None:
        rng = checkpoint.get("rng")  # one per rank; a single state in checkpoints before that
        self._rng_to_restore = rng[trainer.global_rank % len(rng)] if isinstance(rng, list) else rng
        module.validations = checkpoint.get("validations", 0)
        module.ledger.skipped_steps = checkpoint.get("skipped_steps", 0)

    def on_train_start(self, trainer: Trainer, module: LightningModule) -> None:
        # Resumed from a checkpoint written in on_train_epoch_end, Lightning starts the next epoch afresh only
        # in epoch-based training; with trainer.max_steps it treats the finished epoch as interrupted and loses
        # the next epoch's first batches. No public hook or setting changes that, so this does what Lightning
        # does for epoch-based training, through its loop's progress counters (private API, kept to this line).
        progress = trainer.fit_loop.epoch_progress.current
        if progress.processed > progress.completed:
            progress.completed = progress.processed
            trainer.fit_loop.epoch_loop.restarting = False

    def on_train_batch_start(self, trainer: Trainer, module: LightningModule, batch, batch_idx: int) -> None:
        if self._rng_to_restore is not None:  # resumed: dropout continues the interrupted run's random stream
            set_rng_state(self._rng_to_restore)
            self._rng_to_restore = None

    # The sampler's place, kept current for the checkpoints written after these hooks: Lightning runs Checkpoint
    # callbacks after all others, and each callback here that writes checkpoints is one.

    def on_train_batch_end(self, trainer: Trainer, module: LightningModule, outputs, batch, batch_idx: int) -> None:
        self._resume_at(trainer, trainer.current_epoch, batch_idx + 1)
        if isinstance(trainer.datamodule, TranslationDataModule):
            trainer.datamodule.consumed(batch)  # streamed data: the streams' place is in the batch

    def on_train_epoch_end(self, trainer: Trainer, module: LightningModule) -> None:
        # Only from here on is the epoch over for Lightning: a checkpoint written after the validation that
        # follows its last batch resumes in that epoch, with no batches left to train.
        self._resume_at(trainer, trainer.current_epoch + 1, 0)

    @staticmethod
    def _resume_at(trainer: Trainer, epoch: int, position: int) -> None:
        if isinstance(trainer.datamodule, TranslationDataModule):
            trainer.datamodule.set_resume_point(epoch, position)


def rng_state() -> dict:
    """This process's random state: CPU, Python and, on a GPU, its own device's only (each rank saves its own), so
    that a run resumes whatever number of devices each process sees (CUDA_VISIBLE_DEVICES per rank or not)."""
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()  # the current device's
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        cuda = state["cuda"]
        if isinstance(cuda, list):  # checkpoints before: every device this rank saw, by index
            cuda = cuda[min(torch.cuda.current_device(), len(cuda) - 1)]
        torch.cuda.set_rng_state(cuda)  # the current device's
