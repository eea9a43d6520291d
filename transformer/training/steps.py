"""The training step's bookkeeping on the host: what the micro-batches of an optimizer step add up to, the steps
whose figures are still on the device, their read (the logging interval's one sync), the policy for a non-finite
step, and the stop request every rank must see at the same step."""

import math
import time
from dataclasses import dataclass

import torch
from pytorch_lightning.utilities import rank_zero_warn

from .errors import TrainingError


@dataclass(frozen=True)
class StepReadout:
    """What the host learns of an optimizer step, read from the device with the other steps of its interval at once.
    The loggers, the progress bar and the callbacks take these values instead of reading the device again."""

    step: int  # the optimizer step it describes (trainer.global_step after it)
    loss: float  # label-smoothed loss per target token, over this rank's micro-batches of the step
    grad_norm: float  # before clipping, of the gradients per target token of the whole step
    stop: bool  # some rank asked to stop (request_stop): every rank reads the same answer at the same step


@dataclass(frozen=True)
class PendingStep:
    """An optimizer step whose figures are still on the device, and what names it if they are not finite."""

    step: int  # trainer.global_step during it (the steps done before)
    epoch: int
    batch_idx: int
    examples: torch.Tensor  # the first examples of its last batch
    tokens: int  # real target tokens of its micro-batches on this rank
    values: torch.Tensor  # (2 or 4,) on the device: gradient norm, summed loss; under DDP the agreed stop request
    # and rank 0's seconds per step


class StepLedger:
    """Owned by the LightningModule, one per run. Nothing here waits on the device but `read`.

    Under DDP a stop request reaches the other ranks through each step's collective (`totals`) and is seen at the
    next read, which every rank makes after the same step: after each logging interval, and sooner where the interval
    would outlast `stop_within_s` at rank 0's measured pace (a scheduler's SIGTERM grace is often 30 s)."""

    def __init__(self):
        self.log_every, self.world_size, self.fp16 = 50, 1, False  # the trainer's, from `start`
        self.stop_within_s: float | None = None  # None: no stop request to bound (CheckpointOnSignal sets it)
        self.tokens, self.loss = 0, 0.0  # this optimizer step's micro-batches so far: host int, device sum
        self.last_batch: tuple[int, torch.Tensor] | None = None  # (batch_idx, first examples), named on a blow-up
        self.pending: list[PendingStep] = []
        self.readout: StepReadout | None = None  # the last step read
        self.stop_requested = False  # this rank's (a signal handler sets it)
        self.skipped_steps, self.skipped_in_a_row = 0, 0  # fp16 steps the gradient scaler skipped (resumed)
        self.read_every = self.log_every  # steps between reads; under DDP, fewer where a stop request would wait
        self._last_read = (0, time.perf_counter())  # (steps done, wall clock) at the last read
        self._seconds_per_step = 0.0  # this rank's, over its last interval (rank 0's is shared through `totals`)
        self._skipping = None  # the optimizer told to skip a non-finite step on the device

    def start(self, log_every: int, world_size: int, fp16: bool, steps_done: int) -> None:
        """The trainer's facts, when fit starts (a resumed run's steps done included)."""
        self.log_every, self.world_size, self.fp16 = log_every, world_size, fp16
        # under DDP the first read follows the first step: rank 0's pace is known from then on
        self.read_every, self._last_read = 1 if world_size > 1 else log_every, (steps_done, time.perf_counter())

    def add_micro_batch(self, loss_sum: torch.Tensor, tokens: int, batch_idx: int, examples: torch.Tensor) -> None:
        self.tokens += tokens
        self.loss = self.loss + loss_sum.detach()
        self.last_batch = (batch_idx, examples)

    def totals(self, scale: float, device: torch.device) -> tuple[float | torch.Tensor, list[torch.Tensor]]:
        """(what turns the accumulated gradients into gradients per target token of the step, the values under DDP
        the ranks agree on). scale undoes Lightning's division by accumulate_grad_batches and DDP's average over
        ranks; under DDP the ranks' tokens, stop requests and rank 0's pace are summed in the step's one collective,
        and come back as device tensors that nothing waits for here."""
        if self.world_size == 1:
            return scale / max(self.tokens, 1), []
        rank_zero = torch.distributed.get_rank() == 0
        totals = torch.full((3,), float(self.tokens), device=device)  # filled on the device: no copy from the host
        totals[1:2].fill_(float(self.stop_requested))
        totals[2:].fill_(self._seconds_per_step if rank_zero else 0.0)
        torch.distributed.all_reduce(totals)
        return scale / totals[0].clamp(min=1), [(totals[1] > 0).float(), totals[2]]

    def skip_if_not_finite(self, optimizer: torch.optim.Optimizer, norm: torch.Tensor) -> None:
        """A non-finite norm makes the optimizer skip the step on the device: fused AdamW reads found_inf (fp16's
        gradient scaler sets it itself). Any other optimizer would apply the non-finite update: refused."""
        if self.fp16:
            return
        if not optimizer.defaults.get("fused"):
            raise TrainingError(f"{type(optimizer).__name__}(fused=False) would apply a non-finite step's update: "
                                "this module skips it on the device through a fused optimizer; use fused=True")  # fmt: skip
        optimizer.found_inf = (~norm.isfinite()).float()
        self._skipping = optimizer

    def after_optimizer_step(self) -> None:
        if self._skipping is not None:
            del self._skipping.found_inf
            self._skipping = None

    def close_step(self, step: int, epoch: int, norm: torch.Tensor, agreed: list[torch.Tensor]) -> None:
        """The step's figures join the pending ones; the next step starts counting afresh."""
        batch_idx, examples = self.last_batch
        values = torch.stack([norm.float(), self.loss.float(), *agreed])
        self.pending.append(PendingStep(step, epoch, batch_idx, examples, self.tokens, values))
        self.tokens, self.loss = 0, 0.0

    def due(self, steps_done: int) -> bool:
        """Whether to read after this many optimizer steps: every rank answers alike (its inputs are agreed). In one
        process a stop request needs no read (CheckpointOnSignal sees its own), so only logged steps are read."""
        if steps_done % self.log_every == 0:
            return True
        return self.world_size > 1 and steps_done - self._last_read[0] >= self.read_every

    def read(self) -> None:
        """The pending steps' figures in one sync, into `readout` (the last step's); a non-finite gradient norm among
        them handled by `_non_finite`. Also before any checkpoint is written and when training ends, so that no
        checkpoint follows a non-finite step unseen."""
        if not self.pending:
            return
        pending = self.pending
        rows = torch.stack([p.values for p in pending]).tolist()  # the interval's one sync
        for i, (p, (grad_norm, loss, *agreed)) in enumerate(zip(pending, rows)):
            stop = bool(agreed[0]) if agreed else self.stop_requested
            self.readout = StepReadout(p.step + 1, loss / max(p.tokens, 1), grad_norm, stop)
            if math.isfinite(grad_norm):
                self.skipped_in_a_row = 0
            else:
                self.pending = pending[i:]  # a read after this one (another save) stops there again
                self._non_finite(grad_norm, p)
        self.pending = []
        steps_done, now = pending[-1].step + 1, time.perf_counter()
        self._seconds_per_step = (now - self._last_read[1]) / max(steps_done - self._last_read[0], 1)
        self._last_read = (steps_done, now)
        if self.stop_within_s is None:
            self.read_every = self.log_every
        elif rows[-1][3:] and rows[-1][3] > 0:  # rank 0's pace, as every rank read it
            self.read_every = max(1, min(self.log_every, int(self.stop_within_s / rows[-1][3])))

    def _non_finite(self, norm: float, step: PendingStep) -> None:
        """fp16: the gradient scaler skipped this step and lowered its scale (counted, and reported when it keeps
        happening). bf16 and fp32 have no such remedy: the optimizer skipped the step, and training stops, naming the
        step and its examples, before any checkpoint is written after it."""
        if self.fp16:
            self.skipped_steps += 1
            self.skipped_in_a_row += 1
            if self.skipped_in_a_row == 100:
                rank_zero_warn(
                    f"the fp16 gradient scaler has skipped 100 steps in a row (step {step.step}): gradients "
                    "overflow persistently; try trainer.precision=bf16-mixed or a lower optim.lr"
                )
            return
        raise TrainingError(
            f"non-finite gradient norm ({norm}) at step {step.step} (epoch {step.epoch}, batch {step.batch_idx}, loss "
            f"{self.readout.loss:.4g}, examples {step.examples.tolist()}); no weights were updated from it and no "
            "checkpoint written after it: resume from last.ckpt with a lower optim.lr or trainer.precision=32"
        )
