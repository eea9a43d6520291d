"""The progress bar: Lightning's, showing what the host already knows of the training steps."""

import time

from pytorch_lightning import LightningModule, Trainer
from pytorch_lightning.callbacks import TQDMProgressBar


class ProgressBar(TQDMProgressBar):
    """Lightning's TQDMProgressBar with the loss of the module's last step readout (a Python float), where a loss
    logged with prog_bar=True would be read from the device at every refresh, and the target tokens per second of
    wall clock since the bar's last refresh (all ranks together), from the collator's counts."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._tokens, self._since = 0, time.perf_counter()

    def on_train_batch_end(self, trainer: Trainer, module: LightningModule, outputs, batch: dict, batch_idx: int):
        self._tokens += batch["tgt_tokens"] * trainer.world_size
        super().on_train_batch_end(trainer, module, outputs, batch, batch_idx)

    def get_metrics(self, trainer: Trainer, module: LightningModule) -> dict:
        metrics = super().get_metrics(trainer, module)  # the validation figures: host values since validation ended
        if module.readout is not None:
            metrics["loss"] = f"{module.readout.loss:.3f}"
        now = time.perf_counter()
        if self._tokens:
            metrics["tok/s"] = f"{self._tokens / max(now - self._since, 1e-9):,.0f}"
        self._tokens, self._since = 0, now
        return metrics
