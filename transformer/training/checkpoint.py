"""Checkpoints that survive interruption: atomic writes, best-by-BLEU, a checkpoint on SIGTERM or Ctrl-C."""

import fcntl
import math
import os
import signal
import tempfile
from pathlib import Path

import torch
from lightning_fabric.plugins import TorchCheckpointIO
from pytorch_lightning import Callback, LightningModule, Trainer
from pytorch_lightning.callbacks import ModelCheckpoint

from .errors import TrainingError


class AtomicCheckpointIO(TorchCheckpointIO):
    """Writes to a temporary file beside the target, syncs it to disk, then renames it over the target:
    a kill at any moment leaves the old checkpoint or the new one, never a truncated file. (Lightning's own
    save stages the file in the system temp folder, and moving it across filesystems is a copy.)"""

    def save_checkpoint(self, checkpoint: dict, path, storage_options=None) -> None:
        if "://" in str(path):  # remote storage: its own transaction semantics
            return super().save_checkpoint(checkpoint, path, storage_options)
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        umask = os.umask(0)
        os.umask(umask)
        os.fchmod(fd, 0o666 & ~umask)  # mkstemp makes it private; a checkpoint gets the usual file mode
        try:
            with os.fdopen(fd, "wb") as f:
                torch.save(checkpoint, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        dir_fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)  # the rename itself survives a power cut
        finally:
            os.close(dir_fd)


def at_epoch_end(trainer: Trainer) -> bool:
    """True after the epoch's last training batch, until the epoch ends. Lightning cannot resume exactly from a
    checkpoint written at that batch's end (it loses the next epoch's first batches; one written after the
    epoch's validation is fine), so saves due then wait for on_train_epoch_end."""
    return trainer.state.fn == "fit" and trainer.fit_loop.epoch_loop.batch_progress.is_last_batch


def validation_due(trainer: Trainer, batch_idx: int) -> bool:
    """True when a validation runs after this training batch (mid-epoch, by val_check_interval). A checkpoint
    written before it would resume past it: that validation, its BLEU and best checkpoint would be lost."""
    every = trainer.val_check_batch
    if not trainer.enable_validation or every is None or math.isinf(every) or at_epoch_end(trainer):
        return False
    if trainer.check_val_every_n_epoch is None:  # validation every N steps across epochs
        return trainer.global_step % every == 0
    return (trainer.current_epoch + 1) % trainer.check_val_every_n_epoch == 0 and (batch_idx + 1) % every == 0


class BestCheckpoint(ModelCheckpoint):
    """The best K checkpoints by a metric that some validations do not log (BLEU is scored every N): those
    validations save nothing here, instead of failing or reusing the previous validation's score."""

    def on_validation_start(self, trainer: Trainer, module: LightningModule) -> None:
        trainer.callback_metrics.pop(self.monitor, None)  # Lightning keeps old values; only this validation's count

    def _save_topk_checkpoint(self, trainer: Trainer, monitor_candidates: dict) -> None:
        if self.monitor is not None and self.monitor not in monitor_candidates:
            return
        super()._save_topk_checkpoint(trainer, monitor_candidates)


class LastCheckpoint(ModelCheckpoint):
    """last.ckpt after every validation (or epoch), every N training steps if asked, and at the end of
    training, whatever the scores did: the file that resuming starts from. (A ModelCheckpoint with a monitor
    and save_last rewrites last.ckpt only when it also saves a best checkpoint.)"""

    def __init__(self, dirpath: str, every_n_train_steps: int | None = None):
        # Lightning takes step or epoch triggers, not both: the step trigger is kept here.
        super().__init__(dirpath=dirpath, filename=self.CHECKPOINT_NAME_LAST, monitor=None, save_top_k=1,
                         enable_version_counter=False)  # fmt: skip
        self.save_every_n_steps = every_n_train_steps or 0
        self._save_at_epoch_end = False

    @property
    def path(self) -> str:
        return os.path.join(self.dirpath, self.CHECKPOINT_NAME_LAST + self.FILE_EXTENSION)

    def on_train_start(self, trainer: Trainer, module: LightningModule) -> None:
        # Resumed from an epoch-end checkpoint, Lightning starts the next epoch afresh only in epoch-based
        # training; with trainer.max_steps it treats the finished epoch as interrupted and loses the next
        # epoch's first batches. Do here what it does for epoch-based training.
        progress = trainer.fit_loop.epoch_progress.current
        if progress.processed > progress.completed:
            progress.completed = progress.processed
            trainer.fit_loop.epoch_loop.restarting = False

    def _save_now(self, trainer: Trainer) -> None:
        if self._last_global_step_saved != trainer.global_step and not trainer.fast_dev_run:
            self._save_topk_checkpoint(trainer, self._monitor_candidates(trainer))

    def on_train_batch_end(self, trainer: Trainer, module: LightningModule, outputs, batch, batch_idx: int) -> None:
        if not self.save_every_n_steps or trainer.global_step % self.save_every_n_steps:
            return
        if validation_due(trainer, batch_idx):
            return  # last.ckpt is written after that validation
        if at_epoch_end(trainer):
            self._save_at_epoch_end = True
        else:
            self._save_now(trainer)

    def on_train_epoch_end(self, trainer: Trainer, module: LightningModule) -> None:
        if self._save_at_epoch_end:
            self._save_at_epoch_end = False
            self._save_now(trainer)
        super().on_train_epoch_end(trainer, module)

    def on_train_end(self, trainer: Trainer, module: LightningModule) -> None:
        self._save_now(trainer)


class CheckpointOnSignal(Callback):
    """SIGTERM or Ctrl-C: finish the current batch, write last.ckpt, exit with 128 + the signal number.
    Stopping at a batch boundary keeps the checkpoint exactly resumable; a second Ctrl-C interrupts at once.
    (Lightning's own SIGTERM handling exits with status 0 after any scheduled validation, saving nothing.)"""

    def __init__(self):
        self.received: int | None = None
        self.exit_code: int | None = None
        self._stop_at_epoch_end = self._stop_after_validation = False

    def on_sanity_check_start(self, trainer: Trainer, module: LightningModule) -> None:
        self.on_train_start(trainer, module)

    def on_train_start(self, trainer: Trainer, module: LightningModule) -> None:
        # Lightning restores the handlers it found before fit when fit ends.
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._handle)
        if self.received is not None:  # signalled during the sanity check: nothing trained, nothing to save
            raise SystemExit(128 + self.received)

    def _handle(self, signum, frame) -> None:
        if self.received is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.received = signum

    def on_train_batch_end(self, trainer: Trainer, module: LightningModule, outputs, batch, batch_idx: int) -> None:
        stop = self.received is not None
        if trainer.world_size > 1:  # a signal may reach one rank only; all must save and stop together
            stop = trainer.strategy.reduce_boolean_decision(stop, all=False)
        if not stop or (batch_idx + 1) % trainer.accumulate_grad_batches and not at_epoch_end(trainer):
            return  # go on, or finish the optimizer step's accumulated batches first
        if at_epoch_end(trainer):
            self._stop_at_epoch_end = True  # after this epoch's validation, if one is due
        elif validation_due(trainer, batch_idx):
            self._stop_after_validation = True  # resuming would skip it: validate first
        else:
            self._save_and_stop(trainer)

    def on_validation_end(self, trainer: Trainer, module: LightningModule) -> None:
        if self._stop_after_validation:
            self._save_and_stop(trainer)

    def on_train_epoch_end(self, trainer: Trainer, module: LightningModule) -> None:
        if self._stop_at_epoch_end:
            self._save_and_stop(trainer)
        self._exit_if_stopping()

    def _save_and_stop(self, trainer: Trainer) -> None:
        path = next((c.path for c in trainer.checkpoint_callbacks if isinstance(c, LastCheckpoint)), None)
        path = path or os.path.join(trainer.default_root_dir, "checkpoints", "last.ckpt")
        trainer.save_checkpoint(path)
        signum = self.received or signal.SIGTERM
        if trainer.is_global_zero:
            print(f"\n{signal.Signals(signum).name}: saved {path} at step {trainer.global_step}; "
                  f"resume with ckpt_path={path}", flush=True)  # fmt: skip
        self.exit_code = 128 + signum  # exit at the next hook, once Lightning has logged this step's metrics

    def _exit_if_stopping(self, *args) -> None:
        if self.exit_code is not None:
            raise SystemExit(self.exit_code)

    on_train_batch_start = on_validation_start = on_train_end = _exit_if_stopping


class RunFolderLock:
    """One training process per run folder: an exclusive lock on RUN/.lock, held until the process ends. The
    operating system releases it when the process dies, however it dies, so a killed run can be resumed."""

    def __init__(self, run_dir: Path):
        self.path = Path(run_dir) / ".lock"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "a+")  # noqa: SIM115  (held open for the life of the run)
        try:
            fcntl.flock(self._file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._file.seek(0)
            holder = self._file.read().strip() or "another process"
            self._file.close()
            raise TrainingError(
                f"{run_dir} is in use by a training run ({holder}); give this run its own hydra.run.dir, "
                "or resume that run only after it has stopped"
            ) from None
        self._file.truncate(0)
        self._file.write(f"pid {os.getpid()}\n")
        self._file.flush()

    def release(self) -> None:
        fcntl.flock(self._file, fcntl.LOCK_UN)
        self._file.close()
