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
        pad = module.model_config.pad_id
        tokens = int(batch["tgt_out"].ne(pad).sum()) * trainer.world_size
        padded = int(batch["src"].eq(pad).sum() + batch["tgt_out"].eq(pad).sum())
        module.log("train/tokens_per_s", tokens / seconds, prog_bar=True)
        module.log("train/padding", padded / (batch["src"].numel() + batch["tgt_out"].numel()))
        module.log("train/lr", trainer.optimizers[0].param_groups[0]["lr"])
