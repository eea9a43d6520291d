"""The learning rate's schedule: linear warmup, then the paper's inverse square root, or a cosine to zero where the run
ends: at its last step, or when its clock (trainer.max_time) runs out, whichever comes first."""

import math
from collections.abc import Callable

import pytorch_lightning as pl
from pytorch_lightning.callbacks import Timer

from .strategy import device_count


def lr_factor(step: int, warmup: int, schedule: str, total: int | None, clock: float = 0.0) -> float:
    """Multiplier of the peak learning rate at optimizer step `step` (0-based). The cosine reaches zero at step
    `total` (None: no step limit) or when `clock`, the share of the run's time limit spent, reaches 1; the warmup's
    ramp ends where it meets the cosine, so a clock already running during the warmup leaves no jump."""
    step += 1
    ramp = step / max(warmup, 1)
    if schedule == "inverse_sqrt":
        if step <= warmup:
            return ramp
        return math.sqrt(warmup / step) if warmup > 0 else 1 / math.sqrt(step)
    by_steps = (step - warmup) / max(total - warmup, 1) if total is not None else 0.0
    progress = min(1.0, max(0.0, by_steps, clock))
    return min(ramp, 0.5 * (1 + math.cos(math.pi * progress)))


def step_limit(trainer: pl.Trainer) -> int | None:
    """The optimizer steps the run ends at if its clock does not stop it first (max_steps, or max_epochs' batches);
    None for a run without either (max_epochs=-1)."""
    steps = trainer.estimated_stepping_batches
    return int(steps) if math.isfinite(steps) else None


def clock_share(trainer: pl.Trainer) -> Callable[[], float]:
    """The share of trainer.max_time spent so far, as a function the schedule calls at each step (always 0 without a
    time limit). A resumed run's Timer counts the time trained before its stop."""
    timer = next((c for c in trainer.callbacks if isinstance(c, Timer)), None)
    if timer is None or timer.time_remaining() is None:
        return lambda: 0.0
    duration = timer.time_elapsed() + timer.time_remaining()
    return lambda: timer.time_elapsed() / duration if duration > 0 else 1.0


def lr_multiplier(schedule: str, warmup: int, trainer: pl.Trainer) -> Callable[[int], float]:
    """What LambdaLR calls at each step. A function, not a callable object, whose fields LambdaLR's state_dict would
    copy into checkpoints; only a cosine reads the run's end and its clock."""
    if schedule != "cosine":
        return lambda step: lr_factor(step, warmup, schedule, None)
    total, clock = step_limit(trainer), clock_share(trainer)
    return lambda step: lr_factor(step, warmup, schedule, total, clock())


def check_schedule(schedule: str, trainer: dict) -> None:  # trainer: the Trainer's arguments, every one given
    """Refuse, in one line, a cosine that cannot find its end: a run without one, or a clock that each DDP rank would
    read apart, stepping the ranks' weights with different learning rates."""
    if schedule != "cosine":
        return
    max_time = trainer["max_time"]
    processes = trainer["num_nodes"] * device_count(trainer["devices"], trainer["accelerator"])
    if max_time is not None and processes > 1:
        raise ValueError(f"optim.schedule=cosine with trainer.max_time={max_time} decays by the clock, which the "
                         f"{processes} ranks would read apart; bound the run by steps (trainer.max_steps=N "
                         "trainer.max_time=null) or use optim.schedule=inverse_sqrt")  # fmt: skip
    if max_time is None and trainer["max_steps"] == -1 and trainer["max_epochs"] == -1:
        raise ValueError("optim.schedule=cosine decays to zero where the run ends, but trainer.max_epochs=-1 without "
                         "trainer.max_steps or trainer.max_time never ends; set one of them")  # fmt: skip
