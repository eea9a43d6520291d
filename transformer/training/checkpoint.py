"""Checkpoints that survive interruption: atomic writes, best-by-BLEU, last.ckpt, a checkpoint on SIGTERM or Ctrl-C."""

import errno
import fcntl
import os
import shutil
import signal
import tempfile
from pathlib import Path

import torch
from lightning_fabric.plugins import TorchCheckpointIO
from pytorch_lightning import LightningModule, Trainer
from pytorch_lightning.callbacks import Checkpoint, ModelCheckpoint
from pytorch_lightning.trainer.states import TrainerFn

from .errors import TrainingError
from .exact_resume import SaveMoment, save_moment


class AtomicCheckpointIO(TorchCheckpointIO):
    """Writes to a temporary file beside the target, syncs it to disk, then renames it over the target:
    a kill at any moment leaves the old checkpoint or the new one, never a truncated file. (Lightning's own
    save stages the file in the system temp folder, and moving it across filesystems is a copy.) A full disk
    stops training with one line; the temporary file is removed and the old checkpoint stays."""

    def save_checkpoint(self, checkpoint: dict, path, storage_options=None) -> None:
        if "://" in str(path):  # remote storage: its own transaction semantics
            return super().save_checkpoint(checkpoint, path, storage_options)
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            _write_atomically(checkpoint, path)
        except Exception as e:
            full = _disk_full(e, checkpoint, path)
            if full is None:
                raise
            raise full from None


# Fault injection, for the kill tests and tools/fault_injection.py: KILL_AT=STAGE[:N] makes this process SIGKILL
# itself at that stage of its Nth checkpoint write (default the first), so that a test kills a write exactly there
KILL_AT = "TRANSFORMER_KILL_AT_CHECKPOINT_WRITE"
# opened: the temporary file exists, empty; saved: torch.save has returned, its last bytes still in Python's buffer
# (the file on disk is cut short); synced: the file is whole and on disk, not yet renamed; renamed: it has replaced
# the checkpoint, the folder not yet synced
WRITE_STAGES = ("opened", "saved", "synced", "renamed")
_writes = 0  # checkpoint writes begun by this process


def _fault_point(stage: str) -> None:
    asked = os.environ.get(KILL_AT)
    if asked:
        name, _, nth = asked.partition(":")
        if name not in WRITE_STAGES:
            raise ValueError(f"{KILL_AT}={asked}: the stage is one of {', '.join(WRITE_STAGES)}")
        if name == stage and _writes == int(nth or 1):
            os.kill(os.getpid(), signal.SIGKILL)


def _write_atomically(checkpoint: dict, path: Path) -> None:
    global _writes
    _writes += 1
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    umask = os.umask(0)
    os.umask(umask)
    os.fchmod(fd, 0o666 & ~umask)  # mkstemp makes it private; a checkpoint gets the usual file mode
    try:
        _fault_point("opened")
        with os.fdopen(fd, "wb") as f:
            torch.save(checkpoint, f)
            _fault_point("saved")
            f.flush()
            os.fsync(f.fileno())
        _fault_point("synced")
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    _fault_point("renamed")
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)  # the rename itself survives a power cut
    finally:
        os.close(dir_fd)


class _ByteCount:
    """A write-only file that counts what torch.save writes to it: a checkpoint's size without a disk."""

    def __init__(self):
        self.size = 0

    def write(self, data) -> int:
        self.size += len(data)
        return len(data)

    def flush(self) -> None:
        pass


# torch.save reports a failed write as a RuntimeError from its zip writer, not as an OSError
_FAILED_WRITE = ("unexpected pos", "file write failed", "failed writing")


def _exception_chain(error: BaseException) -> list[BaseException]:
    chain, e = [], error
    while e is not None and len(chain) < 8:  # closing the file may raise again while the first error unwinds
        chain.append(e)
        e = e.__cause__ or e.__context__
    return chain


def _recovery(checkpoints: Path) -> str:
    last = checkpoints / "last.ckpt"
    return (f"{last} is intact: free space and resume with ckpt_path={last}" if last.exists()
            else "free space there, or give the run a folder on another disk (hydra.run.dir)")  # fmt: skip


def _disk_full(error: Exception, checkpoint: dict, path: Path) -> TrainingError | None:
    """A one-line TrainingError if `error` came from the disk filling up (OSError ENOSPC, or torch's failed
    write confirmed by too little free space), else None."""
    chain = _exception_chain(error)
    enospc = any(isinstance(e, OSError) and e.errno == errno.ENOSPC for e in chain)
    failed_write = any(isinstance(e, RuntimeError) and any(s in str(e) for s in _FAILED_WRITE) for e in chain)
    if not (enospc or failed_write):
        return None
    needed = _ByteCount()
    torch.save(checkpoint, needed)
    free = shutil.disk_usage(path.parent).free
    if not enospc and free >= needed.size:
        return None  # a failed write with room to spare: not a full disk, so the original error stands
    return TrainingError(
        f"disk full: {path.parent} has {free:,} bytes free, {path.name} needs {needed.size:,}; {_recovery(path.parent)}"
    )


def disk_full_in_run(error: BaseException, run_dir: Path) -> TrainingError | None:
    """A one-line TrainingError if `error`, or one it interrupted, is the disk filling up while the run writes into
    its folder: the checkpoint writer's own report, else an OSError ENOSPC (TensorBoard's event file, the tokenizer's
    copy, Hydra's .hydra record: writes that name no size); None for anything else."""
    chain = _exception_chain(error)
    reported = next((e for e in chain if isinstance(e, TrainingError) and str(e).startswith("disk full")), None)
    if reported is not None:  # by the checkpoint writer, before a write in the shutdown failed as well
        return reported
    enospc = next((e for e in chain if isinstance(e, OSError) and e.errno == errno.ENOSPC), None)
    if enospc is None:
        return None
    folder = Path(enospc.filename).parent if enospc.filename else Path(run_dir)
    while not folder.exists() and folder != folder.parent:  # a run folder the full disk kept from being made
        folder = folder.parent
    free = shutil.disk_usage(folder).free
    return TrainingError(f"disk full: {folder} has {free:,} bytes free, too few to write into it ({enospc.strerror}); "
                         f"{_recovery(Path(run_dir) / 'checkpoints')}")  # fmt: skip


def quiet_full_disk_in_threads(hook):
    """threading.excepthook less full disks: TensorBoard's writer thread meets one first, and main, where the
    training loop meets it at its next write, reports it in one line."""

    def excepthook(args) -> None:
        if not (isinstance(args.exc_value, OSError) and args.exc_value.errno == errno.ENOSPC):
            hook(args)

    return excepthook


def check_monitors(callbacks: list, metrics: list[str]) -> None:
    """A callback watching a validation metric that no dev set logs (a misspelt dev set name) would never fire."""
    for c in callbacks:
        monitor = getattr(c, "monitor", None)
        if isinstance(monitor, str) and monitor.startswith("val/") and monitor not in metrics:
            raise TrainingError(
                f"{type(c).__name__} monitors {monitor!r}, which validation does not log; use one of "
                f"{', '.join(metrics)}"
            )


class BestCheckpoint(ModelCheckpoint):
    """The best K checkpoints by a metric that some validations do not log (BLEU is scored every N): those
    validations save nothing here, instead of failing or reusing the previous validation's score."""

    def on_validation_start(self, trainer: Trainer, module: LightningModule) -> None:
        trainer.callback_metrics.pop(self.monitor, None)  # Lightning keeps old values; only this validation's count

    def _scored(self, trainer: Trainer) -> bool:
        return self.monitor is None or self.monitor in trainer.callback_metrics

    def on_train_batch_end(self, trainer: Trainer, module: LightningModule, *args, **kwargs) -> None:
        if self._scored(trainer):
            super().on_train_batch_end(trainer, module, *args, **kwargs)

    def on_train_epoch_end(self, trainer: Trainer, module: LightningModule) -> None:
        if self._scored(trainer):
            super().on_train_epoch_end(trainer, module)

    def on_validation_end(self, trainer: Trainer, module: LightningModule) -> None:
        if self._scored(trainer):
            super().on_validation_end(trainer, module)


class LastCheckpoint(Checkpoint):
    """last.ckpt after every validation, every N training steps if asked, at each epoch's end when the run does
    not validate, and at the end of training, whatever the scores did: the file that resuming starts from. (A
    ModelCheckpoint with a monitor and save_last rewrites last.ckpt only when it also saves a best checkpoint.)
    A Checkpoint, so that Lightning runs it after the other callbacks and adds no checkpoint callback of its own."""

    def __init__(self, dirpath: str, every_n_train_steps: int | None = None):
        self.path = os.path.join(dirpath, "last.ckpt")
        self.every_n_steps = every_n_train_steps or 0
        self._saved_step = 0  # the step of the newest last.ckpt; none is due before the first optimizer step
        self._save_at_epoch_end = False

    def save(self, trainer: Trainer) -> None:
        if trainer.global_step != self._saved_step and not trainer.fast_dev_run:
            trainer.save_checkpoint(self.path, weights_only=False)  # full state: resumable
            self._saved_step = trainer.global_step

    def on_train_start(self, trainer: Trainer, module: LightningModule) -> None:
        self._saved_step = trainer.global_step  # resumed: that step's checkpoint exists

    def on_train_batch_end(self, trainer: Trainer, module: LightningModule, outputs, batch, batch_idx: int) -> None:
        # The run's last batch too: once training ends (max_steps, max_time, a stop), Lightning counts a cut-short
        # epoch as finished, and a checkpoint written then would resume at the next epoch's start.
        last = trainer.should_stop or 0 < trainer.max_steps <= trainer.global_step
        if not last and (not self.every_n_steps or trainer.global_step % self.every_n_steps):
            return
        moment = save_moment(trainer, batch_idx)
        if moment is SaveMoment.NOW:
            self.save(trainer)
        elif moment is SaveMoment.AT_EPOCH_END:
            self._save_at_epoch_end = True
        # after a validation due now, last.ckpt is written as after every validation

    def on_validation_end(self, trainer: Trainer, module: LightningModule) -> None:
        if trainer.state.fn == TrainerFn.FITTING and not trainer.sanity_checking:
            self.save(trainer)

    def on_train_epoch_end(self, trainer: Trainer, module: LightningModule) -> None:
        if self._save_at_epoch_end or not trainer.enable_validation:
            self._save_at_epoch_end = False
            self.save(trainer)

    def on_train_end(self, trainer: Trainer, module: LightningModule) -> None:
        self.save(trainer)


class CheckpointOnSignal(Checkpoint):
    """SIGTERM or Ctrl-C: finish the current batch, write last.ckpt, exit with 128 + the signal number.
    Stopping at a batch boundary keeps the checkpoint exactly resumable; a second Ctrl-C interrupts at once.
    (Lightning's own SIGTERM handling exits with status 0 after any scheduled validation, saving nothing.)
    Under DDP a signal may reach one rank only: the handler sets the module's stop request (StepLedger), which the
    ranks sum in each step's own collective and read with the interval's other figures, so that all stop after the
    same step with no collective or sync of their own; reads come at least every `within_s` seconds of training
    (at rank 0's pace), so that the checkpoint is written inside a scheduler's grace period (often 30 s).
    A Checkpoint, so that Lightning runs it after the other callbacks, ExactResume's bookkeeping included."""

    def __init__(self, within_s: float = 10.0):
        self.within_s = within_s
        self.received: int | None = None
        self.exit_code: int | None = None
        self._stop_at_epoch_end = self._stop_after_validation = False
        self._module: LightningModule | None = None

    def on_sanity_check_start(self, trainer: Trainer, module: LightningModule) -> None:
        self.on_train_start(trainer, module)

    def on_train_start(self, trainer: Trainer, module: LightningModule) -> None:
        self._module = module
        module.ledger.stop_within_s = self.within_s
        # Lightning restores the handlers it found before fit when fit ends.
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._handle)
        if trainer.world_size > 1:
            # Lightning 2.6 broadcasts its own SIGTERM flag from rank 0 before every batch under DDP: a collective
            # and a host sync per step (Lightning issue #21487), for a flag that only its handler, replaced above,
            # sets. No public setting turns it off, so this one private method is skipped (private API, this line).
            trainer.fit_loop.epoch_loop._broadcast_sigterm_tensor = lambda: None
        if self.received is not None:  # signalled during the sanity check: nothing trained, nothing to save
            raise SystemExit(128 + self.received)

    def _handle(self, signum, frame) -> None:
        if self.received is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.received = signum
        self._module.ledger.stop_requested = True

    def on_train_batch_end(self, trainer: Trainer, module: LightningModule, outputs, batch, batch_idx: int) -> None:
        stop = self.received is not None
        if trainer.world_size > 1:  # every rank's request, as the steps' collectives summed it, read with the interval
            readout = module.ledger.readout
            stop = readout is not None and readout.step == trainer.global_step and readout.stop
        if not stop:
            return
        moment = save_moment(trainer, batch_idx)
        if moment is SaveMoment.NOW:
            self._save_and_stop(trainer)
        elif moment is SaveMoment.AFTER_VALIDATION:
            self._stop_after_validation = True
        elif moment is SaveMoment.AT_EPOCH_END:
            self._stop_at_epoch_end = True
        # mid-step: the optimizer step's accumulated batches finish first

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
        trainer.save_checkpoint(path, weights_only=False)
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
