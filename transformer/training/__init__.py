"""Training: the LightningModule and its optimisation config."""

from .module import OptimConfig, TranslationModule

__all__ = ["OptimConfig", "TranslationModule"]
