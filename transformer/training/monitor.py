"""Training-loop figures for TensorBoard and the progress bar: learning rate, tokens/s, padding."""

import time

from pytorch_lightning import Callback, LightningModule, Trainer


class TrainingMonitor(Callback):
    """Per step: train/lr, train/tokens_per_s (target tokens over the step's wall time: forward, backward and
    optimizer; all ranks together) and train/padding (the fraction of batch cells that are padding)."""

    def __init__(self):
        self._start: float | None = None

    def on_train_batch_start(self, trainer: Trainer, module: LightningModule, batch: dict, batch_idx: int) -> None:
        self._start = time.perf_counter()

    def on_train_batch_end(
        self, trainer: Trainer, module: LightningModule, outputs, batch: dict, batch_idx: int
    ) -> None:
        # Lightning runs checkpoint callbacks after the others, so a checkpoint's save time is not counted here.
        seconds = time.perf_counter() - self._start
        cells = batch["src"].numel() + batch["tgt_out"].numel()  # shapes and the collator's counts: host values
        module.log("train/tokens_per_s", batch["tgt_tokens"] * trainer.world_size / seconds, prog_bar=True)
        module.log("train/padding", 1 - (batch["src_tokens"] + batch["tgt_tokens"]) / cells)
        module.log("train/lr", trainer.optimizers[0].param_groups[0]["lr"])
