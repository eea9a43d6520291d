"""The progress bar: Lightning's, whichever it picks (Rich where the `rich` package is installed, else tqdm), showing
what the host already knows of the training steps."""

import time

from pytorch_lightning import LightningModule, Trainer
from pytorch_lightning.callbacks import Callback, RichProgressBar, TQDMProgressBar


class TokenRate:
    """Target tokens per second of wall clock since it was last read."""

    def __init__(self):
        self.tokens, self.since = 0, time.perf_counter()

    def add(self, tokens: int) -> None:
        self.tokens += tokens

    def read(self) -> float | None:
        now, tokens = time.perf_counter(), self.tokens
        rate = tokens / max(now - self.since, 1e-9) if tokens else None
        self.tokens, self.since = 0, now
        return rate


class ReadoutMetrics:
    """What a Lightning bar shows, with the loss of the module's last step readout (a Python float), where a loss
    logged with prog_bar=True would be read from the device at every refresh, and the target tokens per second since
    the bar's last refresh (all ranks together), from the collator's counts. Mixed into each of Lightning's bars."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.rate = TokenRate()

    def on_train_batch_end(self, trainer: Trainer, module: LightningModule, outputs, batch: dict, batch_idx: int):
        self.rate.add(batch["tgt_tokens"] * trainer.world_size)
        super().on_train_batch_end(trainer, module, outputs, batch, batch_idx)

    def get_metrics(self, trainer: Trainer, module: LightningModule) -> dict:
        metrics = super().get_metrics(trainer, module)  # the validation figures: host values since validation ended
        if module.ledger.readout is not None:
            metrics["loss"] = f"{module.ledger.readout.loss:.3f}"
        if (rate := self.rate.read()) is not None:
            metrics["tok/s"] = f"{rate:,.0f}"
        return metrics


class ProgressBar(ReadoutMetrics, TQDMProgressBar):
    pass


class RichBar(ReadoutMetrics, RichProgressBar):
    pass


def in_place_of(bar: Callback | None) -> Callback | None:
    """Ours in place of the bar Lightning made itself (a config's own bar, or a subclass, is left as it is)."""
    if type(bar) is TQDMProgressBar:
        return ProgressBar(bar.refresh_rate, bar.process_position)
    if type(bar) is RichProgressBar:
        return RichBar(bar.refresh_rate)
    return None
