"""Training-loop figures for TensorBoard: the step's loss and gradient norm, learning rate, tokens/s, padding,
resident memory; and the run's closing line: how much of its wall clock the training steps took."""

import sys
import time

from pytorch_lightning import Callback, LightningModule, Trainer

from ..machine.allocator import resident_gib


class TrainingMonitor(Callback):
    """Every trainer.log_every_n_steps optimizer steps: train/loss and train/grad_norm (the module's readout of that
    step), train/lr, train/tokens_per_s (target tokens per second spent in training steps since the last log: forward,
    backward and optimizer; all ranks together), train/padding (the fraction of those batches' cells that are padding)
    and train/resident_gib (this rank's resident host memory). They go straight to the loggers as the host values
    they are: through LightningModule.log each would be copied to the device and read back, a wait per value.

    When trainer.fit ends, one line on stderr: the training steps' share of its wall clock (forward, backward and
    optimizer, from each batch's start to its end), validation's (its sanity check included), and the rest's (data
    waits, checkpoints). No step waits for a GPU but the one whose readout is read, once per logging interval: its wait
    drains the queue, so the steps' time summed over an interval is the GPU's, though one step's alone is the host's."""

    def __init__(self):
        self._start = 0.0
        self._seconds, self._tokens, self._real, self._cells = 0.0, 0, 0, 0  # since the last log
        self._fit_start, self._validation_start = 0.0, 0.0
        self._step_seconds, self._validation_seconds = 0.0, 0.0  # since the fit started
        self._logged = -1  # the optimizer step logged last

    def on_fit_start(self, trainer: Trainer, module: LightningModule) -> None:
        self._fit_start = time.perf_counter()
        self._step_seconds = self._validation_seconds = 0.0

    def on_validation_start(self, trainer: Trainer, module: LightningModule) -> None:
        self._validation_start = time.perf_counter()

    def on_validation_end(self, trainer: Trainer, module: LightningModule) -> None:
        self._validation_seconds += time.perf_counter() - self._validation_start

    def on_fit_end(self, trainer: Trainer, module: LightningModule) -> None:
        if trainer.is_global_zero:
            print(wall_clock_line(time.perf_counter() - self._fit_start, self._step_seconds, self._validation_seconds,
                                  trainer.global_step), file=sys.stderr, flush=True)  # fmt: skip

    def on_train_batch_start(self, trainer: Trainer, module: LightningModule, batch: dict, batch_idx: int) -> None:
        self._start = time.perf_counter()

    def on_train_batch_end(
        self, trainer: Trainer, module: LightningModule, outputs, batch: dict, batch_idx: int
    ) -> None:
        # Lightning runs checkpoint callbacks after the others, so a checkpoint's save time is not counted here.
        seconds = time.perf_counter() - self._start
        self._seconds += seconds
        self._step_seconds += seconds
        self._tokens += batch["tgt_tokens"]  # shapes and the collator's counts: host values
        self._real += batch["src_tokens"] + batch["tgt_tokens"]
        self._cells += batch["src"].numel() + batch["tgt_out"].numel()
        readout, step, every = module.ledger.readout, trainer.global_step, trainer.log_every_n_steps
        if readout is None or readout.step != step or step == self._logged or not every or step % every:
            return  # mid-step (accumulating), logged already, or not a step to log
        self._logged = step
        metrics = {
            "train/loss": readout.loss,
            "train/grad_norm": readout.grad_norm,
            "train/lr": trainer.optimizers[0].param_groups[0]["lr"],
            "train/tokens_per_s": self._tokens * trainer.world_size / max(self._seconds, 1e-9),
            "train/padding": 1 - self._real / max(self._cells, 1),
        }
        resident = resident_gib()
        if resident is not None:
            metrics["train/resident_gib"] = resident
        if module.ledger.skipped_steps:
            metrics["train/skipped_steps"] = module.ledger.skipped_steps
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=step - 1)  # Lightning's numbering: the steps done before this one
        self._seconds, self._tokens, self._real, self._cells = 0.0, 0, 0, 0


def wall_clock_line(wall: float, steps: float, validation: float, step_count: int) -> str:
    wall = max(wall, 1e-9)
    return (f"wall clock: training steps {steps / wall:.1%} of {wall:.0f} s in trainer.fit ({step_count} steps; "
            f"validation {validation / wall:.1%}, data waits, checkpoints and the rest "
            f"{(wall - steps - validation) / wall:.1%})")  # fmt: skip
