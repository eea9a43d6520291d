"""The progress bar: Lightning's, showing the last optimizer step's loss as the host already knows it."""

from pytorch_lightning import LightningModule, Trainer
from pytorch_lightning.callbacks import TQDMProgressBar


class ProgressBar(TQDMProgressBar):
    """Lightning's TQDMProgressBar with the loss of the module's readout (a Python float), where a loss logged with
    prog_bar=True would be read from the device at every refresh."""

    def get_metrics(self, trainer: Trainer, module: LightningModule) -> dict:
        metrics = super().get_metrics(trainer, module)  # the validation figures: host values since validation ended
        if module.readout is not None:
            metrics["loss"] = f"{module.readout.loss:.3f}"
        return metrics
